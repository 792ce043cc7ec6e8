"""`heterps` — the command line of heterps_ray.

Each part of the system registers its own sub-commands (a `commands.py` beside its code), so
this file only assembles them and turns user errors into exit codes:
0 success, 2 bad input (config, problem, plan or data), 3 no plan meets the throughput floor.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from heterps_ray.errors import HeterPSError

# Modules that define `register(subparsers)`; order is the order in `heterps --help`.
_COMMAND_MODULES = (
    "heterps_ray.closedloop.commands",
    "heterps_ray.data.commands",
    "heterps_ray.closedloop.profile_command",
    "heterps_ray.costmodel.commands",
    "heterps_ray.runtime.commands",
    "heterps_ray.serving.commands",
    "heterps_ray.deploy.commands",
    "heterps_ray.scheduling.commands",
    "heterps_ray.experiments.commands",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="heterps",
        description="Train CTR models on a heterogeneous Ray cluster at a throughput floor, for the least money.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="more log output (Ray and heterps_ray)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    check = sub.add_parser("check", help="validate a job config (and the model and cluster it names)")
    check.add_argument("job", help="job YAML file")
    check.set_defaults(func=_check)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # that part of the system is not installed in this build
        module.register(sub)
    return parser


def _check(args: argparse.Namespace) -> int:
    from heterps_ray.config import load_job

    job = load_job(args.job)
    types = ", ".join(
        f"{t.name} ({t.device}, ${t.price_per_hour}/h, <= {t.max_instances})"
        for t in job.cluster.resource_types
    )
    print(f"{args.job}: ok — model {job.model.name}, cluster {job.cluster.name}: {types}; mode {job.mode}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    if not args.verbose:
        # Quiet by default: RLlib and Tune log deprecation notes and set-up chatter at WARNING.
        for name in ("ray.rllib", "ray.tune", "ray.train", "ray._common.deprecation"):
            logging.getLogger(name).setLevel(logging.ERROR)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except Exception as exc:
        error = _user_error(exc)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    finally:
        _release_warm_actors()


def _release_warm_actors() -> None:
    """A command is its driver's whole work: the actors it kept warm between its own runs (probes,
    re-plans) go with it, also when it ran in a process that keeps Ray (a notebook, the tests)."""
    if "heterps_ray.runtime.warm" in sys.modules:
        from heterps_ray.runtime.warm import release_idle

        release_idle()


def _user_error(exc: BaseException) -> HeterPSError | None:
    """The user error behind `exc`: itself, or the one an actor raised (Ray wraps it in a RayTaskError
    whose `cause` it is, and whose text is a remote traceback; a call that reached a second actor wraps
    it twice; a GPU type's actor that found no GPU in its constructor arrives as an ActorDiedError)."""
    from heterps_ray.devices import unwrap

    seen: set[int] = set()
    current: BaseException | None = unwrap(exc)
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        cause = getattr(current, "cause", None)
        if isinstance(cause, BaseException):  # a RayTaskError: also an instance of its cause's type
            current = cause
        elif isinstance(current, HeterPSError):
            return current
        else:
            current = current.__cause__
    return None

if __name__ == "__main__":
    sys.exit(main())
