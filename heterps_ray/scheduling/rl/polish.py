"""Local search around the plans the policy found: move a stage boundary, re-type a stage or a layer.

A plan the policy found is often a move or two from a cheaper one (a layer on the wrong side of a
stage boundary, a stage on a neighbouring GPU kind). Best-improvement hill climbing over those moves,
priced by exact provisioning, closes that gap cheaply. The moves come in two rings:

* stage moves (O(stages x types)): re-type one maximal stage, or shift a boundary between two stages
  by one layer either way (the layer joins its neighbour's stage);
* layer moves (O(layers x types)): re-type one layer.

Each climb step tries the stage moves first and only looks at layer moves when no stage move improves
the plan, so on a 120-layer, 8-type problem (about 900 layer moves, ~1 ms each) the time goes where
improvements are likely. It is optional (RLConfig.polish) and the plan records what it added.
"""

from __future__ import annotations

import time

from heterps_ray.scheduling.rl.env import EpisodeResult, ProblemView, better


def stage_neighbours(view: ProblemView, assignment: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Assignments one stage move away: a maximal stage on another type that runs all of it, or
    the first or last layer of a stage moved into the neighbouring stage."""
    runnable = view.model.runnable
    moves: set[tuple[int, ...]] = set()
    stages = view.model.split_stages(list(assignment))
    for start, end, current in stages:
        for t in range(view.num_types):
            if t != current and runnable[start:end, t].all():
                moves.add(assignment[:start] + (t,) * (end - start) + assignment[end:])
    for (_, end, left), (_, _, right) in zip(stages, stages[1:], strict=False):
        if runnable[end - 1, right]:  # the left stage's last layer joins the right stage
            moves.add(assignment[: end - 1] + (right,) + assignment[end:])
        if runnable[end, left]:  # the right stage's first layer joins the left stage
            moves.add(assignment[:end] + (left,) + assignment[end + 1 :])
    moves.discard(assignment)
    return sorted(moves)


def layer_neighbours(view: ProblemView, assignment: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Assignments one layer move away: one layer on another type that can run it."""
    runnable = view.model.runnable
    return [
        assignment[:layer] + (t,) + assignment[layer + 1 :]
        for layer, current in enumerate(assignment)
        for t in range(view.num_types)
        if t != current and runnable[layer, t]
    ]


def neighbours(view: ProblemView, assignment: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every assignment one move away (stage moves and layer moves)."""
    return sorted(set(stage_neighbours(view, assignment)) | set(layer_neighbours(view, assignment)))


def _best_of(
    view: ProblemView, current: EpisodeResult, moves: list[tuple[int, ...]], deadline: float
) -> EpisodeResult:
    step = current
    for assignment in moves:
        result = view.record(assignment)
        if better(step, result):
            step = result
        if time.perf_counter() >= deadline:
            break
    return step


def hill_climb(view: ProblemView, start: EpisodeResult, deadline: float) -> EpisodeResult:
    """Move to the best neighbour while it is better (stage moves first, then layer moves), until a
    local optimum or `deadline` (perf_counter)."""
    best = start
    while time.perf_counter() < deadline:
        step = _best_of(view, best, stage_neighbours(view, best.assignment), deadline)
        if step is best:
            step = _best_of(view, best, layer_neighbours(view, best.assignment), deadline)
        if step is best:
            break
        best = step
    return best


def polish(view: ProblemView, starts: list[EpisodeResult], deadline: float) -> EpisodeResult | None:
    """The best local optimum reached from any of `starts` (None without starts); distinct starts
    only, best first."""
    best: EpisodeResult | None = None
    seen: set[tuple[int, ...]] = set()
    for start in starts:
        if time.perf_counter() >= deadline:
            break
        if start.assignment in seen:
            continue
        seen.add(start.assignment)
        result = hill_climb(view, start, deadline)
        if better(best, result):
            best = result
    return best
