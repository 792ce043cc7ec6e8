"""The job's config: the model, its data, the optimizer, the table's admission and tiers, the runtime's
settings, and the job that holds them with its cluster (config/cluster.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from heterps_ray.config.cluster import _STRICT, ClusterConfig, ResourceType
from heterps_ray.errors import ConfigError


class ModelConfig(BaseModel):
    """A model of the zoo by name; the other fields are the builder's keyword arguments,
    checked by the model zoo (see heterps_ray.models)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class DataConfig(BaseModel):
    model_config = _STRICT

    path: Path = Field(
        description="dataset directory (_meta.json, split=train/ and split=eval/ Parquet partitions)"
    )
    synth_rows: int | None = Field(
        None, ge=1, description="if set and `path` holds no dataset, `heterps run` generates one"
    )


class OptimizerConfig(BaseModel):
    model_config = _STRICT

    sparse: Literal["adagrad"] = "adagrad"
    # Chosen on the quickstart's 200k synthetic rows against DeepCTR-Torch (BENCHMARKS.md "Model
    # quality", benchmarks/bench_quality.py): a small initial accumulator lets fresh rows move at once.
    sparse_lr: float = Field(0.02, gt=0)
    sparse_init_accumulator: float = Field(1e-6, ge=0)
    dense: Literal["adam", "sgd"] = "adam"
    dense_lr: float = Field(1e-3, gt=0)


class TableConfig(BaseModel):
    """Admission and eviction of the sparse table's rows (heterps_ray.ps.table.SparseTable). By
    default a key gets a row at the 2nd batch that shows it (until then it reads zeros) and keeps
    it: on Criteo-Kaggle-shaped data that holds 78% fewer rows (53% fewer bytes) for 0.00005 AUC
    (BENCHMARKS.md "Admission"). ``admit_after: 1`` gives every key a row at first sight."""

    model_config = _STRICT

    admit_after: int = Field(
        2, ge=1, description="batches that must show a key before it gets a row (until then zeros; 1: at once)"
    )
    ttl_batches: int = Field(
        0, ge=0, description="a row not seen for this many batches is dropped (0: never)"
    )
    max_shard_mb: float = Field(
        0, ge=0, description="memory cap of each PS shard's rows; the least recently seen go first (0: none)"
    )
    evict: Literal["lru", "lfu"] = Field("lru", description="at the cap: least recently or least often seen")
    disk_dir: str = Field(
        "",
        description="a disk tier: each PS shard keeps its rows beyond ram_mb in files under this directory "
        "of its node's local disk (least recently or least often seen first, as `evict`; '': all in RAM)",
    )
    ram_mb: float = Field(
        0, ge=0, description="with disk_dir: memory of each PS shard's rows in RAM (the hot set), the rest on disk"
    )
    disk_reads_in_flight: int = Field(
        32,
        ge=1,
        le=256,
        description="with disk_dir: rows a shard reads from disk at once, each on a thread of its own (the "
        "device serves many reads at a time; 1: one after another)",
    )

    @model_validator(mode="after")
    def _check_disk_tier(self) -> TableConfig:
        if self.disk_dir and self.ram_mb <= 0:
            raise ConfigError(None, "table.ram_mb", "> 0 with table.disk_dir (the RAM budget of each shard)", self.ram_mb)
        if self.disk_dir and not self.disk_dir.startswith("/"):
            raise ConfigError(
                None, "table.disk_dir", "an absolute path (each PS node's own local disk)", self.disk_dir
            )
        if self.ram_mb and not self.disk_dir:
            raise ConfigError(None, "table.disk_dir", "a directory on the PS nodes' local disk with table.ram_mb", "''")
        for name in ("ttl_batches", "max_shard_mb"):
            if self.disk_dir and getattr(self, name):
                raise ConfigError(
                    None, f"table.{name}", "0 with table.disk_dir (a disk tier keeps every row)", getattr(self, name)
                )
        return self


class RuntimeConfig(BaseModel):
    model_config = _STRICT

    micro_batches: int = Field(1, ge=1, description="sync mode: micro-batches per batch (GPipe style)")
    max_in_flight: int = Field(4, ge=1, description="bounded in-flight micro-batches per link")
    max_staleness: int = Field(
        0,
        ge=0,
        description="async mode, replicated stages: most versions a replica's dense weights (held on "
        "a PS shard) may lag behind the shard after its own push (0: a replica always sees its own "
        "updates; more saves weight transfers)",
    )
    batches_ahead: int = Field(
        0,
        ge=0,
        description="async mode: batches a DataWorker may start before its earlier batches' updates "
        "are applied (0: every batch sees all of its DataWorker's earlier updates, as in sync; more "
        "overlaps stages across batches, on rows and weights that many updates old)",
    )
    ps_shards: int | None = Field(None, ge=1, description="override the plan's PS shard count")
    mlflow: bool = Field(
        False, description="also log the run's metrics to MLflow (needs `pip install mlflow`)"
    )
    ps_hosting: Literal["auto", "actors"] = Field(
        "auto",
        description="auto: a plan with one DataWorker and no replicated stage hosts its PS shards in "
        "that DataWorker's process (no PS call crosses a process); actors: every shard is an actor",
    )
    train_steps: int | None = Field(None, ge=1, description="stop after this many batches")
    epochs: int = Field(1, ge=1)
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="also write a resumable checkpoint (PS snapshots, dense state, data position) every N "
        "batches (0 = by time only, see checkpoint_interval_s); faults roll back to the newest one",
    )
    checkpoint_interval_s: float = Field(
        300.0,
        ge=0,
        description="write a checkpoint at the first chunk boundary this many seconds after the last one "
        "(0 = not by time); with the checkpoint after the last batch, a fault or a driver death costs "
        "at most this much training",
    )
    checkpoint_keep: int = Field(
        2,
        ge=1,
        description="the newest checkpoints kept (older ones are removed, unless a kept one builds on them)",
    )
    checkpoint_full_every: int = Field(
        10,
        ge=1,
        description="every Nth checkpoint writes the PS tables whole; the ones between write only the rows "
        "changed and the keys removed since the checkpoint before (1: every checkpoint is full)",
    )
    checkpoint_delta_max_share: float = Field(
        0.1,
        gt=0,
        le=1,
        description="a checkpoint between full ones is written full anyway when more than this share of a "
        "PS shard's rows changed since the last: such a delta is nearly as big and slower to gather, and "
        "its rows are held in memory while it is written (a full snapshot streams from the table)",
    )
    max_restarts: int = Field(
        3, ge=0, description="actor deaths a run recovers from before it fails (0 = fail on the first)"
    )
    readers: int | None = Field(
        None,
        ge=1,
        description="threads converting the data's read chunks in each DataWorker (key hashing, the dense "
        "transform); default: the CPUs its type asks Ray for beyond its torch threads, at least 1",
    )
    op_profile_batches: int = Field(
        0,
        ge=0,
        description="batches (after a DataWorker's first 10) whose ops torch.profiler counts: aten ops, GPU "
        "kernels and waits for the device per batch, in the run summary's data_ops_per_batch; with it on, "
        "every thread's CPU per batch too (data_threads_cpu_ms_per_batch; 0: neither)",
    )
    gpu_table: Literal["auto", "off"] = Field(
        "auto",
        description="auto: when stage 0 runs on a cuda type in one DataWorker, the table's rows live in its "
        "GPU memory (all of them, or the most recently used as a cache in front of the PS shards, within the "
        "type's gpu_memory_gb); off: they stay on the PS shards",
    )
    gpu_precision: Literal["fp32", "tf32", "bf16"] = Field(
        "fp32",
        description="stages on a GPU: fp32 (TF32 off, highest matmul precision: a sync run equals the CPU "
        "reference), tf32 (TF32 matmuls, faster) or bf16 (TF32 and bf16 autocast forwards, fastest)",
    )


class JobConfig(BaseModel):
    """One training job: which model, on which data and cluster, at what throughput floor."""

    model_config = _STRICT

    name: str
    model: ModelConfig
    cluster: ClusterConfig
    data: DataConfig
    batch_size: int = Field(512, ge=1)
    samples: int = Field(ge=1, description="samples to train, for cost projection")
    throughput_min: float = Field(ge=0, description="samples/s the plan must reach")
    mode: Literal["sync", "async"] = "sync"
    scheduler: str = "exact"
    output_dir: Path
    seed: int = 0
    optimizer: OptimizerConfig = OptimizerConfig()
    table: TableConfig = TableConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="before")
    @classmethod
    def _resolve_wait_policy(cls, raw: Any) -> Any:
        """A type's ``omp_wait_policy: auto`` becomes active where the job's stages never compute at once
        (sync, one micro-batch per batch): a thread spinning between its own parallel regions then takes
        no core another actor needs, and sleeping cost a one-stage plan a third of its speed
        (BENCHMARKS.md "OpenMP's wait policy by mode"). Async or micro-batched stages compute side by
        side, where a spinning thread halved an async three-stage plan: passive."""
        if not isinstance(raw, dict) or raw.get("cluster") is None:
            return raw
        runtime = raw.get("runtime") or {}
        micro = dict(runtime).get("micro_batches", 1)  # a RuntimeConfig iterates as its fields
        spin = raw.get("mode", "sync") == "sync" and micro == 1
        cluster = raw["cluster"]
        types = dict(cluster).get("resource_types")
        if not isinstance(types, list):
            return raw  # the cluster's own validation names what is wrong
        resolved = [_resolve_auto(t, "active" if spin else "passive") for t in types]
        if isinstance(cluster, ClusterConfig):
            cluster = cluster.model_copy(update={"resource_types": resolved})
        else:
            cluster = {**cluster, "resource_types": resolved}
        return {**raw, "cluster": cluster}

    @field_validator("runtime")
    @classmethod
    def _check_micro_batches(cls, runtime: RuntimeConfig, info: ValidationInfo) -> RuntimeConfig:
        batch_size = info.data.get("batch_size")
        if batch_size and batch_size % runtime.micro_batches:
            raise ValueError(f"micro_batches ({runtime.micro_batches}) to divide batch_size ({batch_size})")
        return runtime


def _resolve_auto(rtype: Any, policy: str) -> Any:
    if isinstance(rtype, ResourceType) and rtype.omp_wait_policy == "auto":
        return rtype.model_copy(update={"omp_wait_policy": policy})
    if isinstance(rtype, dict) and rtype.get("omp_wait_policy", "auto") == "auto":
        return {**rtype, "omp_wait_policy": policy}
    return rtype
