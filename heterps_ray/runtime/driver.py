"""The training driver: runs a plan for a job on Ray, from start to the saved model.

It wires the runtime's parts in order: the actor set (actors.py) is started and placed, a resumed
checkpoint is restored into it (snapshots.py), the chunk loop (loop.py) trains with checkpoints and
fault recovery (recovery.py), then evaluation, accounting and the saved model (finish.py), and the
run summary.

Example::

    summary = train(load_job("configs/jobs/quickstart.yaml"), load_plan("configs/plans/quickstart.json"))
    summary.auc, summary.throughput
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from heterps_ray.cluster import connect
from heterps_ray.config import JobConfig
from heterps_ray.costmodel.plan import Plan
from heterps_ray.costmodel.table_memory import TableEstimate, check_plan_holds, estimate_table
from heterps_ray.data.dataset import prepare_dataset
from heterps_ray.devices import cluster_gpus
from heterps_ray.errors import ConfigError, DataError, StorageError
from heterps_ray.metrics.tracking import TENSORBOARD_DIR, RunTracker
from heterps_ray.models import build_model
from heterps_ray.ps.atomic import write_bytes_atomic
from heterps_ray.runtime import trace
from heterps_ray.runtime.actors import ActorSet, hosts_shards
from heterps_ray.runtime.checkpoint import (
    CHECKPOINTS_DIR,
    MODEL_DIR,
    has_training_checkpoint,
    jsonable,
    remove_leftovers,
)
from heterps_ray.runtime.elastic import ResourcesChanged, present_types
from heterps_ray.runtime.finish import accounting, evaluate, save_model
from heterps_ray.runtime.loop import (
    CHUNK_STEPS,
    ChunkLoop,
    FloorMissed,
    LiveActors,
    LoopSettings,
    steady_rate,
)
from heterps_ray.runtime.pipeline import StageSpec, check_capacity, check_gpus, resolve_stages
from heterps_ray.runtime.recovery import Recovery
from heterps_ray.runtime.snapshots import CheckpointSaver, StateStore, resume_point

SUMMARY_FILE = "run_summary.json"

log = logging.getLogger(__name__)


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
        return json.dumps(jsonable(asdict(self)), indent=2)

    def save(self, path: str | Path) -> Path:
        return write_bytes_atomic(path, (self.to_json() + "\n").encode())


def train(
    job: JobConfig,
    plan: Plan,
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
    start_if_none: bool = False,
    evaluation: bool = True,
    first_chunk: int = CHUNK_STEPS,
    estimate: TableEstimate | None = None,
) -> RunSummary:
    """Run `plan` for `job` on Ray and return its summary.

    Uses the running Ray if there is one, else connects to `address` (or $RAY_ADDRESS), else starts
    an embedded local Ray with the cluster's resource types as custom resources (stopped at the end).
    `steps` (else ``job.runtime.train_steps``, else all epochs) counts batches over all DataWorkers.
    `evaluation`: False leaves out the eval split's AUC (a runtime probe times training only).
    `first_chunk`: batches per DataWorker in the warm-up chunk that the steady rate leaves out.
    `estimate`: the job's table estimate, as ``heterps run`` computed it once for the whole run
    (costmodel/table_memory.py; None: estimated here, from the job's dataset).
    `resume`: continue from the newest valid checkpoint in output_dir/checkpoints (a checkpoint of
    another plan with as many DataWorkers works too, in both modes: dense weights and optimizer state
    go by layer name, wherever the old or the new plan keeps them, and PS rows are re-sharded).
    A dead actor is re-created and the run rolls back to its newest checkpoint (else its start) and
    replays, at most ``runtime.max_restarts`` times. `on_chunk` is called between chunks with the
    live actors. `elastic`: raise :class:`~heterps_ray.runtime.elastic.ResourcesChanged` (after a
    checkpoint) when the cluster's resource types change. `floor` (samples/s): once the warm-up is
    over (see loop.FLOOR_WINDOW_S), raise :class:`~heterps_ray.runtime.loop.FloorMissed` (after a
    checkpoint) when the steady rate is under loop.FLOOR_SHORTFALL of it. `start_if_none` (with
    `resume`): an output_dir without any checkpoint starts from step 0, keeping what it holds.
    """
    called = time.perf_counter()
    model = build_model(job.model)
    stages = resolve_stages(plan, model, job, plan_file)
    num_shards = job.runtime.ps_shards or int(plan.ps_shards)
    if estimate is None:
        estimate = estimate_table(job, model.embedding_dim)
    hosted = hosts_shards(job, stages, num_shards, estimate)
    check_capacity(stages, 0 if hosted else num_shards, job.cluster, plan_file)  # hosted: no shard actor
    if not hosted:  # shard actors: each holds its share
        check_plan_holds(job, estimate, num_shards, plan_file)
    output_dir = Path(job.output_dir)
    plan_dict = plan.to_dict()
    if resume and not save:
        raise ConfigError(None, "resume", "save=True (a resumed run writes to its output_dir)", resume)
    # the data is checked before --overwrite removes a previous run: a failing run replaces nothing
    train_files, eval_files = _dataset_files(job)
    if estimate is None:  # the dataset was made just now (data.synth_rows)
        estimate = estimate_table(job, model.embedding_dim)
    start: dict[str, Any] = {}
    if save:
        remove_leftovers(output_dir)
    if resume and not (start_if_none and not has_training_checkpoint(output_dir)):
        start = resume_point(output_dir, plan_dict, num_shards, job.mode)
    elif save and not resume:
        _claim_output_dir(output_dir, overwrite)
    if elastic and ray.is_initialized():  # `heterps run` connected; types may come and go since
        owns_ray = False
        _check_plan_types(stages, job, plan_file)
    else:
        owns_ray = connect(job.cluster, address)
    actors = ActorSet(job, model, stages, num_shards, train_files, estimate, plan.table_place)
    store = StateStore(actors)
    recovery = Recovery(actors, store)
    tracker: RunTracker | None = None  # TensorBoard events in output_dir/tensorboard (and MLflow)
    # the actors stay warm for this driver's next run when this one ends quiescent: trained to the end,
    # or stopped between chunks for a re-plan; after any other error they are killed
    quiescent = False
    loop: ChunkLoop | None = None
    ready_s = 0.0
    try:
        if not job.cluster.autoscale.enabled:  # an autoscaler adds GPU nodes when asked
            check_gpus(stages, 0 if actors.hosted else num_shards, job.cluster, cluster_gpus(), plan_file)
        placement = actors.start()
        if start:
            store.restore(start["directory"], remap=start["plan_changed"])
        ready_s = time.perf_counter() - called
        rt = job.runtime
        saver = (
            CheckpointSaver(
                output_dir,
                plan_dict,
                num_shards,
                rt.checkpoint_every,
                rt.checkpoint_interval_s,
                rt.checkpoint_keep,
                rt.checkpoint_full_every,
                rt.checkpoint_delta_max_share,
            )
            if save
            else None
        )
        if save:
            tracker = RunTracker(output_dir, mlflow=job.runtime.mlflow, run_name=job.name)
        settings = LoopSettings(
            steps or job.runtime.train_steps, progress, elastic, floor, on_chunk, first_chunk
        )
        loop = ChunkLoop(actors, recovery, saver, tracker, settings)
        history = loop.run(start)
        loop.supervised("stats", actors.flush_tables)  # rows held in GPU memory back on the shards
        started = _start_timing(ready_s, loop.first_batch_s)
        # from here on every phase that talks to an actor is supervised: a fault rolls back to the
        # trained state (made durable by the loop) and the phase is done again
        metrics = loop.supervised("evaluate", lambda: evaluate(actors, eval_files if evaluation else []))
        ps = loop.supervised("stats", actors.ps_stats)
        data_wait = loop.supervised("stats", actors.data_wait)
        counts = loop.supervised(
            "accounting", lambda: accounting(actors, history["positions"], recovery.progress)
        )
        this_run = history["samples"] - start.get("samples", 0)
        if tracker is not None:
            tracker.log_final({f"eval/{k}": float(metrics[k]) for k in ("auc", "logloss") if k in metrics})
        summary = RunSummary(
            job=job.name,
            mode=job.mode,
            model=model.name,
            plan=plan_dict,
            stages=_with_devices(history["stages"], placement),
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
            ps=ps,
            output_dir=str(output_dir) if save else None,
            extra={
                "chunks": history["chunks"],
                "floor_check": history["floor_check"],  # with train(floor=...): the steady rate checked
                "data_wait_s": {k: data_wait[k] for k in ("gradients", "reader")},
                "data_phases_s": data_wait["phases"],  # each DataWorker's training thread, by phase
                "data_threads_cpu_ms_per_batch": data_wait["threads"],  # each DataWorker's threads
                "data_ops_per_batch": data_wait["ops"],  # where counted (runtime.op_profile_batches)
                "faults": [asdict(f) for f in recovery.faults],
                "restarts": recovery.restarts,
                "max_restarts": job.runtime.max_restarts,
                "start": started,
                "table": {
                    "place": actors.place.describe(),
                    # the tiers count from this process's start: a resumed run's lookups since then
                    **loop.supervised("stats", lambda: actors.table_stats(lookups=this_run * model.num_slots)),
                },
                **counts,
            },
        )
        if trace.on():  # the run's losses beside its tensors
            trace.event("losses", "driver", {"losses": history["losses"]})
        if saver is not None:
            summary.extra["checkpoints"] = saver.written
            summary.extra["checkpoint_seconds"] = saver.seconds
            summary.extra["checkpoint_errors"] = saver.errors
        if start:
            summary.extra["resumed_from"] = {
                "checkpoint": str(start["directory"]),
                "step": start["steps"],
                "skipped": start["skipped"],
                "plan_changed": start["plan_changed"],
            }
        if save:
            try:
                loop.supervised("save", lambda: save_model(actors, output_dir / MODEL_DIR))
                summary.extra["faults"] = [asdict(f) for f in recovery.faults]  # the save's own, if any
                summary.extra["restarts"] = recovery.restarts
                summary.save(output_dir / SUMMARY_FILE)
            except OSError as exc:
                point = recovery.point
                where = f"checkpoint {point.checkpoint}" if point and point.checkpoint else "no checkpoint"
                raise StorageError(
                    f"{output_dir}: the trained model could not be written ({exc}); the trained state is in "
                    f"{where}: make room and run again with --resume to evaluate and save it"
                ) from exc
        quiescent = True
        return summary
    except (FloorMissed, ResourcesChanged) as stop:
        quiescent = not isinstance(stop, ResourcesChanged) or stop.between_chunks
        if loop is not None:  # how long this run took to start, for the closed loop's re-plan record
            stop.start = _start_timing(ready_s, loop.first_batch_s)
        raise
    finally:
        _clean_up(
            [
                *([tracker.close] if tracker is not None else []),
                lambda: actors.shutdown(keep_warm=quiescent and not owns_ray),
                *([ray.shutdown] if owns_ray else []),
            ],
            failing=sys.exc_info()[1] is not None,
        )


def _clean_up(steps: list[Callable[[], object]], failing: bool) -> None:
    """Run every step of a run's clean-up, each one even when a step before it failed. While the run's
    own error propagates (`failing`), a step's error is logged, never raised over it: the user sees the
    first error (a plan refused before its actors were all started, say), not one of the clean-up."""
    first: Exception | None = None
    for step in steps:
        try:
            step()
        except Exception as exc:
            if failing:
                log.warning("clean-up after a failed run: %s", exc)
            first = first or exc
    if first is not None and not failing:
        raise first


def _start_timing(ready_s: float, first_batch_s: float | None) -> dict[str, float | None]:
    """Seconds from the train() call to its actors placed (and a checkpoint restored), and to the end of
    its first batch (the first chunk's time per batch after that; None before any chunk)."""
    return {
        "ready_s": round(ready_s, 3),
        "first_batch_s": None if first_batch_s is None else round(ready_s + first_batch_s, 3),
    }


def _with_devices(stages: list[dict[str, Any]], placement: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each stage with the devices its actors really computed on (from their placement reports), not
    the one its type is configured with."""
    seen: dict[int, set[str]] = {}
    for actor in placement:
        if "stage" in actor and "device" in actor:
            seen.setdefault(int(actor["stage"]), set()).add(str(actor["device"]))
    return [{**s, "device": ", ".join(sorted(seen.get(int(s["index"]), set()))) or None} for s in stages]


def _check_plan_types(stages: list[StageSpec], job: JobConfig, plan_file: str | None) -> None:
    """The resource types this plan needs are declared by the Ray cluster now (elastic runs)."""
    needed = {s.type for s in stages} | {job.cluster.ps_resource}
    missing = sorted(needed - set(present_types(job.cluster)))
    if missing:
        raise ConfigError(plan_file, "stages", "resource types the Ray cluster has now", missing)


def _check_checkpointing(job: JobConfig, resume: bool, save: bool) -> None:
    if resume and not save:
        raise ConfigError(None, "resume", "save=True (a resumed run writes to its output_dir)", resume)


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
