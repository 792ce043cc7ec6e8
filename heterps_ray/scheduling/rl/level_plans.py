"""Plans from exact's level walk, cut to a deadline: candidates for the RL scheduler.

A plan costs R · N / 3600 / Θ. At a target throughput X the cheapest cost rate of the plans reaching X
is a shortest path over stage segments (segment_paths; base_levels.BaseLevels prices a level so), and
exact walks the levels from the floor up with a proof (levels.py). The RL scheduler cannot afford that
proof at 120 layers x 8 types within its 2 s, but the same walk with cheap levels lands within a few %
of the optimum, often on it, where the policy's plans and the local moves of polish.py do not (issue 26:
the optimum spreads over 6-8 stages on 4-5 types under binding instance limits, out of reach of
one-layer and one-stage moves):

1. the relaxed DP (each stage within its own type's limit, not their sum; one DP, a few ms at
   120 x 8) at a geometric grid of levels from the floor to LEVEL_SPAN x the floor, up to the first
   level no plan reaches: candidates, incumbents for the walk's skips, and that ceiling;
2. exact's walk from the floor (levels.cheapest's steps and skips) with each level solved quickly
   (BaseLevels.solve_level(quick=True): the counting DP over the types whose limits bind, with at
   most COUNT_STATES count states, else the Lagrangian's best path; never the ILP): step past what
   the level's plan reaches, skip the levels whose relaxed rate shows that no plan there beats the
   best plan known (the policy's, the references', the walk's own), stop at the ceiling or the
   deadline. Optimal levels, but no proof that the walk saw them all: a heuristic with a deadline.

Every path is re-priced by exact provisioning (ProblemView.record) like any other candidate, so this
serves the true model too: with runtime terms the DP prices the base model, the candidate the true one.

With runtime terms the base model's DP misses where the loop's sum over the stages decides: the
optimum of a GPU cloud is often a deep pipeline of one-replica stages balanced at the floor (issue 40,
seed 15: 11 stages on 5 types), which no base-model level proposes. There :func:`scouted_plans` adds
exact's own incumbents for the runtime levels (runtime_levels.RuntimeLevels.scout: the DP with the loop
priced in, at levels from the floor to the throughput bound), to a deadline.
"""

from __future__ import annotations

import math
import time

import numpy as np

from heterps_ray.costmodel.formulas import FLOOR_RTOL, S_PER_HOUR
from heterps_ray.scheduling.base_levels import BaseLevels
from heterps_ray.scheduling.provisioning import STEP_RTOL
from heterps_ray.scheduling.rl.env import EpisodeResult, ProblemView
from heterps_ray.scheduling.runtime_levels import RuntimeLevels

LEVELS = 24  # levels of the relaxed pass
LEVEL_SPAN = 4.0  # the relaxed pass's highest level, x the floor (the optimum rarely lies above 2x)
COUNT_STATES = 2048  # the most instance-count states of the counting DP a level may use here
# Of scouted_plans' time, the share its levels may take; the rest provisions their plans (~1 ms each,
# a few hundred at 120 x 8)
SCOUT_SHARE = 0.6


def level_plans(view: ProblemView, deadline: float, steps: int | None = None) -> list[EpisodeResult]:
    """The plans of the levels solved before `deadline` (perf_counter), provisioned; [] without a floor.
    `steps`: at most this many quick levels of the walk (with deadline=inf: the same plans on every run)."""
    model = view.model
    if not model.floor > 0.0:
        return []
    pricing = BaseLevels(model, state_limit=COUNT_STATES)
    found: list[EpisodeResult] = []
    ceiling = math.inf  # the first level of the relaxed pass that no plan reaches: no plan is faster
    for target in model.floor * np.geomspace(1.0, LEVEL_SPAN, LEVELS):
        if time.perf_counter() >= deadline:
            return found
        level = pricing.solve_level(float(target), relaxed=True)
        if level is None:
            ceiling = float(target)
            break
        found.append(view.record(level.assignment))
    found += _walk(view, pricing, model.floor * (1.0 - FLOOR_RTOL), ceiling, deadline, steps)
    return found


def scouted_plans(view: ProblemView, deadline: float) -> list[EpisodeResult]:
    """On a problem with runtime terms, the plans the runtime levels scout, provisioned, until
    `deadline` (perf_counter; inf: all of them); [] on the base model or without a floor."""
    model = view.model
    if model.problem.runtime is None or not model.floor > 0.0:
        return []
    remaining = deadline - time.perf_counter()
    if remaining <= 0.0:
        return []
    pricing = RuntimeLevels(model, time_limit_s=remaining * SCOUT_SHARE if math.isfinite(remaining) else None)
    found: list[EpisodeResult] = []
    for assignment in pricing.scout(model.floor, pricing.throughput_bound(model.floor)):
        if time.perf_counter() >= deadline:
            break
        found.append(view.record(assignment))
    return found


def _walk(
    view: ProblemView,
    pricing: BaseLevels,
    target: float,
    ceiling: float,
    deadline: float,
    steps: int | None = None,
) -> list[EpisodeResult]:
    """levels.cheapest's walk from `target` with quick levels, up to `ceiling`, `deadline` or `steps` levels."""
    to_cost = view.model.samples / S_PER_HOUR
    found: list[EpisodeResult] = []
    while target < ceiling and time.perf_counter() < deadline and (steps is None or len(found) < steps):
        bound = pricing.solve_level(target, relaxed=True)  # its rate <= R*(X) for every X >= target
        if bound is None:
            break
        best = view.best.cost if view.best is not None else math.inf
        if bound.rate * to_cost / ceiling >= best:
            break  # every plan from here costs R · N / 3600 / Θ >= that (Θ < ceiling)
        skip_to = bound.rate * to_cost / best  # a plan with Θ below it costs more than the best
        if skip_to > target * (1.0 + STEP_RTOL):
            target = skip_to
            continue
        level = pricing.solve_level(target, quick=True)
        if level is None:
            break  # no plan within the limits reaches the level (or none was met), nor any above
        found.append(view.record(level.assignment))
        target = max(level.throughput, target) * (1.0 + STEP_RTOL)
    return found
