"""The training driver: starts the PS shards and workers of a plan on Ray, drives the DataWorkers
in chunks of steps (it submits work and waits; it carries no data), shows progress, evaluates on the
held-out split through the pipeline and writes the run summary and the trained model.

Example::

    summary = train(load_job("configs/jobs/quickstart.yaml"), load_plan("configs/plans/quickstart.json"))
    summary.auc, summary.throughput
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray

from heterps_ray.cluster import connect
from heterps_ray.config import JobConfig
from heterps_ray.data.dataset import prepare_dataset
from heterps_ray.errors import ConfigError, DataError
from heterps_ray.metrics.tracking import TENSORBOARD_DIR, RunTracker
from heterps_ray.models import ModelSpec, build_model
from heterps_ray.ps.atomic import read_npz, write_bytes_atomic, write_npz_atomic
from heterps_ray.ps.shard import PSShard, TableSpec, reshard_states
from heterps_ray.runtime.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST,
    MODEL_DIR,
    begin_training_checkpoint,
    commit_training_checkpoint,
    latest_training_checkpoint,
    save_checkpoint,
)
from heterps_ray.runtime.elastic import ResourcesChanged, change_reason, present_types
from heterps_ray.runtime.evaluation import evaluate_logits
from heterps_ray.runtime.faults import (
    FaultRecord,
    TooManyFaults,
    batch_accounting,
    how_it_died,
    is_actor_death,
)
from heterps_ray.runtime.pipeline import StageSpec, check_capacity, resolve_stages
from heterps_ray.runtime.stage import canonical_names, dense_home, dense_table_name
from heterps_ray.runtime.workers import (
    SPARSE_TABLE,
    DataSettings,
    DataWorker,
    HostedPS,
    StageWorker,
    WorkerSettings,
)

SUMMARY_FILE = "run_summary.json"
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
_EVAL_BATCH = 4096  # rows per evaluation micro-batch
_READY_TIMEOUT_S = 120.0  # actors not placed by then: the cluster cannot hold the plan
_SETTLE_TIMEOUT_S = 60.0  # after a fault: a DataWorker still busy by then is taken for hung
_PROBE_TIMEOUT_S = 30.0  # after a fault: an actor not answering a probe by then is taken for dead


@dataclass
class LiveActors:
    """The actors of a running job at a chunk boundary, for ``train(on_chunk=...)`` callbacks
    (monitoring, and fault-injection tests that kill one of them)."""

    step: int
    shards: list[Any]
    data_workers: list[Any]
    stage_workers: list[list[Any]]  # stages 1..S-1, replicas each


@dataclass
class RunSummary:
    """What a training run did and measured; saved as run_summary.json."""

    job: str
    mode: str
    model: str
    plan: dict[str, Any]
    stages: list[dict[str, Any]]
    ps_shards: int
    steps: int
    samples: int
    seconds: float
    throughput: float  # samples/s over the training loop
    losses: list[float]
    auc: float | None
    logloss: float | None
    eval_rows: int
    placement: list[dict[str, Any]]
    ps: list[dict[str, Any]]
    output_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # samples/s after the first chunk (first calls, first data chunk read); None under 3 chunks
    steady_throughput: float | None = None

    def to_json(self) -> str:
        return json.dumps(_jsonable(asdict(self)), indent=2)

    def save(self, path: str | Path) -> Path:
        return write_bytes_atomic(path, (self.to_json() + "\n").encode())


class FloorMissed(Exception):
    """The run's steady throughput after warm-up fell more than 10% short of the floor; training
    stopped at `checkpoint` (None: at the start) after `step` batches, so that `heterps run` can refit
    the model on `achieved` (samples/s), re-plan and resume."""

    def __init__(self, achieved: float, floor: float, step: int, checkpoint: Path | None, seconds: float):
        self.achieved, self.floor, self.step, self.checkpoint = achieved, floor, step, checkpoint
        self.seconds = seconds  # steady seconds the rate was measured over
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


def train(
    job: JobConfig,
    plan: Any,
    steps: int | None = None,
    progress: bool = True,
    address: str | None = None,
    overwrite: bool = False,
    plan_file: str | None = None,
    save: bool = True,
    resume: bool = False,
    on_chunk: Callable[[LiveActors], None] | None = None,
    elastic: bool = False,
    floor: float | None = None,
) -> RunSummary:
    """Run `plan` (a :class:`heterps_ray.scheduling.Plan`) for `job` on Ray and return its summary.

    Uses the running Ray if there is one, else connects to `address` (or $RAY_ADDRESS), else starts
    an embedded local Ray with the cluster's resource types as custom resources (stopped at the end).
    `steps` (else ``job.runtime.train_steps``, else all epochs) counts batches over all DataWorkers.
    `resume`: continue from the newest valid checkpoint in output_dir/checkpoints (a checkpoint of
    another plan with as many DataWorkers works too, in both modes: dense weights and optimizer state
    go by layer name, wherever the old or the new plan keeps them, and PS rows are re-sharded).
    A dead actor is re-created and the run rolls back to its newest checkpoint (else its start) and
    replays, at most ``runtime.max_restarts`` times. `on_chunk` is called between chunks with the
    live actors. `elastic`: raise :class:`~heterps_ray.runtime.elastic.ResourcesChanged` (after a
    checkpoint) when the cluster's resource types change. `floor` (samples/s): once the warm-up is
    over (see FLOOR_WINDOW_S), raise :class:`FloorMissed` (after a checkpoint) when the steady rate is
    under FLOOR_SHORTFALL of it.
    """
    model = build_model(job.model)
    stages = resolve_stages(plan, model, job, plan_file)
    num_shards = job.runtime.ps_shards or int(plan.ps_shards)
    check_capacity(stages, num_shards, job.cluster, plan_file)
    output_dir = Path(job.output_dir)
    plan_dict = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)
    _check_checkpointing(job, resume, save)
    # the data is checked before --overwrite removes a previous run: a failing run replaces nothing
    train_files, eval_files = _dataset_files(job)
    start: dict[str, Any] = {}
    if resume:
        start = _resume_point(output_dir, plan_dict, num_shards, job.mode)
    elif save:
        _claim_output_dir(output_dir, overwrite)
    if elastic and ray.is_initialized():  # `heterps run` connected; types may come and go since
        owns_ray = False
        _check_plan_types(stages, job, plan_file)
    else:
        owns_ray = connect(job.cluster, address)
    run = _Run(job, model, stages, num_shards, train_files)
    tracker: RunTracker | None = None  # TensorBoard events in output_dir/tensorboard (and MLflow)
    try:
        placement = run.start()
        if start:
            run.restore(start["directory"], remap=start["plan_changed"])
        target = steps or job.runtime.train_steps
        saver = (
            _CheckpointSaver(output_dir, job.runtime.checkpoint_every, plan_dict, num_shards)
            if save
            else None
        )
        if save:
            tracker = RunTracker(output_dir, mlflow=job.runtime.mlflow, run_name=job.name)
        history = run.train(target, progress, start, saver, on_chunk, elastic, tracker, floor)
        metrics = run.evaluate(eval_files)
        if tracker is not None:
            tracker.log_final({f"eval/{k}": float(metrics[k]) for k in ("auc", "logloss") if k in metrics})
        summary = RunSummary(
            job=job.name,
            mode=job.mode,
            model=model.name,
            plan=plan_dict,
            stages=history["stages"],
            ps_shards=num_shards,
            steps=history["steps"],
            samples=history["samples"],
            seconds=history["seconds"],
            throughput=history["samples"] / history["seconds"] if history["seconds"] > 0 else 0.0,
            steady_throughput=steady_rate(history["chunks"]),
            losses=history["losses"],
            auc=metrics.get("auc"),
            logloss=metrics.get("logloss"),
            eval_rows=int(metrics.get("rows", 0)),
            placement=placement,
            ps=run.ps_stats(),
            output_dir=str(output_dir) if save else None,
            extra={
                "chunks": history["chunks"],
                "floor_check": history["floor_check"],  # with train(floor=...): the steady rate checked
                "data_wait_s": run.data_wait(),
                "faults": [asdict(f) for f in run.faults],
                "restarts": run.restarts,
                "max_restarts": job.runtime.max_restarts,
                **run.accounting(history["positions"]),
            },
        )
        if saver is not None:
            summary.extra["checkpoints"] = saver.written
        if start:
            summary.extra["resumed_from"] = {
                "checkpoint": str(start["directory"]),
                "step": start["steps"],
                "skipped": start["skipped"],
                "plan_changed": start["plan_changed"],
            }
        if save:
            run.save_model(output_dir / MODEL_DIR)
            summary.save(output_dir / SUMMARY_FILE)
        return summary
    finally:
        if tracker is not None:
            tracker.close()
        run.shutdown()
        if owns_ray:
            ray.shutdown()


# ---------------------------------------------------------------------------------------------


class _Run:
    """The actors of one run and the driver-side loop over them, with fault recovery."""

    def __init__(
        self, job: JobConfig, model: ModelSpec, stages: list[StageSpec], num_shards: int, files: list[Path]
    ):
        self.job, self.model, self.stages, self.num_shards = job, model, stages, num_shards
        self.num_workers = stages[0].replicas
        if len(files) < self.num_workers:
            raise DataError(
                f"{job.data.path}: {len(files)} train partition(s) for {self.num_workers} DataWorkers "
                "(stage 0 replicas); write more Parquet parts or use fewer replicas"
            )
        self.files = files
        self.table = TableSpec(
            dim=model.embedding_dim,
            seed=job.seed,
            lr=job.optimizer.sparse_lr,
            init_accumulator=job.optimizer.sparse_init_accumulator,
            init_scale=model.embedding_init_scale,
        )
        # one DataWorker and no replicated stage: the PS shards live in its process (no PS calls)
        self.hosted = job.runtime.ps_hosting == "auto" and all(s.replicas == 1 for s in stages)
        # one DataWorker drives single-replica stages as one compiled graph (chain.py); an actor
        # takes part in one graph at a time, so several DataWorkers keep plain calls
        self.chained = job.runtime.compiled_graph and len(stages) > 1 and all(s.replicas == 1 for s in stages)
        self.shards: list[Any] = []
        self.stage_workers: list[list[Any]] = []
        self.data_workers: list[Any] = []
        self.faults: list[FaultRecord] = []
        self.restarts = 0
        self._generation = 0  # raised at each recovery; older calls still in flight are dropped
        # where a fault rolls back to: step, samples, losses kept, progress, and a checkpoint
        # directory or the in-memory start state
        self._recovery: dict[str, Any] = {}
        self._progress: dict[int, dict[str, int]] = {}  # per DataWorker, at the last chunk boundary
        self._remapped: set[Path] = set()  # async checkpoints of another plan (restored by layer name)

    def _settings(self, stage: StageSpec) -> WorkerSettings:
        rtype = self.job.cluster.type(stage.type)
        return WorkerSettings(
            seed=self.job.seed,
            mode=self.job.mode,
            optimizer=self.job.optimizer,
            device=rtype.device,
            torch_threads=rtype.torch_threads,
            type_name=rtype.name,
            max_staleness=self.job.runtime.max_staleness,
        )

    # -- actors ---------------------------------------------------------------------------------

    def _new_shard(self, index: int) -> Any:
        cluster = self.job.cluster
        options = cluster.type(cluster.ps_resource).actor_options()
        return (
            ray.remote(PSShard).options(**options).remote(index, self.num_shards, {SPARSE_TABLE: self.table})
        )

    def _new_stage_worker(self, stage: StageSpec, replica: int) -> Any:
        options = self.job.cluster.type(stage.type).actor_options()
        return (
            ray.remote(StageWorker)
            .options(**options)
            .remote(stage, replica, self.model, self._settings(stage), self._dense_ps(stage))
        )

    def _new_data_worker(self, index: int) -> Any:
        stage0 = self.stages[0]
        data = DataSettings(
            path=str(self.job.data.path),
            files=tuple(str(f) for f in self.files[index :: self.num_workers]),
            batch_size=self.job.batch_size,
            micro_batches=self.job.runtime.micro_batches,
            epochs=self.job.runtime.epochs,
            max_in_flight=self.job.runtime.max_in_flight,
            batches_ahead=self.job.runtime.batches_ahead if self.job.mode == "async" else 0,
            compiled_chain=self.chained,
        )
        options = self.job.cluster.type(stage0.type).actor_options()
        shards = HostedPS(self.num_shards, {SPARSE_TABLE: self.table}) if self.hosted else self.shards
        return (
            ray.remote(DataWorker)
            .options(**options)
            .remote(
                index,
                stage0,
                self.model,
                self._settings(stage0),
                data,
                self.stage_workers,
                shards,
                self._dense_ps(stage0),
                self._generation,
            )
        )

    def _all_actors(self) -> list[tuple[str, int, int, Any]]:
        """(kind, stage, replica, handle) of every actor; PS shards have stage -1 (hosted shards are
        no actors: they live and die with DataWorker 0)."""
        out = [] if self.hosted else [("ps_shard", -1, i, s) for i, s in enumerate(self.shards)]
        for stage, replicas in zip(self.stages[1:], self.stage_workers, strict=True):
            out += [("stage_worker", stage.index, r, w) for r, w in enumerate(replicas)]
        return out + [("data_worker", 0, i, w) for i, w in enumerate(self.data_workers)]

    def start(self) -> list[dict[str, Any]]:
        """Start shards, stage workers and data workers; wait until all are placed."""
        if self.hosted:
            self.shards = [_HostedShard(self, i) for i in range(self.num_shards)]
        else:
            self.shards = [self._new_shard(i) for i in range(self.num_shards)]
        if self.job.mode == "async":
            self._register_dense_tables(range(self.num_shards))
        self.stage_workers = [
            [self._new_stage_worker(stage, r) for r in range(stage.replicas)] for stage in self.stages[1:]
        ]
        self.data_workers = [self._new_data_worker(i) for i in range(self.num_workers)]
        return self._wait_placed([a for *_, a in self._all_actors()])

    def _wait_placed(self, actors: list[Any]) -> list[dict[str, Any]]:
        try:
            return ray.get([a.describe.remote() for a in actors], timeout=_READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                None,
                "stages",
                f"a plan whose actors fit the Ray cluster (demand: {self._demand()}; "
                f"available now: {ray.available_resources()})",
                f"actors not placed after {_READY_TIMEOUT_S:.0f} s",
            ) from None

    def _dense_ps(self, stage: StageSpec) -> Any:
        """The PS shard holding a stage's dense weights (async, replicated stages), else None."""
        if dense_home(self.job.mode, stage.replicas) != "ps":
            return None
        return self.shards[stage.index % self.num_shards]

    def _register_dense_tables(self, shards: Any) -> None:
        """Async mode: the initial dense weights of every stage whose PS shard is in `shards`."""
        refs = []
        wanted = set(shards)
        for stage in self.stages:
            if stage.index % self.num_shards not in wanted or self._dense_ps(stage) is None:
                continue
            module = self.model.build(stage.start, stage.end, self.job.seed)
            names = canonical_names(module, self.model)
            params = {names[k]: v.detach().numpy() for k, v in module.named_parameters()}
            if params:
                refs.append(
                    self._dense_ps(stage).register_dense.remote(
                        dense_table_name(stage.index),
                        params,
                        self.job.optimizer.dense,
                        self.job.optimizer.dense_lr,
                    )
                )
        ray.get(refs)

    def _demand(self) -> dict[str, float]:
        demand: dict[str, float] = {}
        counts = [(s.type, s.replicas) for s in self.stages] + [
            (self.job.cluster.ps_resource, self.num_shards)
        ]
        for name, count in counts:
            opts = self.job.cluster.type(name).actor_options()
            for key, amount in {
                "CPU": opts["num_cpus"],
                "GPU": opts["num_gpus"],
                **opts["resources"],
            }.items():
                if amount:
                    demand[key] = demand.get(key, 0.0) + amount * count
        return demand

    # -- the training loop ------------------------------------------------------------------------

    def train(
        self,
        target: int | None,
        progress: bool,
        start: dict[str, Any] | None = None,
        saver: _CheckpointSaver | None = None,
        on_chunk: Callable[[LiveActors], None] | None = None,
        elastic: bool = False,
        tracker: RunTracker | None = None,
        floor: float | None = None,
    ) -> dict[str, Any]:
        """Drive the DataWorkers chunk by chunk until `target` batches (or the data) are done, from
        `start` (a resumed checkpoint's steps, samples and losses), checkpointing through `saver`;
        recover from actor deaths; with `elastic`, stop at a checkpoint when resource types change;
        with a `floor`, stop at a checkpoint when the steady rate misses it (FloorMissed)."""
        from tqdm import tqdm

        start = start or {}
        floor_value = float(floor or 0.0)
        floor_check: dict[str, Any] | None = None  # the closed loop's comparison, once it is made
        total = target if target is not None else self._batches_available()
        bar = tqdm(
            total=total,
            initial=start.get("steps", 0),
            unit="batch",
            desc=f"train {self.job.name} ({self.job.mode})",
            disable=not progress,
        )
        losses: list[float] = list(start.get("losses", []))
        done, samples = start.get("steps", 0), start.get("samples", 0)
        self._progress = {
            i: p for i, p in enumerate(ray.get([w.progress.remote() for w in self.data_workers]))
        }
        self._mark_recovery(done, samples, losses, start.get("directory") or self._capture())
        types_before = present_types(self.job.cluster) if elastic else []
        plan_types = {s.type for s in self.stages} | {self.job.cluster.ps_resource}
        active = list(range(self.num_workers))
        busy_prev = self._stage_stats()
        ps_prev = self.ps_stats() if tracker is not None else []
        chunk_steps = CHUNK_STEPS
        seconds = 0.0
        chunks: list[tuple[int, float]] = []  # (samples, seconds) per chunk, for warm-up-free rates
        try:
            while active and (target is None or done < target):
                if elastic:
                    now = present_types(self.job.cluster)
                    reason = change_reason(types_before, now, plan_types)
                    if reason is not None:
                        raise ResourcesChanged(
                            reason,
                            types_before,
                            now,
                            done,
                            self._checkpoint_now(saver, done, samples, losses),
                        )
                if floor and _floor_due(chunks):
                    rate, window = steady_rate(chunks) or 0.0, sum(c[1] for c in chunks[1:])
                    floor = None  # compared once per run
                    met = rate >= FLOOR_SHORTFALL * floor_value
                    floor_check = {"step": done, "achieved": rate, "floor": floor_value, "met": met}
                    floor_check["seconds"] = window
                    if not met:
                        checkpoint = self._checkpoint_now(saver, done, samples, losses)
                        raise FloorMissed(rate, floor_value, done, checkpoint, window)
                per = chunk_steps
                if target is not None:
                    per = min(per, math.ceil((target - done) / len(active)))
                if saver is not None:  # end chunks on checkpoint boundaries
                    per = min(per, math.ceil((saver.next_step(done) - done) / len(active)))
                t0 = time.perf_counter()
                refs = [self.data_workers[i].run.remote(per) for i in active]
                try:
                    results = ray.get(refs)
                    interval = time.perf_counter() - t0
                    seconds += interval
                    chunks.append((sum(r["samples"] for r in results), interval))
                    worker_steps = max(r["steps"] for r in results)
                    if worker_steps:
                        chunk_steps = max(CHUNK_STEPS, int(worker_steps / interval * CHUNK_SECONDS))
                    for r in results:
                        losses += r["losses"]
                        done += r["steps"]
                        samples += r["samples"]
                        self._progress[r["worker"]] = {"position": r["position"], "updates": r["updates"]}
                    active = [i for i, r in zip(active, results, strict=True) if not r["exhausted"]]
                    if saver is not None and done >= saver.next_step(done - sum(r["steps"] for r in results)):
                        path = saver.save(self, done, samples, losses)
                        self._mark_recovery(done, samples, losses, path)
                    stats = self._stage_stats()
                    if on_chunk is not None:
                        on_chunk(LiveActors(done, self.shards, self.data_workers, self.stage_workers))
                    # inside the handler too: an actor (hosted shards: DataWorker 0) whose node goes
                    # away between chunks is recovered (or re-planned), not an error of the run
                    ps_now = self.ps_stats() if tracker is not None else []
                except Exception as exc:
                    if not is_actor_death(exc):
                        raise
                    seconds += time.perf_counter() - t0
                    _, pending = ray.wait(refs, num_returns=len(refs), timeout=_SETTLE_TIMEOUT_S)
                    hung = {i for i, r in zip(active, refs, strict=True) if r in pending}
                    self._recover(exc, hung, done, plan_types if elastic else None, types_before)
                    done, samples = self._recovery["step"], self._recovery["samples"]
                    del losses[self._recovery["losses"] :]
                    active = list(range(self.num_workers))
                    busy_prev = self._stage_stats()
                    bar.n = done
                    bar.refresh()
                    continue
                busy = _busy_fractions(busy_prev, stats, interval, self.stages)
                busy_prev = stats
                chunk_samples = sum(r["samples"] for r in results)
                bar.update(sum(r["steps"] for r in results))
                bar.set_postfix_str(
                    f"loss {np.mean(losses[-per:]) if losses else float('nan'):.4f} | "
                    f"{chunk_samples / max(interval, 1e-9):,.0f} samples/s | busy "
                    + " ".join(f"s{s}:{b:.0%}" for s, b in enumerate(busy))
                    + " | queue "
                    + "/".join(str(q) for q in _peak_queues(stats, self.stages))
                )
                if tracker is not None:
                    tracker.log_scalars(done, _chunk_scalars(results, chunk_samples, interval, busy,
                                                             _peak_queues(stats, self.stages), ps_prev, ps_now))  # fmt: skip
                    ps_prev = ps_now
        finally:
            bar.close()
        final = self._stage_stats()
        total_busy = _busy_fractions(self._zero_stats(final), final, seconds, self.stages)
        stages = [
            {**s.to_dict(), "busy": total_busy[s.index], "replica_stats": final[s.index]} for s in self.stages
        ]
        return {
            "steps": done,
            "samples": samples,
            "seconds": seconds,
            "losses": losses,
            "stages": stages,
            "chunks": chunks,
            "positions": {i: p["position"] for i, p in self._progress.items()},
            "floor_check": floor_check,
        }

    def _checkpoint_now(
        self, saver: _CheckpointSaver | None, done: int, samples: int, losses: list[float]
    ) -> Path | None:
        """The newest checkpoint of the current state (written now unless it exists), for a re-plan."""
        source = self._recovery["source"]
        if isinstance(source, Path) and self._recovery["step"] == done:
            return source
        if saver is None or done == 0:
            return source if isinstance(source, Path) else None
        try:
            return saver.save(self, done, samples, losses)
        except Exception as exc:  # actors of a type that left died with its node: the last point
            if not is_actor_death(exc):
                raise
            return source if isinstance(source, Path) else None

    def _mark_recovery(self, done: int, samples: int, losses: list[float], source: Any) -> None:
        self._recovery = {
            "step": done,
            "samples": samples,
            "losses": len(losses),
            "progress": {i: dict(p) for i, p in self._progress.items()},
            "source": Path(source) if isinstance(source, str | Path) else source,
        }

    def _capture(self) -> dict[str, Any]:
        """The run's start state in memory (PS shards are still nearly empty): the recovery point
        until the first checkpoint."""
        owners = self._trained_actors()
        states = ray.get([a.train_state.remote() for a in owners.values()])
        return {
            "shards": ray.get([s.state.remote() for s in self.shards]),
            "actors": dict(zip(owners, states, strict=True)),
        }

    # -- fault recovery -----------------------------------------------------------------------------

    def _recover(
        self,
        exc: BaseException,
        hung: set[int],
        step: int,
        plan_types: set[str] | None,
        types_before: list[str],
    ) -> None:
        """Re-create the dead actors, roll every actor back to the recovery point and record it.
        `hung`: DataWorkers whose chunk did not end after the fault."""
        t0 = time.perf_counter()
        dead = self._find_dead(hung)
        if not dead:
            raise exc
        self.restarts += len(dead)
        if self.restarts > self.job.runtime.max_restarts:
            names = ", ".join(f"{d['kind']} {d['stage']}/{d['replica']} ({d['how']})" for d in dead)
            raise TooManyFaults(
                f"{self.restarts} actor deaths, more than runtime.max_restarts="
                f"{self.job.runtime.max_restarts}; the last: {names}. Raise runtime.max_restarts or "
                "find why actors die (memory, preemption); resume with --resume from the newest checkpoint"
            ) from exc
        if plan_types is not None:
            now = present_types(self.job.cluster)
            gone = sorted({self._type_of(d) for d in dead} - set(now))
            if gone:
                source = self._recovery["source"]
                raise ResourcesChanged(
                    f"actors of resource type(s) {gone} died and the type is gone",
                    types_before,
                    now,
                    self._recovery["step"],
                    source if isinstance(source, Path) else None,
                ) from exc
        at_fault = self._progress_now(dead)
        for d in dead:
            ray.kill(d["handle"], no_restart=True)
        replaced = list(dead)
        if self.chained and any(d["kind"] == "data_worker" for d in dead):
            # The dead DataWorker drove a compiled chain that no one can tear down now: its
            # StageWorkers are stuck in the old graph's loop, so they are replaced as well (their
            # state is restored from the recovery point like everyone else's).
            for kind, stage_index, replica, handle in self._all_actors():
                if kind == "stage_worker" and not any(d["handle"] is handle for d in dead):
                    ray.kill(handle, no_restart=True)
                    replaced.append({"kind": kind, "stage": stage_index, "replica": replica})
        self._generation += 1
        wait = _ReplacementWait(self, plan_types, types_before)
        new_shards = [d["replica"] for d in dead if d["kind"] == "ps_shard"]
        for i in new_shards:
            self.shards[i] = self._new_shard(i)
        wait.placed([self.shards[i] for i in new_shards])
        if self.job.mode == "async" and new_shards:
            self._register_dense_tables(new_shards)
        for d in replaced:
            if d["kind"] == "stage_worker":
                stage = self.stages[d["stage"]]
                self.stage_workers[stage.index - 1][d["replica"]] = self._new_stage_worker(
                    stage, d["replica"]
                )
        new_data = [d["replica"] for d in dead if d["kind"] == "data_worker"]
        for i in new_data:
            self.data_workers[i] = self._new_data_worker(i)
        wait.placed([a for *_, a in self._all_actors()])
        ray.get([s.fence.remote(self._generation) for s in self.shards])
        self._restore_shards(self._recovery["source"])
        refs = []
        for stage, replicas in zip(self.stages[1:], self.stage_workers, strict=True):
            refs += [w.rewire.remote(self._generation, self._dense_ps(stage)) for w in replicas]
        refs += [
            w.rewire.remote(
                self._generation,
                self.stage_workers,
                [] if self.hosted else self.shards,
                self._dense_ps(self.stages[0]),
            )
            for w in self.data_workers
        ]
        ray.get(refs)
        self._restore_actors(self._recovery["source"])
        back = self._recovery["progress"]
        self._progress = {i: dict(p) for i, p in back.items()}
        source = self._recovery["source"]
        self.faults.append(
            FaultRecord(
                step=step,
                actors=[{k: v for k, v in d.items() if k != "handle"} for d in dead],
                rolled_back_to=self._recovery["step"],
                recovery_point=str(source) if isinstance(source, Path) else "start",
                recovery_s=time.perf_counter() - t0,
                batches_replayed=sum(at_fault[i]["position"] - back[i]["position"] for i in back),
                updates_lost=sum(at_fault[i]["updates"] - back[i]["updates"] for i in back),
                lower_bound=bool(new_data),
            )
        )

    def _type_of(self, dead: dict[str, Any]) -> str:
        if dead["kind"] == "ps_shard":
            return self.job.cluster.ps_resource
        return self.stages[dead["stage"]].type

    def _find_dead(self, hung_workers: set[int]) -> list[dict[str, Any]]:
        """Probe every actor; the ones that do not answer (or whose chunk never ended) are dead."""
        actors = self._all_actors()
        probes = [a.describe.remote() for *_, a in actors]
        ray.wait(probes, num_returns=len(probes), timeout=_PROBE_TIMEOUT_S)
        dead = []
        for (kind, stage, replica, handle), probe in zip(actors, probes, strict=True):
            how = None
            try:
                ray.get(probe, timeout=0)
            except ray.exceptions.GetTimeoutError:
                how = "did not answer (hung)"
            except Exception as err:
                if not is_actor_death(err):
                    raise
                how = how_it_died(err)
            if how is None and kind == "data_worker" and replica in hung_workers:
                how = "its chunk did not end (hung)"
            if how is not None:
                dead.append({"kind": kind, "stage": stage, "replica": replica, "how": how, "handle": handle})
        return dead

    def _progress_now(self, dead: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
        """Each DataWorker's progress at the fault: asked of the live ones, the last known of the dead."""
        gone = {d["replica"] for d in dead if d["kind"] == "data_worker"}
        out = {i: dict(p) for i, p in self._progress.items()}
        live = [i for i in range(self.num_workers) if i not in gone]
        for i, p in zip(live, ray.get([self.data_workers[i].progress.remote() for i in live]), strict=True):
            out[i] = p
        return out

    # -- checkpoints and restore ------------------------------------------------------------------

    def write_checkpoint(self, tmp: Path) -> None:
        """Between chunks (sparse pushes settled, optimizers stepped): every actor's state."""
        if self.job.mode == "async":  # dense pushes of stage replicas land before the snapshot
            ray.get([w.refresh.remote() for r in self.stage_workers for w in r])
        snapshots = [s.snapshot.remote(str(tmp / _shard_file(i))) for i, s in enumerate(self.shards)]
        try:
            owners = self._trained_actors()
            for name, state in zip(
                owners, ray.get([a.train_state.remote() for a in owners.values()]), strict=True
            ):
                write_npz_atomic(tmp / name, state)
            ray.get(snapshots)
        except BaseException:
            # An actor died mid-checkpoint: let the live shards finish writing into `tmp` before the
            # caller removes it, so that none of them fails on a vanished directory.
            ray.wait(snapshots, num_returns=len(snapshots), timeout=_READY_TIMEOUT_S)
            raise

    def restore(self, directory: Path, remap: bool = False) -> None:
        """Load a verified checkpoint into freshly started actors. `remap`: the checkpoint is of
        another plan with as many DataWorkers. Sync mode: dense state goes by layer name, PS rows are
        re-sharded when the shard count differs. Async mode: the same, and the dense weights with
        their Adam moments move between the workers and the PS by layer name, wherever each plan
        keeps a stage's weights (a replicated stage on a PS shard, a single replica in its worker;
        stage/dense_home)."""
        if remap and self.job.mode == "async":
            self._remapped.add(Path(directory))  # a fault later rolls back to it the same way
        self._restore_shards(Path(directory))
        self._restore_actors(Path(directory))

    def _restore_shards(self, source: Any) -> None:
        if isinstance(source, dict):
            ray.get([s.load_state.remote(st) for s, st in zip(self.shards, source["shards"], strict=True)])
            return
        if isinstance(source, Path) and source in self._remapped:
            states = self._remapped_shard_states(source)
            ray.get([s.load_state.remote(st) for s, st in zip(self.shards, states, strict=True)])
            return
        files = sorted(source.glob("ps-shard-*.npz"))
        if len(files) == self.num_shards:
            ray.get([s.restore.remote(str(source / _shard_file(i))) for i, s in enumerate(self.shards)])
            return
        states = reshard_states([read_npz(f) for f in files], self.num_shards)
        ray.get([s.load_state.remote(st) for s, st in zip(self.shards, states, strict=True)])

    def _restore_actors(self, source: Any) -> None:
        owners = self._trained_actors()
        if isinstance(source, Path) and source in self._remapped:
            layers = _layer_states(source)
            ray.get(
                [a.load_train_state.remote(self._actor_state(source, n, layers)) for n, a in owners.items()]
            )
        elif isinstance(source, dict):
            ray.get([a.load_train_state.remote(source["actors"][name]) for name, a in owners.items()])
        else:
            saved = {
                p.name: read_npz(p) for p in sorted(source.glob("*.npz")) if not p.name.startswith("ps-")
            }
            dense = {k: v for st in saved.values() for k, v in st.items() if not k.startswith("data/")}
            refs = []
            for name, actor in owners.items():
                state = dict(dense)
                if name.startswith("data-"):
                    if name not in saved:
                        raise DataError(f"{source}: no {name} (the checkpoint has another DataWorker count)")
                    state.update({k: v for k, v in saved[name].items() if k.startswith("data/")})
                refs.append(actor.load_train_state.remote(state))
            ray.get(refs)
        if self.job.mode == "async":  # replicas take the restored weights from the PS
            ray.get([w.refresh.remote() for _, _, _, w in self._all_actors()[self.num_shards :]])

    def _remapped_shard_states(self, source: Path) -> list[dict[str, np.ndarray]]:
        """States of this plan's PS shards from an async checkpoint of another plan: the sparse rows
        re-sharded, and a dense table (weights, Adam moments, version) for each stage this plan keeps
        on a PS shard, built by layer name from wherever the checkpoint kept those layers."""
        old = [read_npz(f) for f in sorted(source.glob("ps-shard-*.npz"))]
        sparse = [{k: v for k, v in st.items() if not k.startswith("dense/")} for st in old]
        states = reshard_states(sparse, self.num_shards)
        dense = _layer_states(source)
        for stage in self.stages:
            if self._dense_ps(stage) is None:
                continue
            table = f"dense/{dense_table_name(stage.index)}"
            layers = [layer.name for layer in self.model.layers[stage.start : stage.end]]
            names = [n for n in dense if any(n.startswith(f"{layer}.") for layer in layers)]
            state = states[stage.index % self.num_shards]
            state[f"{table}/version"] = np.array(
                max((int(dense[n].get("step", 0)) for n in names), default=0)
            )
            for n in names:
                param = np.asarray(dense[n]["param"], dtype=np.float32)
                state[f"{table}/param/{n}"] = param
                for moment in ("exp_avg", "exp_avg_sq"):
                    value = dense[n].get(moment, np.zeros_like(param))
                    state[f"{table}/{moment}/{n}"] = np.asarray(value, dtype=np.float32)
        return states

    def _actor_state(
        self, source: Path, name: str, dense: dict[str, dict[str, np.ndarray]]
    ) -> dict[str, Any]:
        """What `load_train_state` of this plan's actor `name` takes, from an async checkpoint of
        another plan: every layer's weights (and Adam state, for weights kept in the worker), plus a
        DataWorker's own position in its data."""
        state: dict[str, Any] = {}
        for n, entry in dense.items():
            state[f"param/{n}"] = entry["param"]
            if self.job.optimizer.dense == "adam" and "exp_avg" in entry:
                state[f"optim/{n}/exp_avg"] = entry["exp_avg"]
                state[f"optim/{n}/exp_avg_sq"] = entry["exp_avg_sq"]
                state[f"optim/{n}/step"] = np.array(float(entry.get("step", 0)), dtype=np.float32)
        if name.startswith("data-"):
            state.update(self._data_position(source, int(name[len("data-") : -len(".npz")])))
        return state

    def _data_position(self, source: Path, index: int) -> dict[str, np.ndarray]:
        """Where this plan's DataWorker `index` resumes in its data, from an async checkpoint of
        another plan: its own position when the checkpoint has as many DataWorkers; else (async only,
        other counts are refused in sync mode) the same fraction of its own batches as all old
        DataWorkers had done of theirs: the partitions differ, so some rows are seen once more and as
        many not at all, which async training (no promise of the sync result) accepts."""
        saved = [read_npz(p) for p in sorted(source.glob("data-*.npz"))]
        if len(saved) == self.num_workers:
            return {k: v for k, v in saved[index].items() if k.startswith("data/")}
        if not saved:
            raise DataError(f"{source}: no data-*.npz (DataWorker positions) in the checkpoint")
        done = sum(int(st["data/batch_index"]) for st in saved)
        fraction = done / max(self._batches_available(len(saved)), 1)
        skip = int(fraction * self._worker_batches(index, self.num_workers))
        updates = sum(int(st.get("data/updates", st["data/batch_index"])) for st in saved)
        return {
            "data/batch_index": np.array(skip, dtype=np.int64),
            "data/counter": np.array(max(int(st["data/counter"]) for st in saved), dtype=np.int64),
            "data/samples": np.array(skip * self.job.batch_size, dtype=np.int64),
            "data/updates": np.array(round(updates / self.num_workers), dtype=np.int64),
        }

    def _trained_actors(self) -> dict[str, Any]:
        """Checkpoint file name -> actor with dense weights and optimizer state."""
        owners = {f"data-{i:03d}.npz": w for i, w in enumerate(self.data_workers)}
        for stage, replicas in zip(self.stages[1:], self.stage_workers, strict=True):
            owners.update({f"stage{stage.index}-replica{r:03d}.npz": w for r, w in enumerate(replicas)})
        return owners

    def accounting(self, positions: dict[int, int]) -> dict[str, Any]:
        """Sync mode: batches applied exactly once on every PS shard, lost and duplicated (from the
        shards' own counts); async mode: the sparse updates each DataWorker sent."""
        if self.job.mode == "sync":
            applied = ray.get([s.applied.remote() for s in self.shards])
            return batch_accounting(applied, positions)
        return {"updates": sum(p["updates"] for p in self._progress.values())}

    # -- stats, evaluation, model -----------------------------------------------------------------

    def _batches_available(self, workers: int | None = None) -> int:
        """Batches all DataWorkers train in the job's epochs (`workers` of them; default this plan's)."""
        n = workers or self.num_workers
        return sum(self._worker_batches(i, n) for i in range(n))

    def _worker_batches(self, index: int, workers: int) -> int:
        """Batches DataWorker `index` of `workers` trains in the job's epochs (its files: every
        `workers`-th train partition from `index` on, as _new_data_worker gives them)."""
        import pyarrow.parquet as pq

        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files[index::workers])
        return rows // self.job.batch_size * self.job.runtime.epochs

    def _stage_stats(self) -> list[list[dict[str, Any]]]:
        refs = [[w.stats.remote() for w in self.data_workers]] + [
            [w.stats.remote() for w in r] for r in self.stage_workers
        ]
        return [ray.get(r) for r in refs]

    @staticmethod
    def _zero_stats(stats: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
        return [[{**s, "busy_s": 0.0} for s in stage] for stage in stats]

    def evaluate(self, eval_files: list[Path]) -> dict[str, float]:
        """AUC and logloss on the eval split, forward through the pipeline (newest weights)."""
        if not eval_files:
            return {}
        ray.get(
            [w.refresh.remote() for r in self.stage_workers for w in r]
            + [w.refresh.remote() for w in self.data_workers]
        )
        n = min(self.num_workers, len(eval_files))
        parts = ray.get(
            [
                self.data_workers[i].evaluate.remote("eval", _EVAL_BATCH, [str(f) for f in eval_files[i::n]])
                for i in range(n)
            ]
        )
        logits = np.concatenate([p["logits"] for p in parts])
        labels = np.concatenate([p["labels"] for p in parts])
        return {**evaluate_logits(labels, logits), "rows": len(labels)}

    def data_wait(self) -> list[float]:
        """Seconds each DataWorker spent blocked on gradients coming back (pipeline bubbles)."""
        return [s["wait_s"] for s in ray.get([w.stats.remote() for w in self.data_workers])]

    def ps_stats(self) -> list[dict[str, Any]]:
        return ray.get([s.stats.remote() for s in self.shards])

    def save_model(self, directory: Path) -> Path:
        """Dense weights (replica 0 of each stage, refreshed) and every shard's sparse rows."""
        dense: dict[str, np.ndarray] = {}
        for part in ray.get(
            [self.data_workers[0].dense_state.remote()]
            + [r[0].dense_state.remote() for r in self.stage_workers]
        ):
            dense.update(part)
        states = ray.get([s.state.remote() for s in self.shards])
        prefix = f"sparse/{SPARSE_TABLE}/"
        sparse = [{k[len(prefix) :]: v for k, v in st.items() if k.startswith(prefix)} for st in states]
        settings = {k: v for k, v in asdict(self.table).items() if k != "dim"}
        return save_checkpoint(
            directory, self.job.model, self.model, self.job.seed, dense, {SPARSE_TABLE: sparse}, settings
        )

    def shutdown(self) -> None:
        # compiled chains first: their actors' loops end cleanly before the actors are killed
        ray.wait(
            [w.close.remote() for w in self.data_workers], num_returns=len(self.data_workers), timeout=10
        )
        for *_, actor in self._all_actors():
            ray.kill(actor)
        self.data_workers, self.stage_workers, self.shards = [], [], []


class _HostedShard:
    """A PS shard hosted in DataWorker 0's process, addressed like a shard actor: ``shard.m.remote(...)``
    calls ``DataWorker.shard_call(index, "m", ...)`` on whichever DataWorker 0 is current."""

    def __init__(self, run: _Run, index: int):
        self._run, self._index = run, index

    def __getattr__(self, method: str) -> Any:
        run, index = self._run, self._index

        def remote(*args: Any) -> Any:
            return run.data_workers[0].shard_call.remote(index, method, *args)

        return SimpleNamespace(remote=remote)


class _ReplacementWait:
    """Waits for re-created actors to be placed. With elastic re-planning on, a type of the plan that
    leaves the cluster meanwhile (its node died with the actors) raises ResourcesChanged instead of
    waiting for a placement that cannot come."""

    _POLL_S = 2.0

    def __init__(self, run: _Run, plan_types: set[str] | None, types_before: list[str]):
        self.run, self.plan_types, self.types_before = run, plan_types, types_before

    def placed(self, actors: list[Any]) -> None:
        if not actors:
            return
        probes = [a.describe.remote() for a in actors]
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, pending = ray.wait(probes, num_returns=len(probes), timeout=self._POLL_S)
            try:
                ray.get(ready)  # a replacement placed on a node that is dying raises here
            except Exception as err:
                if not is_actor_death(err) or self.plan_types is None:
                    raise
                for _ in range(10):  # the GCS may take a moment to drop the dead node's resources
                    self._check_types(err)
                    time.sleep(1.0)
                raise
            if not pending:
                return
            self._check_types(None)
        self.run._wait_placed(actors)  # raises the ConfigError naming the demand

    def _check_types(self, cause: BaseException | None) -> None:
        """Elastic runs: raise ResourcesChanged when a type of the plan has left the cluster."""
        if self.plan_types is None:
            return
        now = present_types(self.run.job.cluster)
        gone = sorted(self.plan_types - set(now))
        if gone:
            source = self.run._recovery["source"]
            raise ResourcesChanged(
                f"resource type(s) {gone} of the plan disappeared (actors died with them)",
                self.types_before,
                now,
                self.run._recovery["step"],
                source if isinstance(source, Path) else None,
            ) from cause


def _layer_states(source: Path) -> dict[str, dict[str, np.ndarray]]:
    """Whole-model parameter name -> its "param" and, where the checkpoint has them, "exp_avg",
    "exp_avg_sq" and "step" (Adam), from an async checkpoint of any plan: the workers' files for
    weights they kept, the PS shards' dense tables (authoritative: a replica's copy may be stale)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for path in sorted(source.glob("*.npz")):
        if path.name.startswith("ps-"):
            continue
        for key, value in read_npz(path).items():
            if key.startswith("param/"):
                out.setdefault(key[len("param/") :], {})["param"] = value
            elif key.startswith("optim/"):
                name, field_name = key[len("optim/") :].rsplit("/", 1)
                out.setdefault(name, {})[field_name] = value
    for path in sorted(source.glob("ps-shard-*.npz")):
        state = read_npz(path)
        for key, value in state.items():
            parts = key.split("/", 3)
            if parts[0] != "dense" or len(parts) != 4:
                continue
            _, table, field_name, name = parts
            entry = out.setdefault(name, {})
            entry[field_name] = value
            entry["step"] = np.asarray(state[f"dense/{table}/version"])
    return out


def _shard_file(index: int) -> str:
    return f"ps-shard-{index:05d}.npz"


class _CheckpointSaver:
    """Writes output_dir/checkpoints/step-XXXXXXXX every `every` batches, keeping the newest 2."""

    def __init__(self, output_dir: Path, every: int, plan: dict[str, Any], num_shards: int):
        self.output_dir, self.every, self.plan, self.num_shards = output_dir, every, plan, num_shards
        self.written: list[str] = []

    def next_step(self, done: int) -> int:
        if not self.every:  # no periodic checkpoints (one is still written before a re-plan)
            return 1 << 62
        return (done // self.every + 1) * self.every

    def save(self, run: _Run, done: int, samples: int, losses: list[float]) -> Path:
        tmp = begin_training_checkpoint(self.output_dir, done)
        try:
            run.write_checkpoint(tmp)
            info = {
                "samples": samples,
                "losses": losses,
                "plan": _jsonable(self.plan),
                "ps_shards": self.num_shards,
            }
            final = commit_training_checkpoint(tmp, self.output_dir, done, info)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.written.append(str(final))
        return final


def _check_plan_types(stages: list[StageSpec], job: JobConfig, plan_file: str | None) -> None:
    """The resource types this plan needs are declared by the Ray cluster now (elastic runs)."""
    needed = {s.type for s in stages} | {job.cluster.ps_resource}
    missing = sorted(needed - set(present_types(job.cluster)))
    if missing:
        raise ConfigError(plan_file, "stages", "resource types the Ray cluster has now", missing)


def _check_checkpointing(job: JobConfig, resume: bool, save: bool) -> None:
    if resume and not save:
        raise ConfigError(None, "resume", "save=True (a resumed run writes to its output_dir)", resume)


def _resume_point(output_dir: Path, plan: dict[str, Any], num_shards: int, mode: str) -> dict[str, Any]:
    """The newest valid checkpoint of `output_dir`, checked against this run's plan. Sync mode: any
    plan with as many DataWorkers (stage 0 replicas; each resumes its own partitions at its own
    position, so the result equals an uninterrupted run). Async mode: any plan (a different DataWorker
    count resumes at the same fraction of the data, see :meth:`_Run._data_position`). Dense state and
    PS rows are plan-independent, see :meth:`_Run.restore`."""
    directory, manifest, skipped = latest_training_checkpoint(output_dir)
    stages = json.loads(json.dumps(_jsonable(plan.get("stages"))))
    saved = (manifest.get("plan") or {}).get("stages") or []
    same = saved == stages and manifest.get("ps_shards") == num_shards
    workers = stages[0]["replicas"] if stages else None
    if not same and (not saved or (mode == "sync" and saved[0].get("replicas") != workers)):
        raise ConfigError(
            str(directory / MANIFEST),
            "plan",
            f"in sync mode, a plan with as many DataWorkers (stage 0 replicas: "
            f"{saved[0].get('replicas') if saved else '?'}) as the checkpoint was written with",
            f"{workers} DataWorkers",
        )
    return {
        "directory": directory,
        "steps": int(manifest["step"]),
        "samples": int(manifest["samples"]),
        "losses": [float(x) for x in manifest["losses"]],
        "skipped": skipped,
        "plan_changed": not same,
    }


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


def _peak_queues(stats: list[list[dict[str, Any]]], stages: list[StageSpec]) -> list[int]:
    return [max(s["peak_pending"] for s in stage) for stage in stats]


def _claim_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse a directory holding a previous run, unless `overwrite` (then its run files go)."""
    previous = [
        p
        for p in (
            output_dir / SUMMARY_FILE,
            output_dir / MODEL_DIR,
            output_dir / CHECKPOINTS_DIR,
            output_dir / TENSORBOARD_DIR,
        )
        if p.exists()
    ]
    if previous and not overwrite:
        raise ConfigError(
            None,
            "output_dir",
            f"a directory without a previous run (found {previous[0].name}); pass --resume to continue "
            "it or --overwrite to replace it",
            str(output_dir),
        )
    for p in previous:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _dataset_files(job: JobConfig) -> tuple[list[Path], list[Path]]:
    """Train and eval Parquet partitions of the job's dataset (made first if synth_rows says so)."""
    dataset = prepare_dataset(job.data, seed=job.seed)
    train_files = list(dataset.files("train"))
    if not train_files:
        raise DataError(f"{dataset.path}: no train partitions (train/part-*.parquet)")
    return train_files, list(dataset.files("eval"))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value
