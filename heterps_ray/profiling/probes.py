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
between them), and a run that the profile saw other work beside is taken again
(:func:`probe_runs`). Their spread is the profile's own: the problem keeps it (``runtime.spread``).

Each probe is one measurement row (kind ``probe``): the plan's steady ms per batch, the callee type
in `resource` (empty for the one-stage probe), the caller in `peer`, the layer where the second stage
ends in `layer` (the last layer of the first stage), and the rows its GPU tier fetched from the shards
(first lookups) over its `calls` steady batches in `rows` (a short run from an empty tier fetches far
more a batch than a long one). :func:`heterps_ray.profiling.fit.fit_problem` subtracts what the fitted
layers, bytes, input and fetched rows explain; the remainder is the term.

This module says what to probe and runs the profile's probe phase (:func:`probe_runs`, called by
profiler.py after the layer timings). Running one probe trains with the runtime, which sits above
profiling: the runner is passed in (:data:`ProbeRunner`; heterps_ray.closedloop.probes.run_probe).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from heterps_ray.config import JobConfig
from heterps_ray.data.layout import is_dataset
from heterps_ray.host_cpu import OtherWork
from heterps_ray.models import ModelSpec
from heterps_ray.profiling.rows import Row

if TYPE_CHECKING:
    from heterps_ray.profiling.profiler import ProfileSettings


class ProbeTiming(NamedTuple):
    """What one probe measured: its plan's steady ms per batch, and over those `batches` the rows its GPU
    tier `fetched` from the shards (rows looked up for the first time: the probe starts with none there)."""

    ms: float
    fetched: int = 0
    batches: int = 0
    train_s: float = 0.0  # of the probe's wall time, its training loop (the rest: start, first read, stop)


# (job, layers, caller type, callee type, split, steps) -> what that sync plan's steady batches took
ProbeRunner = Callable[[JobConfig, list[str], str, str, int, int], ProbeTiming]


class ProbeSkipped(Exception):
    """A runner's refusal of a probe that the cluster cannot run (its actors and PS shard exceed a type's
    max_instances): :func:`probe_runs` notes it as not measured and goes on with the others."""


PROBE_STEPS = 0  # batches per probe; 0: the warm-up chunk and one of the dataset's read chunks (probe_steps)
# A probe's steady batches last about this long (s) where 100 of them would last longer: on a slow type at
# a big batch (a 4-core CPU type at 2048 on CTR-DNN 1024-1024-512-256: 74 ms a batch) 100 batches made
# the probes 66 s of an 88 s profile; one read chunk's worth stays the fewest.
PROBE_SECONDS = 1.5
# Batches in a probe's warm-up chunk (train(first_chunk=...); a run's is loop.CHUNK_STEPS, 20): on a
# reused actor it holds the first read chunk's conversion and the first calls, and the batches after
# it already run at the steady rate (quickstart, per 4 batches: the window from batch 4 within 1% of
# the one from batch 20, first probes on fresh actors included; BENCHMARKS.md, issue 29).
PROBE_WARMUP = 4
ONE_STAGE_AGREE = 0.04  # two one-stage runs further apart than this (of their mean): a third decides
ONE_STAGE_REPEATS = 2  # runs of each one-stage probe (interleaved across types); a third where they disagree


def probe_steps(job: JobConfig, steps: int = PROBE_STEPS, batch_ms: float | None = None) -> int:
    """Batches a probe trains: `steps`, or (0) the warm-up chunk and one of the dataset's read chunks
    of READ_ROWS rows (a long run pays a chunk's conversion every READ_ROWS rows: the steady window,
    after the first PROBE_WARMUP batches, holds exactly one; a shorter probe would miss it and read
    fast), at least 100 steady batches (two steady chunks), or where a batch takes `batch_ms` (the
    profile's estimate for the probe's plan) as many as last PROBE_SECONDS."""
    from heterps_ray.data.dataset import READ_ROWS

    if steps:
        return steps
    chunk = READ_ROWS // job.batch_size
    steady = 100 if not batch_ms else min(100, math.ceil(PROBE_SECONDS * 1000.0 / batch_ms))
    return PROBE_WARMUP + max(chunk, steady)


def batch_ms_of(rows: list[Row], batch_size: int) -> dict[str, float]:
    """Each type's ms for the whole model at `batch_size`: its "stage" rows (the whole model timed
    in one actor) fitted as a line in the batch size, at least what its largest batch took."""
    import numpy as np

    out: dict[str, float] = {}
    for name in {r.resource for r in rows if r.kind == "stage"}:
        timed = [
            (r.batch_size, r.ms) for r in rows if r.kind == "stage" and r.resource == name and r.ms == r.ms
        ]
        sizes = np.array([b for b, _ in timed], dtype=float)
        ms = np.array([m for _, m in timed], dtype=float)
        if len(set(sizes)) > 1:
            slope, fixed = np.polyfit(sizes, ms, 1)
            out[name] = max(float(fixed + slope * batch_size), float(ms[sizes == sizes.max()].mean()))
        elif len(ms):
            out[name] = float(ms.mean()) * batch_size / float(sizes[0])
    return out


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


def probe_runs(
    job: JobConfig,
    spec: ModelSpec,
    types: list[str],
    settings: ProfileSettings,
    run_probe: ProbeRunner,
    notes: list[str],
    batch_ms: dict[str, float] | None = None,
    unmeasured: list[str] | None = None,
) -> list[Row]:
    """The profile's probe phase (:func:`probe_plans`, in order): one row per probe with its steady ms per batch and the CPU ms
    of other work beside it, on the job's data (a synthetic dataset as large as the probes read when
    the job has none yet). A one-stage run with more than ``settings.probe_background`` cores of other
    work beside it is taken again, and a type whose two one-stage runs disagree gets a third (at
    most ``settings.probe_extra`` runs added in all). `batch_ms`: each type's estimated ms a batch (the
    profile's whole-model timings, :func:`batch_ms_of`): a slow type's probes train fewer batches. A
    probe the runner skips (:class:`ProbeSkipped`) is a line in `unmeasured`, once per probe plan."""
    import tempfile

    from tqdm.auto import tqdm

    from heterps_ray.data import DEFAULT_EVAL_FRACTION

    layers = [layer.name for layer in spec.layers]
    batch_ms = batch_ms or {}

    def steps_of(caller: str, callee: str) -> int:
        slowest = max((batch_ms[t] for t in (caller, callee) if t in batch_ms), default=None)
        return probe_steps(job, settings.probe_steps or 0, slowest)

    steps = max((steps_of(t, "") for t in types), default=probe_steps(job, settings.probe_steps or 0))
    scratch = None
    if not is_dataset(Path(job.data.path)):
        from heterps_ray.data.synth import synthesize

        scratch = tempfile.TemporaryDirectory(prefix="heterps-probe-")
        path = Path(scratch.name) / "data"
        rows = int(steps * job.batch_size / (1.0 - DEFAULT_EVAL_FRACTION)) + job.batch_size
        synthesize(path, rows, seed=settings.seed)
        job = job.model_copy(update={"data": job.data.model_copy(update={"path": path})})
    plans = probe_plans(job, layers, types, settings.probe_repeats)
    bar = tqdm(total=len(plans), desc="runtime probes", unit="probe", disable=not settings.progress)
    started, training = time.perf_counter(), 0.0
    try:
        out: list[Row] = []
        runs: dict[tuple[str, str, int], int] = {}
        queue, extra, decided = list(plans), settings.probe_extra, False
        while queue:
            caller, callee, split = queue.pop(0)
            label = _probe_label(layers, caller, callee, split, steps_of(caller, callee))
            bar.set_postfix_str(label)
            try:
                with OtherWork() as background:
                    ms, fetched, batches, train_s = run_probe(
                        job, layers, caller, callee, split, steps_of(caller, callee)
                    )
            except ProbeSkipped as skipped:
                line = f"runtime probe {label}: {skipped}"
                if unmeasured is not None and line not in unmeasured:
                    unmeasured.append(line)
                bar.update()
                continue
            training += train_s
            resource, peer = (callee, caller) if callee else (caller, "")
            rep = runs.get((caller, callee, split), -1) + 1
            row = Row("probe", resource, peer=peer, layer=layers[split - 1], batch_size=job.batch_size,
                      rows=fetched, calls=max(batches, 1), repeat=rep, ms=ms, client_ms=background.cpu_ms)  # fmt: skip
            out.append(row)
            bar.update()
            if not callee and extra > 0 and background.cores > settings.probe_background:
                # a one-stage run beside other work: kept apart (not fitted), taken again at once
                row.kind = "probe_disturbed"
                extra -= 1
                queue.insert(0, (caller, callee, split))
                notes.append(f"{label}: {background.cores:.2f} cores of other work beside it ({ms:.1f} ms a "
                             "batch): taken again")  # fmt: skip
                bar.total += 1
                continue
            runs[caller, callee, split] = rep
            if not queue and not decided:  # the planned runs done: a third where a type's two disagree
                decided = True
                for name in _disagreeing(out, settings.probe_agree)[:extra]:
                    queue.append((name, "", len(layers)))
                    extra -= 1
                    bar.total += 1
        took = time.perf_counter() - started
        notes.append(f"runtime probes: {len(out)} runs in {took:.1f} s, {training:.1f} s of it in their training "
                     "loops (the rest starts each run, reads its first chunk and stops it)")  # fmt: skip
        return out
    finally:
        bar.close()
        if scratch is not None:
            scratch.cleanup()


def _disagreeing(rows: list[Row], agree: float) -> list[str]:
    """The types whose two one-stage runs (rows of kind "probe") lie further apart than `agree` of
    their mean."""
    alone: dict[str, list[float]] = {}
    for row in rows:
        if row.kind == "probe" and not row.peer and row.resource:
            alone.setdefault(row.resource, []).append(row.ms)
    return [name for name, ms in alone.items() if len(ms) == 2 and abs(ms[0] - ms[1]) > agree * (sum(ms) / 2)]


def _probe_label(layers: list[str], caller: str, callee: str, split: int, steps: int) -> str:
    """What a probe trains, for its progress line: its stages as first..last layer @ type."""
    first = f"{layers[0]}..{layers[split - 1]}@{caller}"
    rest = f" -> {layers[split]}..{layers[-1]}@{callee}" if callee else ""
    return f"{first}{rest}, {steps} batches"
