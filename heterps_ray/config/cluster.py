"""The cluster's config: the resource types a job may use, its PS and autoscaling settings, and the
memory a node keeps besides its actors' tables."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

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
    disk_gb: float | None = Field(
        None,
        gt=0,
        description="GiB of sparse-table rows one actor of this type may keep on its node's local disk, "
        "under disk_dir (the disk tier, DESIGN.md 'Table tiers'; the planner puts a table there when the "
        "PS type's memory cannot hold it; default: no disk)",
    )
    disk_dir: str | None = Field(
        None,
        description="with disk_gb: an absolute path on each node of this type, on its local disk, where PS "
        "shards keep their rows beyond their table memory (each job in a folder of its own)",
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


def _check_disk(rtype: ResourceType, index: int) -> None:
    """A type's local disk is declared whole (disk_gb and disk_dir, or neither), at an absolute path."""
    field = f"resource_types.{index}"
    if rtype.disk_gb is not None and not rtype.disk_dir:
        raise ConfigError(
            None, f"{field}.disk_dir", "an absolute path on the type's local disk with disk_gb", rtype.disk_dir
        )
    if rtype.disk_dir is not None and rtype.disk_gb is None:
        raise ConfigError(
            None, f"{field}.disk_gb", "GiB of rows one actor may keep on disk with disk_dir", None
        )
    if rtype.disk_dir is not None and not rtype.disk_dir.startswith("/"):
        raise ConfigError(
            None, f"{field}.disk_dir", "an absolute path (each node's own local disk)", rtype.disk_dir
        )


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
            _check_disk(t, i)
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
