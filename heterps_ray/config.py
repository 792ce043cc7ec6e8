"""Job, cluster and model configs: YAML files validated on load.

Every validation failure becomes one :class:`~heterps_ray.errors.ConfigError` naming the file,
the field (dotted path) and what was expected. Relative paths inside a config are resolved
against the directory of the file that names them, so a job can be run from anywhere.

Example::

    job = load_job("configs/jobs/quickstart.yaml")
    job.cluster.resource_types[0].name   # "cpu_small"
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from heterps_ray.errors import ConfigError

_STRICT = ConfigDict(extra="forbid", frozen=True)

# What a node keeps besides its actors' tables (GiB): Ray's object store as the local cluster starts it
# (cluster.py), the driver process, and per actor its interpreter, torch and batches in flight (a
# DataWorker of CTR-DNN on Criteo-shaped data, evaluation included, measured 0.80 GiB: BENCHMARKS.md
# "Table memory: a hosted table's checkpoints and model file").
OBJECT_STORE_GB = 1.0
DRIVER_GB = 1.5
ACTOR_RESERVE_GB = 1.0
# libgomp's spin, in iterations (~100,000 a ms), for a type whose OpenMP threads spin: long enough to
# span any gap between a training loop's parallel regions, short enough that an idle actor's threads
# go to sleep. Without it ACTIVE spins for minutes (30 billion): an idle warm actor of 2 threads burnt
# a core, taking it from the run or probe on another type (BENCHMARKS.md "Idle actors spun").
ACTIVE_SPIN_COUNT = 10_000_000


def machine_memory_gb() -> float:
    """This machine's physical memory, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


class ResourceType(BaseModel):
    """One kind of machine a stage (or a PS shard) can run on."""

    model_config = _STRICT

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_\-]*$", description="Ray custom resource name")
    device: Literal["cpu", "cuda"] = "cpu"
    price_per_hour: float = Field(ge=0, description="$ per actor-hour of this type")
    max_instances: int = Field(ge=1, description="most actors of this type at once")
    ray_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources one actor asks for, besides {name: 1} (e.g. {CPU: 1})",
    )
    num_gpus: float = Field(
        0.0,
        ge=0,
        validate_default=True,
        description="GPUs one actor asks Ray for; a cuda type must ask for some (Ray hides GPUs from none)",
    )
    torch_threads: int = Field(1, ge=1, description="torch.set_num_threads inside the actor")
    bandwidth_gbps: float = Field(10.0, gt=0)
    io_bandwidth_gbps: float | None = Field(None, gt=0)
    latency_ms: float = Field(0.0, ge=0)
    table_memory_gb: float | None = Field(
        None,
        gt=0,
        description="GiB of sparse-table rows one actor of this type may hold (default: from node_memory_gb, "
        "see ClusterConfig.table_memory_gb)",
    )
    node_memory_gb: float | None = Field(
        None,
        gt=0,
        description="GiB of memory of the node one actor of this type runs on, a node per actor (default: "
        "this machine's memory, shared by the actors of every type without a node_memory_gb)",
    )
    gpu_memory_gb: float | None = Field(
        None,
        gt=0,
        description="cuda types: GiB of GPU memory for sparse-table rows in one actor of this type (the GPU "
        "tier, DESIGN.md 'Table tiers'; default: as profiled, else measured by the actor: its device's "
        "free memory less a reserve)",
    )
    omp_wait_policy: Literal["auto", "passive", "active"] = Field(
        "auto",
        description="how torch's OpenMP threads wait between parallel regions: passive sleeps (where actors "
        "share cores, a spinning thread takes a neighbour's core), active spins (least latency on cores "
        "of its own), auto: the job chooses (JobConfig.spin_wait)",
    )

    @field_validator("ray_resources")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        for key, amount in v.items():
            if amount < 0:
                raise ValueError(f"resource amounts must be >= 0 (got {key}: {amount})")
        return v

    @field_validator("num_gpus")
    @classmethod
    def _cuda_asks_for_gpus(cls, v: float, info: ValidationInfo) -> float:
        if info.data.get("device") == "cuda" and v <= 0:
            raise ValueError("num_gpus > 0 for a type whose device is cuda (its actors must ask Ray for a GPU)")
        return v

    @field_validator("gpu_memory_gb")
    @classmethod
    def _gpu_memory_on_cuda(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and info.data.get("device") != "cuda":
            raise ValueError("gpu_memory_gb is for a type whose device is cuda (it holds table rows in GPU memory)")
        return v

    @property
    def wait_policy(self) -> Literal["passive", "active"]:
        """The OpenMP wait policy its actors get: "auto" left unresolved (a cluster without a job) sleeps."""
        return "active" if self.omp_wait_policy == "active" else "passive"

    def actor_options(self) -> dict[str, Any]:
        """The `ray.remote(...).options(**opts)` that pin an actor to this type; a ConfigError naming the
        type's field where Ray refuses them (3 TPUs, say: Ray takes 1, 2, 4 or 8 a task), so that an
        actor of the type fails to start with the user's error, not Ray's traceback."""
        from heterps_ray.devices import actor_env

        resources = {k: v for k, v in self.ray_resources.items() if k not in ("CPU", "GPU")}
        resources[self.name] = 1.0
        spin = {"GOMP_SPINCOUNT": str(ACTIVE_SPIN_COUNT)} if self.wait_policy == "active" else {}
        options = {
            "num_cpus": self.ray_resources.get("CPU", 0.0),
            "num_gpus": self.num_gpus,
            "resources": resources,
            # merged with the job's runtime_env by Ray (env_vars add up)
            "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": self.wait_policy.upper(), **spin, **actor_env()}},
        }
        self._check_ray_accepts(options)
        return options

    def _check_ray_accepts(self, options: dict[str, Any]) -> None:
        """Ray's own check of actor options (``.options()`` validates them, without a running Ray), as a
        ConfigError: the rules are Ray's (resource precision, accelerator counts), so Ray applies them."""
        import ray

        try:
            ray.remote(_OptionsCheck).options(**options)
        except (TypeError, ValueError) as exc:
            field = "num_gpus" if "num_gpus" in str(exc) else "ray_resources"
            raise ConfigError(
                None,
                f"cluster.resource_types.{self.name}.{field}",
                f"amounts Ray accepts for one actor (Ray: {exc})",
                self.num_gpus if field == "num_gpus" else self.ray_resources,
            ) from None


class _OptionsCheck:
    """An actor class that is never started: Ray checks a type's actor options against it."""


class PSConfig(BaseModel):
    model_config = _STRICT

    resource: str | None = Field(None, description="resource type of PS shards (default: the first)")
    min_shards: int = Field(1, ge=1)


class AutoscaleConfig(BaseModel):
    """An autoscaling Ray cluster (KubeRay, `ray up`): its worker groups, one per resource type, may
    start empty; `heterps run` asks Ray's autoscaler for the nodes its profile and its plan need
    (closedloop/autoscale.py) instead of requiring the types to be declared already."""

    model_config = _STRICT

    enabled: bool = Field(False, description="request the nodes from the cluster's autoscaler (--autoscale)")
    node_timeout_s: float = Field(
        300.0,
        gt=0,
        description="seconds to wait for requested nodes; a type not there by then is planned without "
        "(a cloud node boots in 1-3 min, a GPU node or a cold image pull takes longer)",
    )


class ClusterConfig(BaseModel):
    """The resource types a job may use. On an embedded local Ray, each type is declared as a custom
    resource with `max_instances` units, so actors really are admitted per type."""

    model_config = _STRICT

    name: str
    resource_types: list[ResourceType] = Field(min_length=1)
    ps: PSConfig = PSConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()

    @model_validator(mode="after")
    def _check_names(self) -> ClusterConfig:
        names = [t.name for t in self.resource_types]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"resource type names must be unique (repeated: {dupes})")
        if self.ps.resource is not None and self.ps.resource not in names:
            raise ValueError(f"ps.resource {self.ps.resource!r} is not a resource type (known: {names})")
        for i, t in enumerate(self.resource_types):
            if t.node_memory_gb is None:
                continue
            if t.table_memory_gb is not None and t.table_memory_gb > t.node_memory_gb:
                raise ConfigError(
                    None,
                    f"resource_types.{i}.table_memory_gb",
                    f"at most its node_memory_gb ({t.node_memory_gb})",
                    t.table_memory_gb,
                )
            if t.table_memory_gb is None and self.table_memory_gb(t.name) <= 0:
                least = OBJECT_STORE_GB + DRIVER_GB + ACTOR_RESERVE_GB
                raise ConfigError(
                    None,
                    f"resource_types.{i}.node_memory_gb",
                    f"more than {least} GiB (the object store, the driver and one actor's own memory) to "
                    "leave memory for tables, or an explicit table_memory_gb",
                    t.node_memory_gb,
                )
        return self

    def table_memory_gb(self, name: str) -> float:
        """GiB of table rows one actor of type `name` may hold: its `table_memory_gb`, else its node's
        memory less the object store and the driver, split over the actors sharing the node (one on a
        node of its own, given by `node_memory_gb`; else this machine, shared by the `max_instances` of
        every type without a node_memory_gb), less each actor's own memory. Any placement within
        max_instances then keeps every node within its memory."""
        rtype = self.type(name)
        if rtype.table_memory_gb is not None:
            return rtype.table_memory_gb
        if rtype.node_memory_gb is not None:
            node, sharing = rtype.node_memory_gb, 1
        else:
            node = machine_memory_gb()
            sharing = sum(t.max_instances for t in self.resource_types if t.node_memory_gb is None)
        return max(0.0, (node - OBJECT_STORE_GB - DRIVER_GB) / sharing - ACTOR_RESERVE_GB)

    def type(self, name: str) -> ResourceType:
        for t in self.resource_types:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def ps_resource(self) -> str:
        return self.ps.resource or self.resource_types[0].name

    def local_resources(self) -> dict[str, float]:
        """Custom resources to declare on an embedded local Ray: `max_instances` of each type."""
        return {t.name: float(t.max_instances) for t in self.resource_types}


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
    # quality", scripts/bench_quality.py): a small initial accumulator lets fresh rows move at once.
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
        "kernels and waits for the device per batch, in the run summary's data_ops_per_batch (0: none)",
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


# ---------------------------------------------------------------------------------------------
# Loading


def read_text(path: str | Path, expected: str = "a readable YAML file", field: str = "<file>") -> str:
    """The text of a file a user names (a job, model, cluster, problem or plan): the one way they are read.

    A missing file, a directory, an unreadable file or one that is not UTF-8 text is a ConfigError naming
    the file, `field` (what named it: ``<file>`` for the file as a whole) and `expected`, never a traceback.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), field, expected, exc.strerror) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        got = f"byte 0x{data[exc.start]:02x} at offset {exc.start}: not UTF-8 text"
        raise ConfigError(str(path), field, f"{expected}, in UTF-8", got) from None


def writable(path: str | Path, field: str, *, directory: bool, source: str | Path | None = None) -> Path:
    """`path`, once it can be written as a directory (`directory`) or as a file: it is not an existing file
    where a directory goes (or the other way round), and no folder above it is a file.

    Called before any work starts, so a bad output path fails with nothing written or removed. The
    ConfigError names `source`, the config file whose `field` this is, or else (a command-line argument
    `field`) the path itself.
    """
    path = Path(path)
    got = None
    if path.exists() and path.is_dir() != directory:
        got = f"{path}, an existing {'file' if directory else 'directory'}"
    else:
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            got = f"{path}, under the file {parent}"
    if got is not None:
        kind = "a directory" if directory else "a file"
        raise ConfigError(str(source or path), field, f"a path where {kind} can be written", got)
    return path


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML (or JSON) mapping; a missing, binary or unparsable file is a ConfigError naming it."""
    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "<file>", f"valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "<file>", "a mapping at the top level", type(data).__name__)
    return data


def validate(model_cls: type[BaseModel], data: dict[str, Any], file: str | None) -> Any:
    """Validate `data` as `model_cls`, turning the first pydantic error into a ConfigError."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        expected = _expected(err)
        got = err.get("input") if err["type"] not in ("missing", "value_error") else None
        if isinstance(got, dict):
            got = None
        raise ConfigError(file, field, expected, got) from None
    except ConfigError as exc:  # raised by a model validator, which knows the field but not the file
        if exc.file is None and file is not None:
            raise ConfigError(file, exc.field, exc.expected, exc.got) from None
        raise


def _expected(err: Any) -> str:
    kind = err["type"]
    if kind == "missing":
        return "a value (the field is required)"
    if kind == "extra_forbidden":
        return "no such field (unknown field; check its spelling)"
    if kind == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    return str(err["msg"]).lower()


def _resolve(base: Path, value: Any, loader: Any) -> Any:
    """A sub-config given as a path (relative to `base`) is loaded; a mapping is used inline."""
    if isinstance(value, str):
        path = (base / value).resolve()
        return loader(path)
    return value


def load_cluster(path: str | Path) -> ClusterConfig:
    return validate(ClusterConfig, read_yaml(path), str(path))


def load_model(path: str | Path) -> ModelConfig:
    return validate(ModelConfig, read_yaml(path), str(path))


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Load a job file; `model` and `cluster` may be inline mappings or paths to their own files.

    `overrides` (dotted keys, e.g. {"runtime.train_steps": 10}) are applied before validation.
    """
    path = Path(path)
    raw = read_yaml(path)
    base = path.resolve().parent
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    if "model" in raw:
        raw["model"] = _resolve(base, raw["model"], lambda p: load_model(p).model_dump())
    if "cluster" in raw:
        raw["cluster"] = _resolve(base, raw["cluster"], lambda p: load_cluster(p).model_dump())
    data = raw.get("data")
    if isinstance(data, dict) and isinstance(data.get("path"), str):
        data["path"] = _anchor(base, data["path"])
    if isinstance(raw.get("output_dir"), str):
        raw["output_dir"] = _anchor(base, raw["output_dir"])
    job: JobConfig = validate(JobConfig, raw, str(path))
    writable(job.output_dir, "output_dir", directory=True, source=path)
    return job


def _anchor(base: Path, value: str) -> str:
    """Paths in a job are relative to the job file, except `$PWD/...`-style absolute ones."""
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
