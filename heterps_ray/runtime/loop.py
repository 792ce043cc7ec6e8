"""The chunk loop: drives the DataWorkers chunk by chunk until the target batches (or the data) are
done, checkpoints on its boundaries, tracks and shows progress, recovers from actor deaths, and stops
at a checkpoint when the cluster's resource types change (elastic runs) or the steady rate misses the
floor (the closed loop of `heterps run`).

The driver only submits work and waits; it carries no data.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import ray

from heterps_ray.errors import WaitTimeout
from heterps_ray.metrics.tracking import RunTracker
from heterps_ray.runtime.actors import ActorSet
from heterps_ray.runtime.elastic import ResourcesChanged, change_reason, present_types
from heterps_ray.runtime.faults import is_actor_death
from heterps_ray.runtime.pipeline import StageSpec
from heterps_ray.runtime.recovery import SETTLE_TIMEOUT_S, Recovery
from heterps_ray.runtime.shards import ShardHandle
from heterps_ray.runtime.snapshots import CheckpointSaver

T = TypeVar("T")

CHUNK_STEPS = 20  # batches per DataWorker in the first chunk, and the fewest in any
# Later chunks last about this long: between chunks the driver gathers stats, tracks, checks the
# cluster and the DataWorkers idle; at 20 batches a chunk that cost 8% of a one-stage plan's time.
CHUNK_SECONDS = 1.0
# Closed loop (`heterps run`): the steady rate is compared with the floor once, after the warm-up
# chunk and at least FLOOR_CHUNKS more chunks lasting FLOOR_WINDOW_S seconds together (about
# three of the CHUNK_SECONDS chunks: enough batches that one slow chunk does not decide alone).
FLOOR_CHUNKS = 2
FLOOR_WINDOW_S = 3.0
FLOOR_SHORTFALL = 0.9  # a steady rate under this fraction of the floor misses it (10% slack for noise)
# A chunk (sized to CHUNK_SECONDS of work; the first, CHUNK_STEPS batches) not done by then: an actor of the
# pipeline hangs (a stage's call or a PS pull that never returns), and the run stops with a message.
CHUNK_TIMEOUT_S = 600.0


@dataclass
class LiveActors:
    """The actors of a running job at a chunk boundary, for ``train(on_chunk=...)`` callbacks
    (monitoring, and fault-injection tests that kill one of them)."""

    step: int
    shards: list[Any]  # PS shard actors (none when the shards are hosted in DataWorker 0)
    data_workers: list[Any]
    stage_workers: list[list[Any]]  # stages 1..S-1, replicas each
    ps: list[ShardHandle] = field(default_factory=list)  # every PS shard, wherever it lives (shards.py)


class FloorMissed(Exception):
    """The run's steady throughput after warm-up fell more than 10% short of the floor; training
    stopped at `checkpoint` (None: at the start) after `step` batches, so that `heterps run` can refit
    the model on `achieved` (samples/s), re-plan and resume."""

    def __init__(self, achieved: float, floor: float, step: int, checkpoint: Path | None, seconds: float):
        self.achieved, self.floor, self.step, self.checkpoint = achieved, floor, step, checkpoint
        self.seconds = seconds  # steady seconds the rate was measured over
        self.start: dict[str, float | None] = {}  # how long the run took to start (driver._start_timing)
        super().__init__(
            f"steady throughput {achieved:,.0f} samples/s at step {step} is under {FLOOR_SHORTFALL:.0%} of "
            f"the floor of {floor:,.0f} samples/s"
        )


def steady_rate(chunks: list[tuple[int, float]]) -> float | None:
    """Samples/s over the chunks after the first: the rate a long run sustains, without the warm-up
    (actors' first calls, the first data chunk read). None with fewer than 3 chunks."""
    if len(chunks) < 3:
        return None
    samples, seconds = sum(c[0] for c in chunks[1:]), sum(c[1] for c in chunks[1:])
    return samples / seconds if seconds > 0 else None


@dataclass
class LoopSettings:
    """What the chunk loop watches besides its target."""

    target: int | None  # batches over all DataWorkers; None: the job's epochs
    progress: bool = True  # a progress bar
    elastic: bool = False  # stop at a checkpoint (ResourcesChanged) when resource types change
    floor: float | None = None  # samples/s: stop at a checkpoint (FloorMissed) when the steady rate misses it
    on_chunk: Callable[[LiveActors], None] | None = None  # called between chunks with the live actors
    first_chunk: int = CHUNK_STEPS  # batches per DataWorker in the warm-up chunk (not in the steady rate)


class ChunkLoop:
    """Trains the actor set chunk by chunk from a start point; see :meth:`run`."""

    def __init__(
        self,
        actors: ActorSet,
        recovery: Recovery,
        saver: CheckpointSaver | None,
        tracker: RunTracker | None,
        settings: LoopSettings,
    ):
        self.actors, self.recovery, self.saver, self.tracker = actors, recovery, saver, tracker
        self.settings = settings
        self.plan_types = {s.type for s in actors.stages} | {actors.job.cluster.ps_resource}
        self.types_before: list[str] = []  # the cluster's types when training started (elastic runs)
        self.first_batch_s: float | None = None  # s one batch of the first chunk took, once trained

    def run(self, start: dict[str, Any]) -> dict[str, Any]:
        """Drive the DataWorkers until the target is done, from `start` (a resumed checkpoint's steps,
        samples, losses and directory; empty: the beginning). Returns the loop's history."""
        from tqdm import tqdm

        actors, recovery, saver, tracker, settings = (
            self.actors, self.recovery, self.saver, self.tracker, self.settings,
        )  # fmt: skip
        job = actors.job
        floor = settings.floor
        floor_check: dict[str, Any] | None = None  # the closed loop's comparison, once it is made
        target = settings.target
        total = target if target is not None else actors.batches_available()
        bar = tqdm(
            total=total,
            initial=start.get("steps", 0),
            unit="batch",
            desc=f"train {job.name} ({job.mode})",
            disable=not settings.progress,
        )
        losses: list[float] = list(start.get("losses", []))
        done, samples = start.get("steps", 0), start.get("samples", 0)
        recovery.progress = actors.progress()
        recovery.mark(done, samples, losses, start.get("directory") or recovery.store.capture())
        types_before = self.types_before = present_types(job.cluster) if settings.elastic else []
        active = list(range(actors.num_workers))
        busy_prev = actors.stage_stats()
        ps_prev = actors.ps_stats() if tracker is not None else []
        chunk_steps = settings.first_chunk
        seconds = 0.0
        chunks: list[tuple[int, float]] = []  # (samples, seconds) per chunk, for warm-up-free rates
        try:
            while True:
                finished = not active or (target is not None and done >= target)
                per = 0
                if not finished:
                    if settings.elastic:
                        now = present_types(job.cluster)
                        reason = change_reason(types_before, now, self.plan_types)
                        if reason is not None:
                            checkpoint = self._checkpoint_now(done, samples, losses)
                            raise ResourcesChanged(
                                reason, types_before, now, done, checkpoint, between_chunks=True
                            )
                    if floor and _floor_due(chunks):
                        rate, window = steady_rate(chunks) or 0.0, sum(c[1] for c in chunks[1:])
                        met = rate >= FLOOR_SHORTFALL * floor
                        floor_check = {
                            "step": done,
                            "achieved": rate,
                            "floor": floor,
                            "met": met,
                            "seconds": window,
                        }
                        if not met:
                            checkpoint = self._checkpoint_now(done, samples, losses)
                            raise FloorMissed(rate, floor, done, checkpoint, window)
                        floor = None  # compared once per run
                    per = chunk_steps
                    if target is not None:
                        per = min(per, math.ceil((target - done) / len(active)))
                    if saver is not None:  # end chunks on checkpoint boundaries
                        per = min(per, math.ceil((saver.next_step(done) - done) / len(active)))
                t0 = time.perf_counter()
                refs = [] if finished else [actors.data_workers[i].run.remote(per) for i in active]
                try:
                    if finished:
                        # the trained state made durable before anything after the last batch
                        # (evaluation, saving) can lose it: a fault there rolls back to it, not before
                        self._make_durable(done, samples, losses)
                        break
                    results = self._chunk_results(refs, active, per)
                    interval = time.perf_counter() - t0
                    seconds += interval
                    chunks.append((sum(r["samples"] for r in results), interval))
                    worker_steps = max(r["steps"] for r in results)
                    if self.first_batch_s is None and worker_steps:  # its share of the first chunk
                        self.first_batch_s = interval / worker_steps
                    if worker_steps:
                        chunk_steps = max(CHUNK_STEPS, int(worker_steps / interval * CHUNK_SECONDS))
                    for r in results:
                        losses += r["losses"]
                        done += r["steps"]
                        samples += r["samples"]
                        recovery.progress[r["worker"]] = {"position": r["position"], "updates": r["updates"]}
                    active = [i for i, r in zip(active, results, strict=True) if not r["exhausted"]]
                    if saver is not None and saver.due(done, done - sum(r["steps"] for r in results)):
                        path = self._save(done, samples, losses)
                        if path is not None:
                            recovery.mark(done, samples, losses, path)
                    stats = actors.stage_stats()
                    if settings.on_chunk is not None:
                        settings.on_chunk(
                            LiveActors(
                                done,
                                actors.shard_actors,
                                actors.data_workers,
                                actors.stage_workers,
                                actors.shards,
                            )
                        )
                    # inside the handler too: an actor (hosted shards: DataWorker 0) whose node goes
                    # away between chunks is recovered (or re-planned), not an error of the run
                    ps_now = actors.ps_stats() if tracker is not None else []
                except Exception as exc:
                    if not is_actor_death(exc):
                        raise
                    seconds += time.perf_counter() - t0
                    hung: set[int] = set()
                    if refs:
                        _, pending = ray.wait(refs, num_returns=len(refs), timeout=SETTLE_TIMEOUT_S)
                        hung = {i for i, r in zip(active, refs, strict=True) if r in pending}
                    plan_types = self.plan_types if settings.elastic else None
                    point = recovery.recover(exc, hung, done, plan_types, types_before)
                    done, samples = point.step, point.samples
                    del losses[point.losses :]
                    active = list(range(actors.num_workers))
                    busy_prev = actors.stage_stats()
                    bar.n = done
                    bar.refresh()
                    continue
                busy = _busy_fractions(busy_prev, stats, interval, actors.stages)
                busy_prev = stats
                chunk_samples = sum(r["samples"] for r in results)
                queues = _peak_queues(stats)
                bar.update(sum(r["steps"] for r in results))
                bar.set_postfix_str(
                    f"loss {np.mean(losses[-per:]) if losses else float('nan'):.4f} | "
                    f"{chunk_samples / max(interval, 1e-9):,.0f} samples/s | busy "
                    + " ".join(f"s{s}:{b:.0%}" for s, b in enumerate(busy))
                    + " | queue "
                    + "/".join(str(q) for q in queues)
                )
                if tracker is not None:
                    scalars = _chunk_scalars(results, chunk_samples, interval, busy, queues, ps_prev, ps_now)
                    tracker.log_scalars(done, scalars)
                    ps_prev = ps_now
        finally:
            bar.close()
        final = actors.stage_stats()
        zero = [[{**s, "busy_s": 0.0} for s in stage] for stage in final]
        total_busy = _busy_fractions(zero, final, seconds, actors.stages)
        stages = [
            {**s.to_dict(), "busy": total_busy[s.index], "replica_stats": final[s.index]}
            for s in actors.stages
        ]
        return {
            "steps": done,
            "samples": samples,
            "seconds": seconds,
            "losses": losses,
            "stages": stages,
            "chunks": chunks,
            "positions": {i: p["position"] for i, p in recovery.progress.items()},
            "floor_check": floor_check,
        }

    def _chunk_results(self, refs: list[Any], active: list[int], per: int) -> list[dict[str, Any]]:
        """The DataWorkers' answers for a chunk of `per` batches each; a WaitTimeout naming the ones
        still running after CHUNK_TIMEOUT_S (an actor death raises as itself, for recovery)."""
        try:
            return list(ray.get(refs, timeout=CHUNK_TIMEOUT_S))
        except ray.exceptions.GetTimeoutError:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            stuck = [i for i, r in zip(active, refs, strict=True) if r in pending]
            raise WaitTimeout(
                f"DataWorker(s) {stuck} did not finish a chunk of {per} batches within {CHUNK_TIMEOUT_S:.0f} s: "
                "an actor of the pipeline hangs (a stage's call or a PS pull that does not return); "
                "resume from the newest checkpoint with --resume"
            ) from None

    def supervised(self, phase: str, call: Callable[[], T]) -> T:
        """`call()` (a phase after the last batch that talks to the actors: evaluation, stats,
        accounting, saving) under the same recovery as training: a dead actor is replaced, every actor
        is rolled back to the trained state made durable after the last batch, and the phase is done
        again, so its result is the one an undisturbed run gives."""
        while True:
            try:
                return call()
            except Exception as exc:
                if not is_actor_death(exc):
                    raise
                point = self.recovery.point
                assert point is not None
                plan_types = self.plan_types if self.settings.elastic else None
                self.recovery.recover(exc, set(), point.step, plan_types, self.types_before, phase)

    def _make_durable(self, done: int, samples: int, losses: list[float]) -> None:
        """The trained state becomes the recovery point: a checkpoint (written now unless the newest is
        of this step), or, for a run that writes none (a probe), the actors' state in memory."""
        point = self.recovery.point
        assert point is not None
        if point.step == done and (point.checkpoint is not None or self.saver is None):
            return
        path = self._save(done, samples, losses) if self.saver is not None else None
        self.recovery.mark(done, samples, losses, path if path is not None else self.recovery.store.capture())

    def _save(self, done: int, samples: int, losses: list[float]) -> Path | None:
        """A checkpoint of step `done`; None (with a warning) when the disk refuses it: training goes on
        and the previous recovery point stays, so a full disk costs durability, not the run."""
        assert self.saver is not None
        try:
            return self.saver.save(self.recovery.store, done, samples, losses)
        except OSError as exc:
            self.saver.errors.append(f"step {done}: {exc}")
            warnings.warn(f"checkpoint at step {done} not written ({exc}); training goes on", stacklevel=2)
            return None

    def _checkpoint_now(self, done: int, samples: int, losses: list[float]) -> Path | None:
        """The newest checkpoint of the current state (written now unless it exists), for a re-plan."""
        point = self.recovery.point
        assert point is not None
        if point.checkpoint is not None and point.step == done:
            return point.checkpoint
        if self.saver is None or done == 0:
            return point.checkpoint
        try:
            return self._save(done, samples, losses) or point.checkpoint
        except Exception as exc:  # actors of a type that left died with its node: the last point
            if not is_actor_death(exc):
                raise
            return point.checkpoint


def _floor_due(chunks: list[tuple[int, float]]) -> bool:
    """Enough steady chunks (after the warm-up one) to compare the run's rate with its floor."""
    steady = chunks[1:]
    return len(steady) >= FLOOR_CHUNKS and sum(c[1] for c in steady) >= FLOOR_WINDOW_S


def _busy_fractions(
    before: list[list[dict[str, Any]]],
    after: list[list[dict[str, Any]]],
    interval: float,
    stages: list[StageSpec],
) -> list[float]:
    """Per stage: busy seconds in the interval over (replicas x interval)."""
    out = []
    for stage, b, a in zip(stages, before, after, strict=True):
        spent = sum(x["busy_s"] - y["busy_s"] for x, y in zip(a, b, strict=True))
        out.append(spent / max(interval * stage.replicas, 1e-9))
    return out


def _chunk_scalars(
    results: list[dict[str, Any]],
    samples: int,
    interval: float,
    busy: list[float],
    queues: list[int],
    ps_before: list[dict[str, Any]],
    ps_after: list[dict[str, Any]],
) -> dict[str, float]:
    """One chunk's tracked scalars (tags as in metrics.tracking)."""
    losses = [x for r in results for x in r["losses"]]
    out = {
        "train/loss": float(np.mean(losses)) if losses else float("nan"),
        "train/samples_per_s": samples / max(interval, 1e-9),
        "ps/rows": float(sum(sum(p["rows"].values()) for p in ps_after)),
    }
    for key, tag in (("keys_pulled", "ps/pull_rate"), ("keys_pushed", "ps/push_rate")):
        moved = sum(a[key] for a in ps_after) - sum(b[key] for b in ps_before)
        out[tag] = moved / max(interval, 1e-9)
    for i, (b, q) in enumerate(zip(busy, queues, strict=True)):
        out[f"stage{i}/busy_fraction"] = b
        out[f"stage{i}/queue_depth"] = float(q)
    return out


def _peak_queues(stats: list[list[dict[str, Any]]]) -> list[int]:
    return [max(s["peak_pending"] for s in stage) for stage in stats]
