"""The scheduling problem (DESIGN.md §2 and §4): a chain of layers, resource types, a floor.

Loaded from YAML or JSON and validated; every mistake is a ConfigError naming the file, the
field and what was expected.

Example::

    problem = load_problem("configs/problems/ctr_dnn_cloud.yaml")
    problem.type_names        # ["cpu", "t4", "v100", "a100"]
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from heterps_ray.config import read_yaml, validate
from heterps_ray.errors import ConfigError
from heterps_ray.ps.atomic import write_bytes_atomic

_STRICT = ConfigDict(extra="forbid", frozen=True)
_NAME = r"^[A-Za-z][A-Za-z0-9_\-]*$"


class Resource(BaseModel):
    """One resource type: its price, how many instances exist, and its network."""

    model_config = _STRICT

    name: str = Field(pattern=_NAME)
    price_per_hour: float = Field(ge=0, description="$ per instance-hour")
    max_instances: int = Field(ge=1, description="most instances of this type at once")
    bandwidth_gbps: float = Field(gt=0, description="activation traffic, Gbit/s")
    io_bandwidth_gbps: float | None = Field(
        None, gt=0, description="input reads, Gbit/s (default: bandwidth)"
    )
    latency_ms: float = Field(0.0, ge=0, description="per message, ms")
    device: str | None = Field(None, description="informational: cpu or cuda")
    threads: int | None = Field(
        None, ge=1, description="cores a busy actor of this type keeps busy (torch threads; default 1)"
    )
    call_overhead_ms: float = Field(
        0.0,
        ge=0,
        description="an actor's own time per call it receives besides its layers (Ray deserialising the "
        "arguments, storing the result), ms",
    )
    fused_saving_ms: float = Field(
        0.0,
        ge=0,
        description="per layer after a stage's first: the fixed time a layer alone pays (its own autograd "
        "pass and optimizer step) that a stage of several layers pays once, ms",
    )

    @property
    def io_gbps(self) -> float:
        return self.io_bandwidth_gbps if self.io_bandwidth_gbps is not None else self.bandwidth_gbps


class PSTable(BaseModel):
    """The sparse table's memory (costmodel/table_memory.py): what the profile's job expects it to hold
    and the PS shards that hold it. The planner uses at least `shards_needed` shards; a table needing
    more shards than the PS type has instances is refused at planning (exit 3)."""

    model_config = _STRICT

    rows: int = Field(ge=0, description="expected rows (from _meta.json's key counts per slot)")
    bytes_per_row: float = Field(gt=0, description="memory of one row in the row store, index included")
    budget_gb: dict[str, float] = Field(description="per resource type: GiB of table rows one actor may hold")
    shards_needed: int = Field(ge=1, description="PS shards on the PS type that hold the table")
    shard_cap_gb: float | None = Field(None, gt=0, description="the job's table.max_shard_mb, GiB")
    waiting: int = Field(0, ge=0, description="keys expected to wait for admission (seen, not admitted)")
    bytes_per_waiting: float = Field(0.0, ge=0, description="memory of one waiting key, its index included")
    gpu_rows: dict[str, int] = Field(
        default_factory=dict,
        description="per cuda type: rows its GPU memory holds for the table (its gpu_memory_gb, or as "
        "profiled: the device's free memory less a reserve)",
    )
    gpu_hit_rate: dict[str, float] = Field(
        default_factory=dict,
        description="per cuda type: the share of the run's key lookups its GPU memory serves at gpu_rows "
        "(where every row fits, all but each row's first; less for a cache, from the data's key popularity; "
        "absent: 1)",
    )
    disk_gb: float | None = Field(
        None,
        gt=0,
        description="the PS type's disk_gb where the table goes to disk (its memory cannot hold it)",
    )
    disk_rows: int = Field(0, ge=0, description="expected rows on the PS shards' disks, all shards together")
    ram_hit_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description="with disk_rows: the share of key lookups the shards' RAM serves (from the data's key "
        "popularity)",
    )
    notes: str | None = None


class PSTier(BaseModel):
    """The parameter-server tier, priced and rate-limited like one more stage."""

    model_config = _STRICT

    resource: str | None = Field(None, description="resource type of the shards (default: the first)")
    rows_per_second_per_shard: float | None = Field(None, gt=0, description="sparse rows/s one shard serves")
    min_shards: int = Field(1, ge=1, description="fewest shards (table memory may ask more)")
    table: PSTable | None = Field(None, description="the table's memory and the shards that hold it")
    pull_share: float | None = Field(
        None, ge=0, le=1, description="simulator: the pull's share of a row's service time (default 0.5)"
    )
    push_client_share: float | None = Field(
        None, ge=0, le=1, description="simulator: the share of a push the DataWorker does itself (default 0)"
    )
    dense_ms_per_param: float | None = Field(
        None, ge=0, description="simulator: ms of an async dense push per parameter (default 0)"
    )


class Host(BaseModel):
    """Machines whose cores the actors of several resource types share (the local cluster: every
    type on one machine). Busy actors there share `cores` in proportion to their threads (simulator
    only; the analytic model of DESIGN.md §3 treats types as separate machines)."""

    model_config = _STRICT

    name: str = Field(pattern=_NAME)
    cores: float = Field(gt=0, description="CPU cores of the machine")
    types: tuple[str, ...] = Field(min_length=1, description="resource types whose actors run on it")
    background_cores: float = Field(
        0.0, ge=0, description="cores taken all the time by other processes (Ray's own daemons)"
    )
    call_cpu_ms: float | None = Field(
        None,
        ge=0,
        description="CPU ms Ray's own processes (raylet, object store) spend on it per actor call "
        "(default: the latency of the callee's type, both ends)",
    )


class RuntimeTerms(BaseModel):
    """How the runtime executes a plan (DESIGN.md §3b): the terms the base model leaves out. A problem
    with this section is priced as the runtime runs it; without it, exactly as the base model of §3.
    `heterps profile` fills it from the job and from measurements of the runtime's own actors."""

    model_config = _STRICT

    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: each DataWorker trains one batch at a time (replicas add nothing)"
    )
    micro_batches: int = Field(
        1, ge=1, description="micro-batches per batch (the job's runtime.micro_batches)"
    )
    max_in_flight: int = Field(4, ge=1, description="micro-batches a DataWorker keeps in flight")
    batches_ahead: int = Field(0, ge=0, description="async: batches a DataWorker overlaps beyond the first")
    ps_hosting: Literal["auto", "actors"] = Field(
        "auto", description="auto: one DataWorker and no replicated stage host the shards in-process"
    )
    call_ms: dict[str, float] = Field(
        default_factory=dict,
        description="per resource type: wall ms of one call's round trip to a stage actor of that type "
        "beyond its layers and the bytes it carries (Ray, (de)serialising, the actor's bookkeeping); "
        "absent type: 2 x its latency_ms",
    )
    ps_wait_ms_per_row: float = Field(
        0.0,
        ge=0,
        description="ms a DataWorker waits per sparse row of a batch (pull + its part of the "
        "push) when the shards are actors",
    )
    spread: dict[str, float] = Field(
        default_factory=dict,
        description="per resource type: the profile's own spread, half the range of its one-stage "
        "probe's runs over their median (a plan's throughput is good to about this fraction)",
    )
    startup_ms: float = Field(0.0, ge=0, description="simulator: a DataWorker's one-time start-up, ms")
    forward_fraction: float | None = Field(
        None, gt=0, lt=1, description="simulator: the forward pass's share of a layer's time (default 1/3)"
    )
    ps_hosted_ms_per_row: float = Field(
        0.0,
        ge=0,
        description="the same when the shards live in the DataWorker's process (the profiler leaves it "
        "at 0: its one-stage probes calibrate the layer times with the hosted shards' work in them)",
    )
    gpu_table: Literal["auto", "off"] = Field(
        "auto",
        description="auto: a plan that hosts its shards in one DataWorker on a type of gpu_table_ms_per_row "
        "keeps the rows in that GPU's memory (DESIGN.md 'Table tiers'); off: on the shards",
    )
    gpu_table_ms_per_row: dict[str, float] = Field(
        default_factory=dict,
        description="per cuda type: ms a DataWorker spends per sparse row of a batch with the rows in its "
        "GPU memory (the keys' lookup, the gather and the update on the device)",
    )
    gpu_miss_ms_per_row: dict[str, float] = Field(
        default_factory=dict,
        description="per cuda type: ms per row its GPU memory does not hold (fetched from the shards, "
        "written back when it leaves)",
    )
    disk_ms_per_row: float = Field(
        0.0,
        ge=0,
        description="ms a DataWorker waits per sparse row of a batch that the PS shards' RAM does not hold "
        "(ps.table.disk_rows): the row read back from the PS type's disk with the file out of the page "
        "cache, and one row written out in its place; the profile measures it on the type's disk_dir "
        "(0: not measured, such a row priced as one in RAM)",
    )

    @property
    def in_flight(self) -> int:
        """Micro-batches one DataWorker overlaps: sync fills one batch; async up to batches_ahead more."""
        window = self.micro_batches * (1 + (self.batches_ahead if self.mode == "async" else 0))
        return min(self.max_in_flight, window)


class LayerTime(BaseModel):
    """c(l, t) = fixed + per_sample * B, in ms for one replica (forward + backward)."""

    model_config = _STRICT

    fixed: float = Field(ge=0, description="ms per batch")
    per_sample: float = Field(ge=0, description="ms per sample")


class Layer(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1)
    out_bytes_per_sample: float = Field(ge=0, description="activation bytes per sample it sends on")
    sparse_rows_per_sample: float = Field(0.0, ge=0, description="PS rows pulled per sample")
    parallel_fraction: float = Field(1.0, ge=0, le=1, description="Amdahl alpha of its replicas")
    dense_params: int | None = Field(None, ge=0, description="simulator: its dense parameters (async pushes)")
    time_ms: dict[str, LayerTime] = Field(min_length=1, description="per resource type; absent = cannot run")


class Problem(BaseModel):
    """Planner input (DESIGN.md §4). Build with :func:`load_problem` or :func:`problem_from_dict`."""

    model_config = _STRICT

    name: str
    batch_size: int = Field(ge=1)
    samples: float = Field(gt=0, description="samples to train, for the monetary cost")
    throughput_min: float = Field(ge=0, description="floor, samples/s")
    input_bytes_per_sample: float = Field(0.0, ge=0)
    resources: tuple[Resource, ...] = Field(min_length=1)
    ps: PSTier = Field(default_factory=lambda: PSTier.model_validate({}))
    layers: tuple[Layer, ...] = Field(min_length=1)
    hosts: tuple[Host, ...] | None = Field(
        None, description="shared machines (absent: every actor has its own cores)"
    )
    runtime: RuntimeTerms | None = Field(
        None, description="how the runtime executes plans (DESIGN.md §3b; absent: the base model)"
    )
    notes: str | None = None

    @model_validator(mode="after")
    def _check_references(self, info: ValidationInfo) -> Problem:
        file = (info.context or {}).get("file") if info is not None else None
        names = [r.name for r in self.resources]
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise ConfigError(
                    file, f"resources.{i}.name", f"a unique resource name (known: {names})", name
                )
        if self.ps.resource is not None and self.ps.resource not in names:
            raise ConfigError(file, "ps.resource", f"one of the resource types {names}", self.ps.resource)
        ps_cap = self.resource(self.ps_resource).max_instances
        if self.ps.min_shards > ps_cap:
            raise ConfigError(
                file,
                "ps.min_shards",
                f"at most max_instances of {self.ps_resource!r} ({ps_cap})",
                self.ps.min_shards,
            )
        layer_names = [layer.name for layer in self.layers]
        for i, layer in enumerate(self.layers):
            if layer_names.index(layer.name) != i:
                raise ConfigError(file, f"layers.{i}.name", "a unique layer name", layer.name)
            for type_name in layer.time_ms:
                if type_name not in names:
                    raise ConfigError(
                        file, f"layers.{i}.time_ms.{type_name}", f"a resource type, one of {names}", type_name
                    )
        seen: dict[str, str] = {}
        for i, host in enumerate(self.hosts or ()):
            if host.background_cores >= host.cores:
                raise ConfigError(
                    file,
                    f"hosts.{i}.background_cores",
                    f"fewer than its cores ({host.cores})",
                    host.background_cores,
                )
            for type_name in host.types:
                if type_name not in names:
                    raise ConfigError(file, f"hosts.{i}.types", f"resource types, of {names}", type_name)
                if type_name in seen:
                    raise ConfigError(
                        file,
                        f"hosts.{i}.types",
                        f"each type on one host (also on {seen[type_name]!r})",
                        type_name,
                    )
                seen[type_name] = host.name
        if self.runtime is not None:
            for field in ("call_ms", "gpu_table_ms_per_row", "gpu_miss_ms_per_row"):
                for type_name in getattr(self.runtime, field):
                    if type_name not in names:
                        raise ConfigError(file, f"runtime.{field}", f"resource types, of {names}", type_name)
            if self.runtime.mode == "sync" and self.runtime.batches_ahead:
                raise ConfigError(
                    file,
                    "runtime.batches_ahead",
                    "0 in sync mode (async overlaps batches)",
                    self.runtime.batches_ahead,
                )
            if self.batch_size % self.runtime.micro_batches:
                raise ConfigError(
                    file,
                    "runtime.micro_batches",
                    f"a divisor of batch_size ({self.batch_size})",
                    self.runtime.micro_batches,
                )
        return self

    # -- lookups -------------------------------------------------------------------------------

    @property
    def type_names(self) -> list[str]:
        return [r.name for r in self.resources]

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_types(self) -> int:
        return len(self.resources)

    @property
    def ps_resource(self) -> str:
        return self.ps.resource or self.resources[0].name

    @property
    def ps_min_shards(self) -> int:
        """The fewest shards a plan may use: ps.min_shards, or more where the table's memory needs them."""
        needed = self.ps.table.shards_needed if self.ps.table is not None else 1
        return max(self.ps.min_shards, needed)

    @property
    def ps_rows_per_second(self) -> float:
        """Rows/s per shard; unlimited (inf) when the file gives none."""
        rate = self.ps.rows_per_second_per_shard
        return math.inf if rate is None else rate

    def host_of(self, type_name: str) -> Host | None:
        """The shared machine a type's actors run on, or None (cores of their own)."""
        for host in self.hosts or ():
            if type_name in host.types:
                return host
        return None

    def resource(self, name: str) -> Resource:
        for r in self.resources:
            if r.name == name:
                return r
        raise KeyError(name)

    def type_index(self, name: str) -> int:
        return self.type_names.index(name)

    def can_run(self, layer: int, type_name: str) -> bool:
        return type_name in self.layers[layer].time_ms

    def types_running_all_layers(self) -> list[str]:
        """Types that can run every layer: the candidates for a single-type plan."""
        return [t for t in self.type_names if all(t in layer.time_ms for layer in self.layers)]

    # -- output --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    def save(self, path: str | Path) -> Path:
        """Write as YAML (or JSON when the name ends in .json)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        if path.suffix == ".json":
            import json

            return write_bytes_atomic(path, (json.dumps(data, indent=2) + "\n").encode())
        return write_bytes_atomic(path, yaml.safe_dump(data, sort_keys=False, width=120).encode())


def problem_from_dict(data: dict[str, Any], file: str | None = None) -> Problem:
    """Validate a problem mapping; a mistake is a ConfigError naming `file` and the field."""
    try:
        return validate(Problem, data, file)
    except ConfigError as exc:
        if exc.file is None and file is not None:  # raised inside the model validator
            raise ConfigError(file, exc.field, exc.expected, exc.got) from None
        raise


def load_problem(path: str | Path) -> Problem:
    """Load a problem file (YAML or JSON)."""
    return problem_from_dict(read_yaml(path), str(path))


def as_executed(problem: Problem, **execution: Any) -> Problem:
    """`problem` with its runtime section's execution fields (mode, micro_batches, max_in_flight,
    batches_ahead, ps_hosting) set, keeping its measured terms; a problem without the section gets
    one with these fields and no measured terms."""
    data = problem.to_dict()
    data["runtime"] = {**data.get("runtime", {}), **execution}
    if data["runtime"].get("mode") == "sync":
        data["runtime"]["batches_ahead"] = 0
    return problem_from_dict(data)


def one_replica_per_stage(problem: Problem) -> Problem:
    """`problem` as sync mode runs it, one replica per stage (DESIGN.md §1): extra replicas of a stage
    add no throughput (parallel fraction 0), so the cheapest plan never asks for them."""
    data = problem.to_dict()
    for layer in data["layers"]:
        layer["parallel_fraction"] = 0.0
    return problem_from_dict(data)
