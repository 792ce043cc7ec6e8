"""The cost/throughput frontier of a problem: the cheapest plan's cost as the throughput floor rises.

The optimum at floor f (a plan reaching Θ >= f) stays optimal for every floor in [f, Θ], because
raising the floor only removes plans. So the frontier is a step function, and walking
f -> Θ (1 + 1e-6) visits its steps exactly — for the exact optimum (any mix of types) and for the
best single-type plan alike. `max_points` bounds the walk; past it, floors advance by at least
1/max_points of the range, and the curve is exact at the floors it visits.

Example::

    table = frontier(load_problem("configs/problems/ctr_dnn_cloud.yaml"))
    plot_frontier(table, "frontier.png")
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd

from heterps_ray.costmodel import Plan, Problem
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.baselines import SingleTypeScheduler
from heterps_ray.scheduling.exact import max_reachable_throughput

_STEP_RTOL = (
    1e-6  # next floor just above the last plan's throughput, beyond the cost model's 1e-9 floor slack
)


def with_floor(problem: Problem, throughput_min: float) -> Problem:
    """The same problem at another throughput floor (samples/s)."""
    return problem.model_copy(update={"throughput_min": float(throughput_min)})


def frontier(
    problem: Problem, *, low: float = 0.02, high: float = 1.15, max_points: int = 200
) -> pd.DataFrame:
    """Exact and best single-type cost at floors from `low` to `high` x the highest reachable throughput.

    One row per floor where either curve steps; columns: throughput_min, exact_cost,
    exact_feasible, exact_throughput, exact_assignment, single_cost, single_feasible,
    single_throughput, single_type, best_throughput (the highest throughput any plan reaches).
    """
    theta_max = max_reachable_throughput(problem)
    if not theta_max > 0.0 or not math.isfinite(theta_max):
        raise ValueError(
            f"problem {problem.name!r}: no plan reaches a positive, finite throughput ({theta_max})"
        )
    start, stop = low * theta_max, high * theta_max
    min_step = (stop - start) / max_points
    exact = _walk(problem, lambda p: get_scheduler("exact").schedule(p), start, stop, min_step, "exact")
    single = (
        _walk(problem, lambda p: SingleTypeScheduler().schedule(p), start, stop, min_step, "single")
        if problem.types_running_all_layers()
        else pd.DataFrame({"throughput_min": [start], "single_cost": [math.inf], "single_feasible": [False]})
    )
    floors = pd.DataFrame(
        {"throughput_min": sorted(set(exact["throughput_min"]) | set(single["throughput_min"]))}
    )
    table = pd.merge_asof(floors, exact, on="throughput_min", direction="backward")
    table = pd.merge_asof(table, single, on="throughput_min", direction="backward")
    table["best_throughput"] = theta_max
    return table


def _walk(
    problem: Problem,
    schedule: Callable[[Problem], Plan],
    start: float,
    stop: float,
    min_step: float,
    prefix: str,
) -> pd.DataFrame:
    """Rows (floor, the plan found at that floor) at each step of one scheduler's frontier."""
    rows = []
    floor = start
    while floor <= stop:
        plan = schedule(with_floor(problem, floor))
        rows.append(
            {
                "throughput_min": floor,
                f"{prefix}_cost": plan.cost if plan.feasible else math.inf,
                f"{prefix}_feasible": plan.feasible,
                f"{prefix}_throughput": plan.throughput,
                f"{prefix}_assignment" if prefix == "exact" else f"{prefix}_type": (
                    " ".join(plan.assignment) if prefix == "exact" else plan.assignment[0]
                ),
            }
        )
        if not plan.feasible:
            # nothing faster exists: one more row at the end of the range closes the curve
            if floor < stop:
                rows.append({**rows[-1], "throughput_min": stop})
            break
        floor = max(plan.throughput * (1.0 + _STEP_RTOL), floor + min_step)
    return pd.DataFrame(rows)
