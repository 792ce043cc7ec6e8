"""Actor processes that can be made into a fresh instance: the runtime keeps a finished run's actors
warm (heterps_ray/runtime/warm.py) because a process that has imported torch takes seconds to start.

A class is reusable when ``__init__`` sets its whole state: :meth:`Reusable.reconfigure` stops what
the instance owns (``teardown``), drops every attribute and runs ``__init__`` again with the new
arguments, so nothing of the last run (table rows, optimizer state, armed faults, counters) survives.
An actor can also be *blank* (:func:`blank_class`, or ``reconfigure()`` with no arguments): a process
with its class's imports done and nothing configured, which the profiler times layers in
(heterps_ray.profiling_host.ProfilingHost) before the runs that follow reconfigure it. Each actor
class describes where it runs with :func:`actor_placement`.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import ray


class Reusable:
    """Mixin of the runtime's actor classes (PS shard, DataWorker, StageWorker)."""

    def teardown(self) -> None:
        """Stop what the instance owns beyond its attributes (threads); a no-op unless overridden."""

    def reconfigure(self, *args: Any) -> None:
        """Become a fresh instance built from `args`, as if the actor had just been created with them
        (no `args`: a blank one)."""
        if not self.__dict__.get("_blank", False):
            self.teardown()
        self.__dict__.clear()
        if args:
            self.__init__(*args)  # type: ignore[misc]
        else:
            self._blank = True


@cache
def blank_class(cls: type) -> type:
    """`cls` with a constructor that takes no arguments too (a blank instance, configured later by
    ``reconfigure``): ``ray.remote(blank_class(DataWorker)).remote()`` starts the process only."""

    def __init__(self: Any, *args: Any) -> None:
        if args:
            cls.__init__(self, *args)  # type: ignore[misc]
        else:
            self._blank = True

    return type(cls.__name__, (cls,), {"__init__": __init__})


def actor_placement(**fields: Any) -> dict[str, Any]:
    """What the running actor was given by Ray: node, pid, assigned resources, OpenMP wait policy."""
    ctx = ray.get_runtime_context()
    return {
        **fields,
        "pid": os.getpid(),
        "node_id": ctx.get_node_id(),
        "actor_id": ctx.get_actor_id(),
        "resources": ctx.get_assigned_resources(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
