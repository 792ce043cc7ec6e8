"""One error type for everything a user can get wrong, with the CLI exit code it maps to."""

from __future__ import annotations

# Exit codes of the `heterps` CLI (documented in docs/troubleshooting.md).
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3


class HeterPSError(Exception):
    """A user-facing error: the message says what was wrong and how to fix it.

    ``exit_code`` is what the CLI exits with; ``category`` groups errors for tests and logs.
    """

    exit_code = EXIT_BAD_INPUT
    category = "error"


class ConfigError(HeterPSError):
    """A config, problem or plan file is malformed: names the file, the field and what was expected."""

    category = "config"

    def __init__(self, file: str | None, field: str, expected: str, got: object = None):
        self.file, self.field, self.expected, self.got = file, field, expected, got
        where = f"{file}: " if file else ""
        got_text = "" if got is None else f" (got {got!r})"
        super().__init__(f"{where}field '{field}': expected {expected}{got_text}")

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        # Errors raised inside Ray actors are pickled back to the driver: keep every argument.
        return type(self), (self.file, self.field, self.expected, self.got)


class DataError(HeterPSError):
    """Input data is missing, unreadable or malformed."""

    category = "data"


class StorageError(HeterPSError):
    """A file of the run could not be written (a full disk, a lost mount); what was written before stays."""

    category = "storage"
    exit_code = 1


class WaitTimeout(HeterPSError):
    """Something the run waited for did not come by its deadline (an actor stuck or never placed, a node
    gone): the message names what, how long, and where the limit is set."""

    category = "timeout"
    exit_code = 1


class InfeasibleError(HeterPSError):
    """No plan reaches the throughput floor; the message gives the highest reachable throughput."""

    category = "infeasible"
    exit_code = EXIT_INFEASIBLE

    def __init__(self, message: str, best_throughput: float):
        self.best_throughput = best_throughput
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.args[0], self.best_throughput)
