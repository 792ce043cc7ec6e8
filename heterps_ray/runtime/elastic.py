"""Elastic training: notice that the Ray cluster's resource types changed, stop at a checkpoint, and
restrict the planning problem to the types present so `heterps run` can re-plan and resume.

The driver checks :func:`present_types` once per chunk (one GCS call). A type of the plan that
disappears, or a declared type that appears, raises :class:`ResourcesChanged`; so does an actor
death whose type can no longer be placed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from heterps_ray.config import ClusterConfig
from heterps_ray.errors import InfeasibleError


class ResourcesChanged(Exception):
    """The cluster's resource types changed mid-run; resume from `checkpoint` (None: from the start)."""

    def __init__(self, reason: str, before: list[str], now: list[str], step: int, checkpoint: Path | None):
        self.reason, self.before, self.now, self.step, self.checkpoint = reason, before, now, step, checkpoint
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


def restrict_problem(problem: Any, types: list[str]) -> Any:
    """`problem` (a costmodel Problem) with only the resource `types`; profiles of the others are
    dropped from this copy only. InfeasibleError when the PS type or some layer's every type is gone."""
    from heterps_ray.costmodel import problem_from_dict

    data = problem.to_dict()
    keep = [r for r in data["resources"] if r["name"] in types]
    if problem.ps_resource not in types:
        raise InfeasibleError(
            f"the PS resource type {problem.ps_resource!r} is not in the cluster now (present: {types}); "
            "no plan can place the parameter servers",
            0.0,
        )
    data["resources"] = keep
    if data.get("hosts"):  # a shared machine keeps only the types still present on it
        for host in data["hosts"]:
            host["types"] = [t for t in host["types"] if t in types]
        data["hosts"] = [host for host in data["hosts"] if host["types"]] or None
    data.setdefault("ps", {})["resource"] = problem.ps_resource
    for layer in data["layers"]:
        layer["time_ms"] = {t: v for t, v in layer["time_ms"].items() if t in types}
        if not layer["time_ms"]:
            raise InfeasibleError(
                f"layer {layer['name']!r} can run on none of the resource types present now ({types})", 0.0
            )
    return problem_from_dict(data)
