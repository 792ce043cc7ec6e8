"""Elastic training: notice that the Ray cluster's resource types changed, stop at a checkpoint, and
restrict the planning problem to the types present so `heterps run` can re-plan and resume. A type
that joins and was not profiled at the start is profiled when it joins (:func:`profile_joined_types`).

The driver checks :func:`present_types` once per chunk (one GCS call). A type of the plan that
disappears, or a declared type that appears, raises :class:`ResourcesChanged`; so does an actor
death whose type can no longer be placed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from heterps_ray.config import ClusterConfig, JobConfig
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


def profile_joined_types(
    job: JobConfig, problem: Any, types: list[str], settings: Any
) -> tuple[Any, list[str]]:
    """`problem` with the `types` it has no profile of (they joined the cluster mid-run) measured now on
    real actors, with the same `settings` (a ProfileSettings) as the first profile, and their fitted
    entries merged in: each layer's time_ms on them (calibrated by their runtime probes), their resource
    entry (bandwidth and latency from transfers to their own kind and to the PS type, read rate, per-call
    work) and their probes' call_ms (DESIGN.md §3b). The PS type is
    profiled beside them (its actors host the PS run and the other end of the transfers; a PS shard on
    a joined type could find no slot beside its two profiling actors) but its entries, like every
    other type's, the PS service rate and the parallel fractions, stay as first measured. Returns the
    problem and the types profiled (none when no type joined, or the PS type is gone: no plan then)."""
    from heterps_ray.costmodel import problem_from_dict
    from heterps_ray.models import build_model
    from heterps_ray.profiling.profiler import fit_runs, measure

    joined = [t for t in types if t not in problem.type_names]
    if not joined or problem.ps_resource not in types:
        return problem, []
    measured = [problem.ps_resource, *joined]
    cluster = job.cluster.model_copy(
        update={
            "resource_types": [job.cluster.type(t) for t in measured],
            "ps": job.cluster.ps.model_copy(update={"resource": problem.ps_resource}),
        }
    )
    both = job.model_copy(update={"cluster": cluster})
    fitted = fit_runs(both, [measure(both, build_model(job.model), settings)], settings).problem
    data = problem.to_dict()
    data["resources"] += [r for r in fitted["resources"] if r["name"] in joined]
    by_name = {layer["name"]: layer for layer in fitted["layers"]}
    for layer in data["layers"]:
        layer["time_ms"].update({t: v for t, v in by_name[layer["name"]]["time_ms"].items() if t in joined})
    calls = (fitted.get("runtime") or {}).get("call_ms", {})  # the probes' call terms of the joined types
    if "runtime" in data and calls:
        data["runtime"]["call_ms"] = {
            **data["runtime"].get("call_ms", {}),
            **{t: calls[t] for t in joined if t in calls},
        }
    return problem_from_dict(data), joined
