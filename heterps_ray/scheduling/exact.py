"""Exact schedulers: brute force over assignments, and an exact search over throughput levels.

`brute` enumerates every assignment and provisions each exactly (T^L plans; small problems only).
`exact` does that up to BRUTE_FORCE_LIMIT assignments and the level search above it.

Above that, `exact` is the level walk (levels.py): one walk over target throughputs for both cost
models, with its bounds and proof, each level priced by the model's own `LevelPricing`: a DP over
stage segments for the base model (DESIGN.md §3, base_levels.py) and an ILP over the same segments
with the runtime terms' loop and host rows (§3b, runtime_levels.py, runtime_ilp.py). The base model is
the true model with no runtime terms; the walk is exact for any size (tests check it equals brute
force and, scheduling/milp.py, a second formulation).

Why not one ILP as the scheduler: cost R/Theta is not linear; with z = 1/Theta it is a sum of count x z
products, which milp.py linearises with a binary per count, a program whose relaxation is weak and
which HiGHS solves far slower than the walk at size. For a fixed level it is a shortest path with a
few side constraints, which the DPs solve exactly and fast (the ILP is the fallback for huge
instance limits).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from heterps_ray.costmodel import CostModel, Problem
from heterps_ray.costmodel.plan import Plan
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling.base import Scheduler, register_scheduler
from heterps_ray.scheduling.base_levels import DP_STATE_LIMIT, BaseLevels
from heterps_ray.scheduling.levels import TIME_LIMIT, LevelPricing, cheapest
from heterps_ray.scheduling.provisioning import Provisioned, plan_from_counts, provision_counts
from heterps_ray.scheduling.runtime_levels import RuntimeLevels

BRUTE_FORCE_LIMIT = 256  # assignments; above this `exact` (method "auto") uses the level search
RUNTIME_BRUTE_LIMIT = 200_000  # assignments `brute` enumerates for a problem with runtime terms


def count_assignments(problem: Problem) -> int:
    """Runnable assignments: the product over layers of the types that can run them."""
    return math.prod(len(layer.time_ms) for layer in problem.layers)


# ---------------------------------------------------------------------------------------------
# Brute force


def brute_force(
    problem: Problem, model: CostModel | None = None, limit: int = 1_000_000, scheduler: str = "brute"
) -> Plan:
    """Every runnable assignment, provisioned exactly; the cheapest feasible (else the fastest)."""
    started = time.perf_counter()
    model = model or CostModel(problem)
    n = count_assignments(problem)
    if n > limit:
        raise ConfigError(
            None, "scheduler", f"a problem with at most {limit:,} assignments for brute force", n
        )
    choices = [np.flatnonzero(model.runnable[li]).tolist() for li in range(problem.num_layers)]
    best: tuple[tuple[int, ...], Provisioned] | None = None
    fastest: tuple[tuple[int, ...], Provisioned] | None = None
    for assignment in itertools.product(*choices):
        counts = provision_counts(model, assignment)
        if counts.feasible and (best is None or counts.cost < best[1].cost):
            best = (assignment, counts)
        if fastest is None or (-counts.max_throughput, counts.cost) < (
            -fastest[1].max_throughput,
            fastest[1].cost,
        ):
            fastest = (assignment, counts)
    assert fastest is not None  # every layer can run somewhere (validated), so n >= 1
    chosen = best or fastest
    return plan_from_counts(
        problem,
        model,
        chosen[0],
        chosen[1],
        scheduler=scheduler,
        seconds=time.perf_counter() - started,
        plans_evaluated=n,
        best_throughput=fastest[1].max_throughput,
    )


# ---------------------------------------------------------------------------------------------
# The level walk (levels.py) with each model's pricing


def level_pricing(
    model: CostModel, time_limit_s: float | None = None, state_limit: int = DP_STATE_LIMIT
) -> LevelPricing:
    """The pricing of a level for `model`: ILP levels with runtime terms, DP levels without."""
    if model.problem.runtime is not None:
        return RuntimeLevels(model, time_limit_s)
    return BaseLevels(model, state_limit, time_limit_s)


def _singles(model: CostModel) -> list[tuple[int, ...]]:
    """The single-type assignments that run: the walk's first incumbents."""
    return [(t,) * model.num_layers for t in range(model.num_types) if model.runnable[:, t].all()]


def _fastest(pricing: LevelPricing) -> tuple[float, tuple[int, ...] | None]:
    """fastest_plan through `pricing`, from the fastest single-type plan."""
    known, fastest = 0.0, None
    for assignment in _singles(pricing.model):
        most = provision_counts(pricing.model, assignment).max_throughput
        if most > known:
            known, fastest = most, assignment
    theta_max, reached = pricing.fastest(known)
    return theta_max, reached or fastest


def level_search(
    problem: Problem,
    model: CostModel | None = None,
    state_limit: int = DP_STATE_LIMIT,
    time_limit_s: float | None = None,
    scheduler: str = "exact",
) -> Plan:
    """The exact optimum by the level walk (levels.py), on the problem's own model: with runtime terms
    each level an ILP (runtime_levels.py), without a DP (base_levels.py; `state_limit` caps the counting
    DP's states per level, above it a level goes to Lagrangian relaxation + ILP). With `time_limit_s`
    the walk stops there and returns the best plan found, plan.extra["proof"]["proven"] False."""
    started = time.perf_counter()
    model = model or CostModel(problem)
    pricing = level_pricing(model, time_limit_s, state_limit)
    found = cheapest(pricing, model.floor, _singles(model))
    best_throughput = None  # only needed, and only computed, when nothing meets the floor
    if found is None:
        timed_out = pricing.proof.stop == TIME_LIMIT
        best_throughput, reaching = _fastest(pricing)
        chosen = reaching or tuple(int(np.argmax(r)) for r in model.runnable)
        found = (chosen, provision_counts(model, chosen))
        if timed_out or pricing.proof.stop == TIME_LIMIT:
            pricing.proof.stop = TIME_LIMIT
            best_throughput = None  # the fastest found, not proven the fastest there is
        elif pricing.proof.stop != TIME_LIMIT:
            pricing.proof.stop += "; no plan meets the floor: fastest plan searched"
    counters = pricing.counters()
    return plan_from_counts(
        problem,
        model,
        found[0],
        found[1],
        scheduler=scheduler,
        seconds=time.perf_counter() - started,
        plans_evaluated=counters["levels_solved"],
        best_throughput=best_throughput,
        extra={
            "method": pricing.method,
            **counters,
            "proof": pricing.proof.to_extra(found[1].cost if found[1].feasible else None, counters),
        },
    )


def runtime_plan(problem: Problem, scheduler: str = "exact", time_limit_s: float | None = None) -> Plan:
    """The exact optimum of a problem with runtime terms (the level walk with ILP levels)."""
    if problem.runtime is None:
        raise ValueError("runtime_plan needs a problem with a `runtime` section")
    return level_search(problem, time_limit_s=time_limit_s, scheduler=scheduler)


def max_reachable_throughput(problem: Problem, relaxed: bool = False) -> float:
    """Highest throughput any plan of `problem` reaches within its max_instances (samples/s).

    relaxed: a fast upper bound (throughput_bounds' upper side)."""
    if relaxed:
        return throughput_bounds(problem).upper
    return _fastest(level_pricing(CostModel(problem)))[0]


def fastest_plan(
    problem: Problem, model: CostModel | None = None, known: float = 0.0
) -> tuple[float, tuple[int, ...] | None]:
    """(highest throughput any plan reaches within max_instances, the assignment of a plan that
    reaches it); (0.0, None) when no plan runs at all. One search decides both, so a scheduler that
    reports "infeasible" with this throughput cannot contradict itself. `known`: a throughput some
    plan is known to reach (speeds the search up, same answer)."""
    pricing = level_pricing(model or CostModel(problem))
    theta_max, reached = _fastest(pricing) if known <= 0.0 else pricing.fastest(known)
    return theta_max, reached


class ThroughputBounds(NamedTuple):
    """Bounds on the highest throughput any plan reaches (samples/s)."""

    lower: float  # a plan reaches it
    upper: float  # no plan exceeds it


def throughput_bounds(problem: Problem, model: CostModel | None = None) -> ThroughputBounds:
    """Bounds on the highest reachable throughput, fast (no ILP; ~0.1 s at 120 layers x 8 types).

    upper: the base model's relaxed level search (each stage within its own type's limit, not their
    sum: every plan passes it, so a level it fails no plan reaches); with runtime terms the bisection
    of RuntimeLevels.reachable, the same relaxation with the loop and hosts (its docstring says why
    every plan passes it). lower: the fastest counts of single-type plans and of the relaxed fastest
    plan's assignment, provisioned exactly (plans that exist). A floor above `upper` is met by no plan:
    the policy's refusal rests on it (rl/scheduler.py)."""
    model = model or CostModel(problem)
    singles = _singles(model)
    if problem.runtime is not None:
        runtime = RuntimeLevels(model)
        lower = max((provision_counts(model, a).max_throughput for a in singles), default=0.0)
        return ThroughputBounds(lower, runtime.throughput_bound(max(lower, 1e-9)))
    search = BaseLevels(model)
    upper = search.throughput_bound(0.0)
    level = search.solve_level(upper, relaxed=True) if upper > 0.0 else None
    if level is not None:
        singles.append(level.assignment)
    lower = max((provision_counts(model, a).max_throughput for a in singles), default=0.0)
    return ThroughputBounds(lower, upper)


@register_scheduler("exact")
class ExactScheduler(Scheduler):
    """The optimum. method: "auto" (brute force up to BRUTE_FORCE_LIMIT assignments, else the
    level walk: DP levels for the base model, ILP levels with runtime terms), "levels" (any
    size) or "brute" (small problems only). plan.extra["proof"] says what proves it optimal.
    budget_s: the level walk's time limit; past it, the best plan found, marked not proven."""

    name = "exact"

    def __init__(self, method: str = "auto", seed: int = 0, budget_s: float | None = None):
        if method not in ("levels", "brute", "auto"):
            raise ConfigError(None, "method", "levels, brute or auto", method)
        self.method = method
        self.budget_s = budget_s

    def schedule(self, problem: Problem) -> Plan:
        n = count_assignments(problem)
        use_brute = self.method == "brute" or (self.method == "auto" and n <= BRUTE_FORCE_LIMIT)
        if use_brute:
            limit = RUNTIME_BRUTE_LIMIT if problem.runtime is not None else 1_000_000
            plan = brute_force(problem, scheduler=self.name, limit=limit)
            proof = {"kind": "enumeration of every assignment, each provisioned exactly", "proven": True}
            return replace(plan, extra={**plan.extra, "method": "brute", "proof": proof})
        return level_search(problem, time_limit_s=self.budget_s, scheduler=self.name)


@register_scheduler("brute")
def _brute(seed: int = 0, budget_s: float | None = None) -> ExactScheduler:
    scheduler = ExactScheduler(method="brute")
    scheduler.name = "brute"
    return scheduler
