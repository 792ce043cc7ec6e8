"""Calibrate a problem on a run's own measurement, so the cost model agrees with the runtime.

`heterps run` keeps its throughput floor in closed loop: when the steady throughput a plan achieves
falls short of the floor, the model that promised it was wrong about the resource types that plan
used. :func:`refit` makes the model agree with that measurement, and the job's scheduler re-plans on
the result.

Example::

    better = refit(problem, plan, achieved=12_400.0)
    CostModel(better).evaluate(plan.assignment, [s.replicas for s in plan.stages], plan.ps_shards)
    # .throughput == 12_400.0
"""

from __future__ import annotations

import math
from typing import Any

from heterps_ray.costmodel.analytic import CostModel
from heterps_ray.costmodel.problem import Problem, problem_from_dict

_MAX_ROUNDS = 8  # fixed-point rounds; a problem whose every term is a time needs one
_RTOL = 1e-9  # relative agreement with the measurement that ends the rounds


def predicted_throughput(problem: Problem, plan: Any) -> float:
    """What the cost model of `problem` promises for `plan` (a scheduling Plan: assignment by type
    name, stages with replicas, PS shards), samples/s."""
    replicas = [int(s.replicas) for s in plan.stages]
    return CostModel(problem).evaluate(list(plan.assignment), replicas, int(plan.ps_shards)).throughput


def refit(problem: Problem, plan: Any, achieved: float) -> Problem:
    """`problem` with the resource types `plan` used (its stages' types and the PS type) slowed down
    (or sped up) by one factor, so that its cost model prices `plan` at `achieved` samples/s.

    Every time-like quantity of those types is multiplied by f = predicted / achieved: every field
    with ``ms`` in its name (``latency_ms``, ``call_overhead_ms``, ``ps_wait_ms_per_row``; recursively,
    so the ``runtime:`` terms of DESIGN.md §3b are included, and of a per-type mapping such as
    ``runtime.call_ms`` only the used types' entries), the layers' ``time_ms`` (fixed and per sample)
    on the types of the plan's stages (all layers on them, so that a re-plan moving layers between
    types sees each type at its measured speed; not on a type that only hosts the PS); every
    ``*_gbps`` bandwidth and ``ps.rows_per_second_per_shard`` are divided by f. The other types keep
    their profile: nothing was measured about them.

    Why one factor, not one per stage: a run gives one trustworthy figure, its steady throughput.
    The stages' busy fractions (``RunSummary.stages``) do not separate a stage's own compute from
    the time it waits on its neighbours and on the PS (in sync mode every stage waits for the whole
    batch), and several stages may share one type, so per-stage factors are not identified by them.
    Scaling every time of the plan's types by the same f keeps the model's shape (which stage binds,
    how replicas scale) and moves its level to the measurement. Where the model has terms that do
    not scale with the times (a constant of some runtime term), the factor is corrected by a
    few fixed-point rounds until the model prices `plan` at `achieved` to within 1e-9.
    """
    if not achieved > 0 or not math.isfinite(achieved):
        raise ValueError(f"achieved throughput must be a positive number of samples/s (got {achieved!r})")
    stage_types = {str(s.type) for s in plan.stages}
    used = stage_types | {problem.ps_resource}
    refitted = problem
    for _ in range(_MAX_ROUNDS):
        predicted = predicted_throughput(refitted, plan)
        if not predicted > 0 or not math.isfinite(predicted):
            raise ValueError(f"the model prices the plan at {predicted!r} samples/s; nothing to scale")
        factor = predicted / achieved
        if abs(factor - 1.0) <= _RTOL:
            break
        refitted = problem_from_dict(_scaled(refitted.to_dict(), used, factor, stage_types))
    return refitted


def scale_times(problem: Problem, factor: float, types: set[str] | None = None) -> Problem:
    """`problem` with every time of the resource `types` (default: all) multiplied by `factor` and
    their bandwidths and PS service rate divided by it, as :func:`refit` does: a model `factor`
    times slower (over 1) or faster (under 1) on those types. ``scale_times(p, 0.3)`` is a
    deliberately optimistic profile (tests of the closed loop)."""
    if not factor > 0 or not math.isfinite(factor):
        raise ValueError(f"factor must be a positive number (got {factor!r})")
    used = set(problem.type_names) if types is None else set(types)
    return problem_from_dict(_scaled(problem.to_dict(), used, factor, used))


def _scaled(data: dict[str, Any], used: set[str], factor: float, layer_types: set[str]) -> dict[str, Any]:
    """The problem mapping with the times of the `used` types multiplied by `factor` (the layers'
    times on `layer_types` only: a type that only hosts the PS ran none of the plan's layers)."""
    others = {r["name"] for r in data["resources"]} - used  # per-type entries of these stay as they are
    out = dict(data)
    out["resources"] = [
        _scale_times(r, factor, others) if r["name"] in used else r for r in data["resources"]
    ]
    out["layers"] = [
        {
            **layer,
            "time_ms": {
                t: (_scale_layer_time(v, factor, others) if t in layer_types else v)
                for t, v in layer["time_ms"].items()
            },
        }
        for layer in data["layers"]
    ]
    if data.get("hosts"):  # a machine the used types run on: its per-call CPU is a time too
        out["hosts"] = [
            _scale_times(h, factor, others) if used & set(h["types"]) else h for h in data["hosts"]
        ]
    ps = dict(data.get("ps") or {})
    if (ps.get("resource") or data["resources"][0]["name"]) in used:
        if ps.get("rows_per_second_per_shard") is not None:
            ps["rows_per_second_per_shard"] = ps["rows_per_second_per_shard"] / factor
        out["ps"] = _scale_times(ps, factor, others)
    for key, value in data.items():  # a `runtime:` section (DESIGN.md §3b) and any other block
        if key not in ("resources", "layers", "hosts", "ps") and isinstance(value, dict | list):
            out[key] = _scale_times(value, factor, others)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _unit(key: Any) -> str | None:
    """'ms' for a time-like field (`fixed_ms`, `call_ms`, `ps_wait_ms_per_row`), 'gbps' for a bandwidth."""
    words = key.split("_") if isinstance(key, str) else []
    return "ms" if "ms" in words else "gbps" if "gbps" in words else None


def _scale_times(value: Any, factor: float, others: set[str], unit: str | None = None) -> Any:
    """Recursively: time-like numbers (a field with `ms` in its name, or an entry of a mapping under
    one, such as `call_ms: {type: ms}`) times `factor`, bandwidths (`gbps`) over it; entries keyed by
    a type in `others` (not used by the plan) and everything else unchanged."""
    if _is_number(value):
        return value * factor if unit == "ms" else value / factor if unit == "gbps" else value
    if isinstance(value, list):
        return [_scale_times(v, factor, others, unit) for v in value]
    if not isinstance(value, dict):
        return value
    return {
        key: v if key in others else _scale_times(v, factor, others, _unit(key) or unit)
        for key, v in value.items()
    }


def _scale_layer_time(value: dict[str, Any], factor: float, others: set[str]) -> dict[str, Any]:
    """A layer's `time_ms` entry on a used type: fixed and per-sample ms (and any `*_ms`) times `factor`."""
    out = _scale_times(value, factor, others)
    for key in ("fixed", "per_sample"):
        if _is_number(out.get(key)):
            out[key] = out[key] * factor
    return out
