"""Runtime probes: short runs of the real runtime that measure the cost model's runtime terms
(DESIGN.md §3b) where no single-actor timing can: what a call between two stages costs inside the
runtime's loop, and what hosting the PS shards costs a DataWorker.

The probes train sync plans for a few seconds each on the job's own data and actors:

* for every type ``t`` but the first: the first layer on the first type, the rest on ``t`` (one call
  per batch to a stage of ``t``), and the first layer on the second type, the rest on the first;
* one stage on each type (its DataWorker hosts the shards): the runtime's own speed on that type,
  :data:`ONE_STAGE_REPEATS` times each, the types interleaved, every other round reversed (the fit
  takes each probe's median).

A type's first one-stage run follows the two-stage probe whose caller is its DataWorker (warm.py
keeps the actors, so it runs on a warm one: an actor's first run is slower even past its first
chunk), and the two-stage probes are spread between them: a type's runs span the whole probe phase
rather than a few seconds of it. What moves a one-stage run most is the machine's state while it
runs (a burst of other work, a drift of its speed), common to the runs beside it; three runs apart
give a median that one disturbed run does not move. So a type whose two runs disagree by more than
:data:`ONE_STAGE_AGREE` gets a third at the end (where they agree, the median of three would lie
between them), and a run that the profile saw other work beside is taken again (profiler.py). Their
spread is the profile's own: the problem keeps it (``runtime.spread``).

Each probe is one measurement row (kind ``probe``): the plan's steady ms per batch, the callee type
in `resource` (empty for the one-stage probe), the caller in `peer`, the layer where the second stage
ends in `layer` (the last layer of the first stage). :func:`heterps_ray.profiling.fit.fit_problem` subtracts what the fitted layers,
bytes and input explain; the remainder is the term.

This module says what to probe. Running a probe trains with the runtime, which sits above profiling:
the runner is passed in (:data:`ProbeRunner`; heterps_ray.closedloop.probes.run_probe).
"""

from __future__ import annotations

from collections.abc import Callable

from heterps_ray.config import JobConfig

# (job, layers, caller type, callee type, split, steps) -> steady ms per batch of that sync plan
ProbeRunner = Callable[[JobConfig, list[str], str, str, int, int], float]

PROBE_STEPS = 0  # batches per probe; 0: the warm-up chunk and one of the dataset's read chunks (probe_steps)
# Batches in a probe's warm-up chunk (train(first_chunk=...); a run's is loop.CHUNK_STEPS, 20): on a
# reused actor it holds the first read chunk's conversion and the first calls, and the batches after
# it already run at the steady rate (quickstart, per 4 batches: the window from batch 4 within 1% of
# the one from batch 20, first probes on fresh actors included; BENCHMARKS.md, issue 29).
PROBE_WARMUP = 4
ONE_STAGE_AGREE = 0.04  # two one-stage runs further apart than this (of their mean): a third decides
ONE_STAGE_REPEATS = 2  # runs of each one-stage probe (interleaved across types); a third where they disagree


def probe_steps(job: JobConfig, steps: int = PROBE_STEPS) -> int:
    """Batches a probe trains: `steps`, or (0) the warm-up chunk and one of the dataset's read chunks
    of READ_ROWS rows (a long run pays a chunk's conversion every READ_ROWS rows: the steady window,
    after the first PROBE_WARMUP batches, holds exactly one; a shorter probe would miss it and read
    fast), at least 100 steady batches (two steady chunks)."""
    from heterps_ray.data.dataset import READ_ROWS

    return steps or PROBE_WARMUP + max(100, READ_ROWS // job.batch_size)


def probe_plans(
    job: JobConfig, layers: list[str], types: list[str], repeats: int = ONE_STAGE_REPEATS
) -> list[tuple[str, str, int]]:
    """(caller type, callee type, index of the second stage's first layer) per probe run, in the
    order to run them; callee '' and index len(layers) for the one-stage probe (`repeats` runs on
    each type, interleaved). `types` are those present that run every layer.

    For types small, big: small->big, small, big->small, big, then big, small: each type's first
    one-stage run right after the two-stage probe that warmed its DataWorker, then the rounds
    alternating in order (ABBA: a drift of the machine's speed over the probes shifts no type)."""
    if not types:
        return []
    first = types[0]
    two_stage = []
    if len(layers) > 1:
        two_stage += [(first, callee, 1) for callee in types[1:]]
        if len(types) > 1:
            two_stage.append((types[1], first, 1))
    alone = len(layers)
    rounds = [types if rep % 2 == 0 else types[::-1] for rep in range(repeats)]
    plans: list[tuple[str, str, int]] = []
    opened: list[str] = []  # types whose first one-stage run is placed
    for probe in two_stage:
        plans.append(probe)
        caller = probe[0]
        if repeats and caller not in opened:  # its DataWorker has run: warm
            plans.append((caller, "", alone))
            opened.append(caller)
    rest = [t for t in types if t not in opened]  # a type no two-stage probe warmed: its first round here
    later = [t for order in rounds[1:] for t in order]
    return plans + [(t, "", alone) for t in (rest if repeats else [])] + [(t, "", alone) for t in later]
