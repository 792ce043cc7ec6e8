"""Actor processes that can be made into a fresh instance: the runtime keeps a finished run's actors
warm (heterps_ray/runtime/warm.py) because a process that has imported torch takes seconds to start.

A class is reusable when ``__init__`` sets its whole state: :meth:`Reusable.reconfigure` stops what
the instance owns (``teardown``), drops every attribute and runs ``__init__`` again with the new
arguments, so nothing of the last run (table rows, optimizer state, armed faults, counters) survives.
"""

from __future__ import annotations

from typing import Any


class Reusable:
    """Mixin of the runtime's actor classes (PS shard, DataWorker, StageWorker)."""

    def teardown(self) -> None:
        """Stop what the instance owns beyond its attributes (threads); a no-op unless overridden."""

    def reconfigure(self, *args: Any) -> None:
        """Become a fresh instance built from `args`, as if the actor had just been created with them."""
        self.teardown()
        self.__dict__.clear()
        self.__init__(*args)  # type: ignore[misc]
