"""Plans from exact's level DP at a few target throughputs: candidates for the RL scheduler.

A plan costs R · N / 3600 / Θ. At a target throughput X the cheapest cost rate of the plans reaching X
is a shortest path over stage segments (segment_paths; base_levels.BaseLevels prices a level so), and
exact walks every level with a proof. The RL scheduler cannot afford that walk at 120 layers x 8 types
within its 2 s, but a few levels solved cheaply land within a few % of the optimum where the policy's
plans and the local moves of polish.py do not (issue 26: the optimum spreads over 6-8 stages on 4-5
types under binding instance limits, out of reach of one-layer and one-stage moves):

1. the relaxed DP (each stage within its own type's limit, not their sum; one DP, a few ms at
   120 x 8) at a geometric grid of levels from the floor to LEVEL_SPAN x the floor, up to the first
   level no plan reaches;
2. at the levels whose relaxed path breaks the limits together, the Lagrangian relaxation's best path
   within them (BaseLevels' own, about 30 DPs), the levels in order of their relaxed cost, while
   time remains. Never the counting DP or the ILP: a heuristic with a deadline, not a proof.

Every path is re-priced by exact provisioning (ProblemView.record) like any other candidate, so this
serves the true model too: with runtime terms the DP prices the base model, the candidate the true one.
"""

from __future__ import annotations

import time

import numpy as np

from heterps_ray.costmodel.pricing import monetary_cost
from heterps_ray.scheduling.base_levels import BaseLevels
from heterps_ray.scheduling.rl.env import EpisodeResult, ProblemView
from heterps_ray.scheduling.segment_paths import counted_cheapest_path

LEVELS = 24  # levels of the relaxed pass
LEVEL_SPAN = 4.0  # the relaxed pass's highest level, x the floor (the optimum rarely lies above 2x)
COUNT_STATES = 64  # the most instance-count states of the counting DP a level may use here


class _QuickLevels(BaseLevels):
    """BaseLevels whose level within the limits is the Lagrangian's best path or, when it meets none,
    the counting DP over the types whose limits the free path breaks, if that has at most
    COUNT_STATES states; never the ILP, and no proof."""

    def _constrained_path(self, seg_rate, k, cap, path):  # type: ignore[no-untyped-def]
        incumbent = self._lagrangian(seg_rate, k, cap, path)[0]
        if incumbent is not None:
            return incumbent
        tracked = [int(t) for t in np.flatnonzero(self._usage(path, k) > cap)]
        counted = counted_cheapest_path(seg_rate, k, cap, tracked, COUNT_STATES)
        return counted if isinstance(counted, list) else None


def level_plans(view: ProblemView, deadline: float) -> list[EpisodeResult]:
    """The plans of the levels solved before `deadline` (perf_counter), provisioned; [] without a floor."""
    model = view.model
    if not model.floor > 0.0:
        return []
    pricing = _QuickLevels(model)
    found: list[EpisodeResult] = []
    breaking: list[tuple[float, float]] = []  # (relaxed cost, level) of paths that break the limits
    for target in model.floor * np.geomspace(1.0, LEVEL_SPAN, LEVELS):
        if time.perf_counter() >= deadline:
            return found
        level = pricing.solve_level(float(target), relaxed=True)
        if level is None:
            break  # no plan reaches this level, nor any above it
        result = view.record(level.assignment)
        found.append(result)
        relaxed_cost = monetary_cost(level.rate, model.samples, level.throughput)
        if result.cost > relaxed_cost * (1.0 + 1e-9):  # provisioning could not keep it within the limits
            breaking.append((relaxed_cost, float(target)))
    for _, target in sorted(breaking):
        if time.perf_counter() >= deadline:
            break
        level = pricing.solve_level(target)
        if level is not None:
            found.append(view.record(level.assignment))
    return found
