"""Local search around the plans the policy found: move a stage boundary, re-type a stage or a layer.

A plan the policy found is often a move or two from a cheaper one (a layer on the wrong side of a
stage boundary, a stage on a neighbouring GPU kind). Best-improvement hill climbing over those moves,
priced by exact provisioning, closes that gap cheaply. The moves come in rings:

* stage moves (O(stages x types)): re-type one maximal stage, or shift a boundary between two stages
  by 1, 2, 4 or 8 layers either way (those layers join the neighbouring stage);
* split moves (O(stages x types)): a stage's second half, first half or middle third on another type
  (a replicated stage becomes a deeper pipeline of one-replica stages: on GPU clouds the optimum is
  often such a pipeline, issue 40);
* block moves (O(stages x types)): the first or last 1, 2, 4 or 8 layers of a stage on another type;
* layer moves (O(layers x types)): re-type one layer.

Each climb step tries the rings in that order and only looks at the next when the one before has no
better plan, so on a 120-layer, 8-type problem (about 900 layer moves, ~1 ms each) the time goes where
improvements are likely. It is optional (RLConfig.polish) and the plan records what it added.
"""

from __future__ import annotations

import time

from heterps_ray.scheduling.rl.env import EpisodeResult, ProblemView, better

_SHIFTS = (1, 2, 4, 8)  # layers a stage boundary moves by in one stage move


def stage_neighbours(view: ProblemView, assignment: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Assignments one stage move away: a maximal stage on another type that runs all of it, or
    the first or last 1, 2, 4 or 8 layers of a stage moved into the neighbouring stage."""
    runnable = view.model.runnable
    moves: set[tuple[int, ...]] = set()
    stages = view.model.split_stages(list(assignment))
    for start, end, current in stages:
        for t in range(view.num_types):
            if t != current and runnable[start:end, t].all():
                moves.add(assignment[:start] + (t,) * (end - start) + assignment[end:])
    for (start, end, left), (_, stop, right) in zip(stages, stages[1:], strict=False):
        for shift in _SHIFTS:
            # the left stage's last `shift` layers join the right stage
            if shift < end - start and runnable[end - shift : end, right].all():
                moves.add(assignment[: end - shift] + (right,) * shift + assignment[end:])
            # the right stage's first `shift` layers join the left stage
            if shift < stop - end and runnable[end : end + shift, left].all():
                moves.add(assignment[:end] + (left,) * shift + assignment[end + shift :])
    moves.discard(assignment)
    return sorted(moves)


def block_neighbours(view: ProblemView, assignment: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Assignments one block move away: the first or last 1, 2, 4 or 8 layers of a stage on another
    type (a new stage split off, or joined to a neighbour of that type)."""
    runnable = view.model.runnable
    moves: set[tuple[int, ...]] = set()
    for start, end, current in view.model.split_stages(list(assignment)):
        for shift in _SHIFTS:
            if shift >= end - start:
                break
            for t in range(view.num_types):
                if t == current:
                    continue
                if runnable[start : start + shift, t].all():
                    moves.add(assignment[:start] + (t,) * shift + assignment[start + shift :])
                if runnable[end - shift : end, t].all():
                    moves.add(assignment[: end - shift] + (t,) * shift + assignment[end:])
    moves.discard(assignment)
    return sorted(moves)


def split_neighbours(view: ProblemView, assignment: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Assignments one split move away: a stage of 3 or more layers cut in two or three (its first
    or second half, or its middle third, on another type): a replicated stage becomes a deeper
    pipeline of cheaper stages."""
    runnable = view.model.runnable
    moves: set[tuple[int, ...]] = set()
    for start, end, current in view.model.split_stages(list(assignment)):
        n = end - start
        if n < 3:
            continue
        blocks = {(start + n // 2, end), (start, start + n // 2), (start + n // 3, start + 2 * n // 3)}
        for lo, hi in blocks:
            for t in range(view.num_types):
                if t != current and runnable[lo:hi, t].all():
                    moves.add(assignment[:lo] + (t,) * (hi - lo) + assignment[hi:])
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
    """Every assignment one move away (stage, split, block and layer moves)."""
    moves = set(stage_neighbours(view, assignment)) | set(split_neighbours(view, assignment))
    moves |= set(block_neighbours(view, assignment))
    return sorted(moves | set(layer_neighbours(view, assignment)))


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
    """Move to the best neighbour while it is better (stage moves first, then split, block and layer
    moves: the next ring only when the one before has no better plan), until a local optimum or
    `deadline` (perf_counter)."""
    best = start
    while time.perf_counter() < deadline:
        step = best
        for ring in (stage_neighbours, split_neighbours, block_neighbours, layer_neighbours):
            step = _best_of(view, best, ring(view, best.assignment), deadline)
            if step is not best:
                break
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
