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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from heterps_ray.cluster import connect
from heterps_ray.config import JobConfig
from heterps_ray.data.dataset import prepare_dataset
from heterps_ray.errors import ConfigError, DataError
from heterps_ray.models import ModelSpec, build_model
from heterps_ray.ps.atomic import read_npz, write_bytes_atomic, write_npz_atomic
from heterps_ray.ps.shard import PSShard, TableSpec
from heterps_ray.runtime.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST,
    MODEL_DIR,
    begin_training_checkpoint,
    commit_training_checkpoint,
    latest_training_checkpoint,
    save_checkpoint,
)
from heterps_ray.runtime.evaluation import evaluate_logits
from heterps_ray.runtime.pipeline import StageSpec, check_capacity, resolve_stages
from heterps_ray.runtime.workers import (
    SPARSE_TABLE,
    DataSettings,
    DataWorker,
    StageWorker,
    WorkerSettings,
    canonical_names,
    dense_table_name,
)

SUMMARY_FILE = "run_summary.json"
_CHUNK_STEPS = 20  # batches per DataWorker between progress updates
_EVAL_BATCH = 4096  # rows per evaluation micro-batch
_READY_TIMEOUT_S = 120.0  # actors not placed by then: the cluster cannot hold the plan


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

    def to_json(self) -> str:
        return json.dumps(_jsonable(asdict(self)), indent=2)

    def save(self, path: str | Path) -> Path:
        return write_bytes_atomic(path, (self.to_json() + "\n").encode())


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
) -> RunSummary:
    """Run `plan` (a :class:`heterps_ray.scheduling.Plan`) for `job` on Ray and return its summary.

    Uses the running Ray if there is one, else connects to `address` (or $RAY_ADDRESS), else starts
    an embedded local Ray with the cluster's resource types as custom resources (stopped at the end).
    `steps` (else ``job.runtime.train_steps``, else all epochs) counts batches over all DataWorkers.
    `resume`: continue from the newest valid checkpoint in output_dir/checkpoints (sync mode).
    """
    model = build_model(job.model)
    stages = resolve_stages(plan, model, job, plan_file)
    num_shards = job.runtime.ps_shards or int(plan.ps_shards)
    check_capacity(stages, num_shards, job.cluster, plan_file)
    output_dir = Path(job.output_dir)
    plan_dict = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)
    _check_checkpointing(job, resume, save)
    start: dict[str, Any] = {}
    if resume:
        start = _resume_point(output_dir, plan_dict, num_shards)
    elif save:
        _claim_output_dir(output_dir, overwrite)
    train_files, eval_files = _dataset_files(job)
    owns_ray = connect(job.cluster, address)
    run = _Run(job, model, stages, num_shards, train_files)
    try:
        placement = run.start()
        if start:
            run.restore(start["directory"])
        target = steps or job.runtime.train_steps
        saver = (
            _CheckpointSaver(output_dir, job.runtime.checkpoint_every, plan_dict, num_shards)
            if save and job.runtime.checkpoint_every
            else None
        )
        history = run.train(target, progress, start, saver)
        metrics = run.evaluate(eval_files)
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
            losses=history["losses"],
            auc=metrics.get("auc"),
            logloss=metrics.get("logloss"),
            eval_rows=int(metrics.get("rows", 0)),
            placement=placement,
            ps=run.ps_stats(),
            output_dir=str(output_dir) if save else None,
            extra={"chunks": history["chunks"], "data_wait_s": run.data_wait()},
        )
        if saver is not None:
            summary.extra["checkpoints"] = saver.written
        if start:
            summary.extra["resumed_from"] = {
                "checkpoint": str(start["directory"]),
                "step": start["steps"],
                "skipped": start["skipped"],
            }
        if save:
            run.save_model(output_dir / MODEL_DIR)
            summary.save(output_dir / SUMMARY_FILE)
        return summary
    finally:
        run.shutdown()
        if owns_ray:
            ray.shutdown()


# ---------------------------------------------------------------------------------------------


class _Run:
    """The actors of one run and the driver-side loop over them."""

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
        self.shards: list[Any] = []
        self.stage_workers: list[list[Any]] = []
        self.data_workers: list[Any] = []

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

    def start(self) -> list[dict[str, Any]]:
        """Start shards, stage workers and data workers; wait until all are placed."""
        cluster = self.job.cluster
        ps_options = cluster.type(cluster.ps_resource).actor_options()
        shard_cls = ray.remote(PSShard)
        self.shards = [
            shard_cls.options(**ps_options).remote(i, self.num_shards, {SPARSE_TABLE: self.table})
            for i in range(self.num_shards)
        ]
        if self.job.mode == "async":
            self._register_dense_tables()
        stage_cls = ray.remote(StageWorker)
        for stage in self.stages[1:]:
            options = cluster.type(stage.type).actor_options()
            self.stage_workers.append(
                [
                    stage_cls.options(**options).remote(
                        stage, r, self.model, self._settings(stage), self._dense_ps(stage)
                    )
                    for r in range(stage.replicas)
                ]
            )
        data_cls = ray.remote(DataWorker)
        stage0 = self.stages[0]
        for i in range(self.num_workers):
            data = DataSettings(
                path=str(self.job.data.path),
                files=tuple(str(f) for f in self.files[i :: self.num_workers]),
                batch_size=self.job.batch_size,
                micro_batches=self.job.runtime.micro_batches,
                epochs=self.job.runtime.epochs,
                max_in_flight=self.job.runtime.max_in_flight,
            )
            self.data_workers.append(
                data_cls.options(**cluster.type(stage0.type).actor_options()).remote(
                    i,
                    stage0,
                    self.model,
                    self._settings(stage0),
                    data,
                    self.stage_workers,
                    self.shards,
                    self._dense_ps(stage0),
                )
            )
        actors = self.shards + [a for r in self.stage_workers for a in r] + self.data_workers
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
        return self.shards[stage.index % self.num_shards] if self.job.mode == "async" else None

    def _register_dense_tables(self) -> None:
        refs = []
        for stage in self.stages:
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

    def train(
        self,
        target: int | None,
        progress: bool,
        start: dict[str, Any] | None = None,
        saver: _CheckpointSaver | None = None,
    ) -> dict[str, Any]:
        """Drive the DataWorkers chunk by chunk until `target` batches (or the data) are done, from
        `start` (a resumed checkpoint's steps, samples and losses), checkpointing through `saver`."""
        from tqdm import tqdm

        start = start or {}
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
        active = list(range(self.num_workers))
        busy_prev = self._stage_stats()
        seconds = 0.0
        chunks: list[tuple[int, float]] = []  # (samples, seconds) per chunk, for warm-up-free rates
        try:
            while active and (target is None or done < target):
                per = _CHUNK_STEPS
                if target is not None:
                    per = min(per, math.ceil((target - done) / len(active)))
                if saver is not None:  # end chunks on checkpoint boundaries
                    per = min(per, math.ceil((saver.next_step(done) - done) / len(active)))
                t0 = time.perf_counter()
                results = ray.get([self.data_workers[i].run.remote(per) for i in active])
                interval = time.perf_counter() - t0
                seconds += interval
                chunks.append((sum(r["samples"] for r in results), interval))
                for r in results:
                    losses += r["losses"]
                    done += r["steps"]
                    samples += r["samples"]
                active = [i for i, r in zip(active, results, strict=True) if not r["exhausted"]]
                if saver is not None and done >= saver.next_step(done - sum(r["steps"] for r in results)):
                    saver.save(self, done, samples, losses)
                stats = self._stage_stats()
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
        }

    def _batches_available(self) -> int:
        import pyarrow.parquet as pq

        total = 0
        for i in range(self.num_workers):
            rows = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files[i :: self.num_workers])
            total += rows // self.job.batch_size * self.job.runtime.epochs
        return total

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

    def write_checkpoint(self, tmp: Path) -> None:
        """Sync mode, between chunks (sparse pushes settled, optimizers stepped): every actor's state."""
        snapshots = [s.snapshot.remote(str(tmp / _shard_file(i))) for i, s in enumerate(self.shards)]
        owners = self._trained_actors()
        for name, state in zip(
            owners, ray.get([a.train_state.remote() for a in owners.values()]), strict=True
        ):
            write_npz_atomic(tmp / name, state)
        ray.get(snapshots)

    def restore(self, directory: Path) -> None:
        """Load a verified checkpoint into freshly started actors (same plan and shard count)."""
        refs = [s.restore.remote(str(directory / _shard_file(i))) for i, s in enumerate(self.shards)]
        owners = self._trained_actors()
        refs += [a.load_train_state.remote(read_npz(directory / name)) for name, a in owners.items()]
        ray.get(refs)

    def _trained_actors(self) -> dict[str, Any]:
        """Checkpoint file name -> actor with dense weights and optimizer state."""
        owners = {f"data-{i:03d}.npz": w for i, w in enumerate(self.data_workers)}
        for stage, replicas in zip(self.stages[1:], self.stage_workers, strict=True):
            owners.update({f"stage{stage.index}-replica{r:03d}.npz": w for r, w in enumerate(replicas)})
        return owners

    def shutdown(self) -> None:
        for actor in self.data_workers + [a for r in self.stage_workers for a in r] + self.shards:
            ray.kill(actor)
        self.data_workers, self.stage_workers, self.shards = [], [], []


def _shard_file(index: int) -> str:
    return f"ps-shard-{index:05d}.npz"


class _CheckpointSaver:
    """Writes output_dir/checkpoints/step-XXXXXXXX every `every` batches, keeping the newest 2."""

    def __init__(self, output_dir: Path, every: int, plan: dict[str, Any], num_shards: int):
        self.output_dir, self.every, self.plan, self.num_shards = output_dir, every, plan, num_shards
        self.written: list[str] = []

    def next_step(self, done: int) -> int:
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


def _check_checkpointing(job: JobConfig, resume: bool, save: bool) -> None:
    if job.mode != "sync" and (resume or job.runtime.checkpoint_every):
        raise ConfigError(
            None,
            "runtime.checkpoint_every" if job.runtime.checkpoint_every else "--resume",
            "sync mode (checkpoints and resume are sync-only for now)",
            job.mode,
        )
    if resume and not save:
        raise ConfigError(None, "resume", "save=True (a resumed run writes to its output_dir)", resume)


def _resume_point(output_dir: Path, plan: dict[str, Any], num_shards: int) -> dict[str, Any]:
    """The newest valid checkpoint of `output_dir`, checked against this run's plan."""
    directory, manifest, skipped = latest_training_checkpoint(output_dir)
    stages = json.loads(json.dumps(_jsonable(plan.get("stages"))))
    if (manifest.get("plan") or {}).get("stages") != stages or manifest.get("ps_shards") != num_shards:
        raise ConfigError(
            str(directory / MANIFEST),
            "plan",
            f"the stages and PS shard count the checkpoint was written with ({manifest.get('ps_shards')} shards)",
            f"different stages or {num_shards} shards",
        )
    return {
        "directory": directory,
        "steps": int(manifest["step"]),
        "samples": int(manifest["samples"]),
        "losses": [float(x) for x in manifest["losses"]],
        "skipped": skipped,
    }


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


def _peak_queues(stats: list[list[dict[str, Any]]], stages: list[StageSpec]) -> list[int]:
    return [max(s["peak_pending"] for s in stage) for stage in stats]


def _claim_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse a directory holding a previous run, unless `overwrite` (then its run files go)."""
    previous = [
        p
        for p in (output_dir / SUMMARY_FILE, output_dir / MODEL_DIR, output_dir / CHECKPOINTS_DIR)
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
