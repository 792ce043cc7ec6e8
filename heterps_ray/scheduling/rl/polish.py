"""Local search around the plans the policy found: re-type one layer or one whole stage at a time.

PPO on one problem sees a few thousand episodes in a minute; a plan it found is often a move or
two from a cheaper one (a layer on the wrong side of a stage boundary, a stage on a neighbouring
GPU kind). Best-improvement hill climbing over those moves, priced by exact provisioning, closes
that gap cheaply. It is optional (RLConfig.polish) and the plan records what it added.
"""

from __future__ import annotations

import time

from heterps_ray.scheduling.rl.env import EpisodeResult, ProblemView, better


def neighbours(view: ProblemView, assignment: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Assignments one move away: one layer, or one maximal stage, on another type that can run it."""
    runnable = view.model.runnable
    moves: set[tuple[int, ...]] = set()
    for layer, current in enumerate(assignment):
        for t in range(view.num_types):
            if t != current and runnable[layer, t]:
                moves.add(assignment[:layer] + (t,) + assignment[layer + 1 :])
    for start, end, current in view.model.split_stages(list(assignment)):
        for t in range(view.num_types):
            if t != current and runnable[start:end, t].all():
                moves.add(assignment[:start] + (t,) * (end - start) + assignment[end:])
    return sorted(moves)


def hill_climb(view: ProblemView, start: EpisodeResult, deadline: float) -> EpisodeResult:
    """Move to the best neighbour while it is better, until a local optimum or `deadline` (perf_counter)."""
    best = start
    while time.perf_counter() < deadline:
        step = best
        for assignment in neighbours(view, best.assignment):
            result = view.record(assignment)
            if better(step, result):
                step = result
            if time.perf_counter() >= deadline:
                break
        if step is best:
            break
        best = step
    return best


def polish(view: ProblemView, starts: list[EpisodeResult], deadline: float) -> EpisodeResult | None:
    """The best local optimum reached from any of `starts` (None without starts)."""
    best: EpisodeResult | None = None
    for start in starts:
        if time.perf_counter() >= deadline:
            break
        result = hill_climb(view, start, deadline)
        if better(best, result):
            best = result
    return best
