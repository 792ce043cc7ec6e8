"""Elastic training, the runtime's side: notice that the Ray cluster's resource types changed and stop
at a checkpoint (:class:`ResourcesChanged`), so that `heterps run` can re-plan and resume
(heterps_ray/closedloop: the problem restricted to the types present, a joined type profiled).

The driver checks :func:`present_types` once per chunk (one GCS call). A type of the plan that
disappears, or a declared type that appears, raises :class:`ResourcesChanged`; so does an actor
death whose type can no longer be placed.
"""

from __future__ import annotations

from pathlib import Path

from heterps_ray.config import ClusterConfig


class ResourcesChanged(Exception):
    """The cluster's resource types changed mid-run; resume from `checkpoint` (None: from the start)."""

    def __init__(
        self,
        reason: str,
        before: list[str],
        now: list[str],
        step: int,
        checkpoint: Path | None,
        between_chunks: bool = False,
    ):
        self.reason, self.before, self.now, self.step, self.checkpoint = reason, before, now, step, checkpoint
        # raised by the chunk loop between chunks: no call of the run in flight, its live actors reusable
        self.between_chunks = between_chunks
        self.start: dict[str, float | None] = {}  # how long the run took to start (driver._start_timing)
        super().__init__(f"{reason} at step {step} (types before {before}, now {now})")


def present_types(cluster: ClusterConfig) -> list[str]:
    """The cluster config's resource types that the Ray cluster declares now (at least one unit)."""
    import ray

    have = ray.cluster_resources()
    return [t.name for t in cluster.resource_types if have.get(t.name, 0) >= 1]


def change_reason(before: list[str], now: list[str], plan_types: set[str]) -> str | None:
    """Why the run must re-plan (a plan type gone, a declared type new), or None."""
    gone = sorted(plan_types - set(now))
    if gone:
        return f"resource type(s) {gone} of the plan disappeared"
    new = sorted(set(now) - set(before))
    if new:
        return f"resource type(s) {new} appeared"
    return None
