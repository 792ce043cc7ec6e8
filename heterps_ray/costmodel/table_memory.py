"""The memory a job's sparse table needs and the PS shards that hold it (DESIGN.md §4, "Table memory").

The table's expected rows come from the dataset's ``_meta.json`` (data/writer.py), each slot capped by
what the job can create: ``train_steps`` × ``batch_size`` values when the job stops early, ``ttl_batches``
× ``batch_size`` live rows when rows expire.

* Without admission (``admit_after: 1``) every distinct value of a slot (``distinct_values``, train and
  eval) is a row.
* With admission (the default, ``admit_after: 2``) a key gets a row at the ``admit_after``-th pull call
  that shows it, a pull call being a batch: a key in k train rows is pulled in about k × epochs calls
  (fewer where two of its rows share a batch), so the rows are the keys seen in at least
  ceil(admit_after / epochs) train rows (``train_keys_at_least``), and the other keys seen wait for
  admission, each a candidate of 16 B and its index slot. On the quickstart data that is 37,877 rows
  and 8,655 waiting keys against the 37,845 and 8,687 a real table held (the distinct values, 47,443,
  overstated the rows by 25%); on 400k Criteo-shaped rows 279,849 rows against 279,661 (5.7x fewer
  than the 1.58M distinct values). A dataset written before that field keeps the upper bound of every
  distinct value as a row, with a note.

A row costs :func:`~heterps_ray.ps.row_bytes.stored_bytes_per_row`: its payload (key, weights, Adagrad state,
counters when admission, TTL or a cap is on) and the index at its sparsest (149.3 B/row at dim 16
untracked, measured: BENCHMARKS.md "Table memory").

Each resource type has a budget: the table memory one of its actors may hold
(:meth:`~heterps_ray.config.ClusterConfig.table_memory_gb`). PS shard actors on the PS type split the
table evenly (keys are hashed to shards), so ``shards_needed`` = ceil(table bytes / PS type budget);
shards hosted in a DataWorker's process hold the whole table on one actor of stage 0's type.

Example::

    estimate = estimate_table(job)          # TableEstimate(rows=..., bytes_per_row=149.3, ...)
    shards_needed(estimate.total_bytes, 3.0 * 2**30)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from heterps_ray.config import JobConfig
from heterps_ray.costmodel.hit_rates import gpu_hit_rate
from heterps_ray.costmodel.problem import PSTable
from heterps_ray.costmodel.table_disk import DiskPlan, disk_figure, disk_option, disk_plan
from heterps_ray.errors import ConfigError, DataError, InfeasibleError
from heterps_ray.ps.row_bytes import CANDIDATE_BYTES, INDEX_BYTES, device_rows_within, stored_bytes_per_row
from heterps_ray.ps.spec import sparse_spec

GIB = 2**30
NO_SHARD_COUNT = 2**31 - 1  # shards_needed where an actor has no table memory: more than any type has
# A key waiting for admission: its candidate entry (key, count, last seen) and its slot in the candidates'
# index at its sparsest (heterps_ray.ps.table, as max_rows_for counts it).
BYTES_PER_WAITING = CANDIDATE_BYTES + INDEX_BYTES


@dataclass(frozen=True)
class TableEstimate:
    """The expected rows of a job's table, the bytes of each, and how the figure was reached."""

    rows: int
    bytes_per_row: float
    shard_cap_bytes: float  # the job's table.max_shard_mb: what one shard holds at most (inf: no cap)
    notes: tuple[str, ...] = ()
    waiting: int = 0  # keys seen but not admitted (admission): a candidate each, no row
    bytes_per_waiting: float = 0.0
    disk: DiskPlan | None = None  # the PS type's memory cannot hold it: hot rows in RAM, the rest on disk
    # RAM holds it, on more shards than the PS type's disk would need: the planner weighs the two
    disk_option: DiskPlan | None = None

    def on_disk(self) -> TableEstimate:
        """This table with its disk option taken (its shards then keep their cold rows on disk)."""
        return replace(self, disk=self.disk_option, disk_option=None) if self.disk_option else self

    @property
    def total_bytes(self) -> float:
        return self.rows * self.bytes_per_row + self.waiting * self.bytes_per_waiting

    def shards_within(self, budget_bytes: float) -> int:
        """The PS shards that hold it, each with `budget_bytes` of table memory (and its disk, if there)."""
        if self.disk is not None:
            return self.disk.shards
        return shards_needed(self.total_bytes, budget_bytes, self.shard_cap_bytes)

    def figure(self) -> str:
        """'R expected rows x B B/row (+ W keys waiting for admission x b B) = X GiB', for messages."""
        return table_figure(self.rows, self.bytes_per_row, self.waiting, self.bytes_per_waiting)


def table_figure(rows: int, bytes_per_row: float, waiting: int = 0, bytes_per_waiting: float = 0.0) -> str:
    """A table's memory as the messages show it: rows, keys waiting for admission, and their GiB."""
    total = (rows * bytes_per_row + waiting * bytes_per_waiting) / GIB
    wait = f" + {waiting:,} keys waiting for admission x {bytes_per_waiting:.1f} B" if waiting else ""
    return f"{rows:,} expected rows x {bytes_per_row:.1f} B/row{wait} = {total:,.1f} GiB"


def gib(value: float) -> str:
    """GiB as the messages show them: two decimals, or two significant digits below 0.01 (a test
    cluster's budget of 0.0005 GiB does not read 0.00)."""
    return f"{value:,.2f}" if value >= 0.01 else f"{value:.2g}"


def expected_rows(meta: dict[str, Any], job: JobConfig, meta_file: str) -> tuple[int, int, list[str]]:
    """The rows `job`'s table is expected to reach on the dataset described by `meta` (its
    ``_meta.json``), the keys left waiting for admission, and notes on how they were counted. A
    DataError when `meta` counts no distinct values."""
    distinct = meta.get("distinct_values")
    if not isinstance(distinct, dict) or not distinct:
        raise DataError(
            f"{meta_file}: no distinct_values per slot (the table's expected rows); rewrite the dataset "
            "with `heterps data convert` or `heterps data synth`"
        )
    for slot, count in distinct.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise DataError(f"{meta_file}: distinct_values.{slot} must be a count (got {count!r})")
    caps: list[tuple[int, str]] = []
    if job.runtime.train_steps is not None:
        caps.append((job.runtime.train_steps * job.batch_size, "runtime.train_steps x batch_size"))
    if job.table.ttl_batches:
        caps.append((job.table.ttl_batches * job.batch_size, "table.ttl_batches x batch_size"))
    cap, why = min(caps) if caps else (math.inf, "")
    seen = _keys_at_least(meta, meta_file) if job.table.admit_after > 1 else None
    admission = ""
    if seen is None:  # no admission, or a dataset that does not say how often its keys occur
        per_slot = {slot: (count, 0) for slot, count in distinct.items()}
        if job.table.admit_after > 1:
            admission = (
                "admission's share not estimated (_meta.json has no per-key counts: rewrite the dataset to "
                "get them): every distinct value counted"
            )
    else:
        # A key in k train rows is pulled in about k x epochs calls: a row from ceil(admit_after / epochs)
        # rows on. The keys waiting are the most at once, at the end of the first epoch (those in fewer
        # than admit_after rows): the candidates' store keeps the memory they took after they are admitted.
        times = math.ceil(job.table.admit_after / job.runtime.epochs)
        counted = min(len(c) for c in seen.values())  # the counts go up to n = counted (8)
        known, once = min(times, counted), min(job.table.admit_after, counted)
        per_slot = {slot: (c[known - 1], c[0] - c[once - 1]) for slot, c in seen.items()}
        admission = (
            f"admission after {job.table.admit_after} pulls: keys in at least {times} train rows get rows, the "
            "others seen wait" + ("" if known == times else f" (counted at {known} rows: an upper bound)")
        )
    rows = waiting = 0
    for admitted, left in per_slot.values():
        rows += int(min(admitted, cap))
        waiting += int(min(left, max(cap - admitted, 0)))
    notes = []
    if caps and rows + waiting < sum(a + w for a, w in per_slot.values()):
        notes.append(f"each slot capped at {cap:,} values ({why})")
    if admission:
        notes.append(admission)
    return rows, waiting, notes


def _keys_at_least(meta: dict[str, Any], meta_file: str) -> dict[str, list[int]] | None:
    """``train_keys_at_least`` of `meta` (per slot, keys in at least 1, 2, ... train rows), checked; None
    for a dataset written before it."""
    seen = meta.get("train_keys_at_least")
    if seen is None:
        return None
    if not isinstance(seen, dict) or not seen:
        raise DataError(f"{meta_file}: train_keys_at_least must map each slot to its counts (got {seen!r})")
    for slot, counts in seen.items():
        if (
            not isinstance(counts, list)
            or not counts
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts)
            or any(a < b for a, b in zip(counts, counts[1:], strict=False))
        ):
            raise DataError(
                f"{meta_file}: train_keys_at_least.{slot} must be non-increasing counts (got {counts!r})"
            )
    return seen


def estimate_table(job: JobConfig, dim: int | None = None) -> TableEstimate | None:
    """The table estimate of `job` from its dataset's ``_meta.json``; None when the data path holds no
    dataset yet (``heterps run`` generates one from ``data.synth_rows``). `dim`: the model's
    embedding_dim (default: built from the job's model)."""
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.data.layout import is_dataset

    if not is_dataset(job.data.path):
        return None
    if dim is None:
        from heterps_ray.models import build_model

        dim = build_model(job.model).embedding_dim
    dataset = Dataset(job.data.path)
    rows, waiting, notes = expected_rows(dataset.meta, job, str(dataset.path / "_meta.json"))
    spec = sparse_spec(job, dim, init_scale=0.0)
    tracked = spec.admit_after > 1 or spec.ttl > 0 or spec.max_rows > 0
    cap = job.table.max_shard_mb * 2**20 if job.table.max_shard_mb else math.inf
    if job.table.max_shard_mb:
        notes.append(f"each shard capped at table.max_shard_mb = {job.table.max_shard_mb:g} MiB")
    estimate = TableEstimate(
        rows,
        stored_bytes_per_row(dim, spec.optimizer, tracked),
        cap,
        tuple(notes),
        waiting,
        BYTES_PER_WAITING if waiting else 0.0,
    )
    return replace(
        estimate,
        disk=disk_plan(job, estimate, dim, spec.optimizer),
        disk_option=disk_option(job, estimate, dim, spec.optimizer),
    )


def shards_needed(table_bytes: float, budget_bytes: float, shard_cap_bytes: float = math.inf) -> int:
    """The fewest shards, each on an actor with `budget_bytes` for table rows, that hold a table of
    `table_bytes` (each shard holds at most `shard_cap_bytes`: a capped table evicts rather than grow)."""
    if min(table_bytes, shard_cap_bytes) <= budget_bytes:
        return 1
    if budget_bytes <= 0:  # a type left no table memory (its node's memory is all reserved)
        return NO_SHARD_COUNT
    return math.ceil(table_bytes / budget_bytes)


def budgets_gb(job: JobConfig) -> dict[str, float]:
    """Each resource type's table budget, GiB per actor, to 4 significant digits (the problem file's;
    the shards a table needs are counted from the exact budget)."""
    return {t.name: float(f"{job.cluster.table_memory_gb(t.name):.4g}") for t in job.cluster.resource_types}


def table_section(job: JobConfig, estimate: TableEstimate) -> dict[str, Any]:
    """The problem's ``ps.table`` section for `job`'s table `estimate`: rows, bytes_per_row, budget_gb
    per type, shards_needed on the PS type (and shard_cap_gb, notes)."""
    budget = job.cluster.table_memory_gb(job.cluster.ps_resource) * GIB  # as the run's checks count it
    section: dict[str, Any] = {
        "rows": estimate.rows,
        "bytes_per_row": round(estimate.bytes_per_row, 2),
        "budget_gb": budgets_gb(job),
        "shards_needed": estimate.shards_within(budget),
    }
    if estimate.disk is not None:
        section.update(estimate.disk.section())
    if estimate.waiting:
        section["waiting"] = estimate.waiting
        section["bytes_per_waiting"] = round(estimate.bytes_per_waiting, 2)
    if not math.isinf(estimate.shard_cap_bytes):
        section["shard_cap_gb"] = estimate.shard_cap_bytes / GIB
    if estimate.notes:
        section["notes"] = "; ".join(estimate.notes)
    return section


def with_table(
    data: dict[str, Any],
    job: JobConfig,
    dim: int | None = None,
    gpu_rows: dict[str, int] | None = None,
    estimate: TableEstimate | None = None,
) -> dict[str, Any]:
    """A problem mapping given `job`'s table: ``ps.table`` (so the planner uses at least its
    shards_needed, and prices the GPU tier of each cuda type: the rows its memory holds, `gpu_rows` as
    the profile measured them where the type names no gpu_memory_gb, else those the mapping had, and
    the share of lookups it serves), and ``runtime.ps_hosting: actors`` when some type that can run the
    first layer cannot hold the whole table in its DataWorker (hosted shards would not fit there).
    Unchanged when the job's dataset does not exist yet. `estimate`: the run's table estimate (None:
    estimated here)."""
    if estimate is None:
        estimate = estimate_table(job, dim)
    if estimate is None:
        return data
    before = (data.get("ps") or {}).get("table") or {}
    section = table_section(job, estimate)
    dim = dim if dim is not None else _embedding_dim(job)
    held = gpu_rows_of(job, dim, {**before.get("gpu_rows", {}), **(gpu_rows or {})})
    if held:
        section["gpu_rows"] = held
        lookups = job.samples * sum(
            float(layer.get("sparse_rows_per_sample", 0.0)) for layer in data["layers"]
        )
        section["gpu_hit_rate"] = {
            name: gpu_hit_rate(job, rows, estimate.rows, lookups) for name, rows in held.items()
        }
    data.setdefault("ps", {})["table"] = section
    runtime = data.get("runtime")
    if runtime is not None and runtime.get("ps_hosting", "auto") == "auto":
        first = [t for t in data["layers"][0]["time_ms"] if t in data["ps"]["table"]["budget_gb"]]
        shards = max(data["ps"].get("min_shards", 1), data["ps"]["table"]["shards_needed"])
        if not all(hosted_fits(job, t, shards, estimate) for t in first):
            runtime["ps_hosting"] = "actors"
    return data


def figures(table: PSTable, ps_type: str, cap: int, disk: str = "") -> str:
    """The figures of a table that no plan (or a given plan) can hold, for the refusal's message (`disk`:
    why the PS type's disk cannot hold it either, from its DiskPlan; else from the table's own fields)."""
    budgets = ", ".join(f"{name} {gib(gb)} GiB" for name, gb in table.budget_gb.items())
    figure = table_figure(table.rows, table.bytes_per_row, table.waiting, table.bytes_per_waiting)
    line = (
        f"the sparse table's {figure} need {table.shards_needed:,} PS shards on {ps_type!r} (table budget "
        f"per actor: {budgets}; {ps_type!r} has max_instances {cap})"
    )
    if disk or table.disk_gb is not None:
        line += f"; {disk or disk_figure(table)}"
    if table.notes:
        line += f"; {table.notes}"
    return line


def disk_line(table: PSTable, ps_type: str) -> str:
    """Where a table that went to the PS type's disk lives, for `heterps plan`: its rows in the shards'
    RAM and on their disks, and the share of lookups RAM serves (at its ``shards_needed``)."""
    return (
        f"table: {table.rows - table.disk_rows:,} rows in the RAM of {table.shards_needed:,} PS shard(s) on "
        f"{ps_type!r}, {table.disk_rows:,} on their disks (disk_gb {table.disk_gb or 0:,g} GiB each), "
        f"~{table.ram_hit_rate:.1%} of lookups served from RAM (estimated)"
    )


def check_table_fits(problem: Any, file: str) -> None:
    """Refuse (InfeasibleError, exit 3) a problem whose table needs more PS shards than its PS type has
    instances: no plan can hold it. Called before any scheduler runs."""
    if problem.ps.table is not None:
        _refuse_unholdable(
            problem.ps.table, problem.ps_resource, problem.resource(problem.ps_resource).max_instances, file
        )


def check_job_table(job: JobConfig, estimate: TableEstimate | None, file: str | None = None) -> None:
    """The same refusal for `job` on its cluster, from its table `estimate` (its dataset's
    ``_meta.json`` alone): ``heterps run`` calls it before Ray starts or anything is profiled (None: a
    dataset not written yet, checked later, on the problem)."""
    if estimate is not None:
        table = PSTable.model_validate(table_section(job, estimate))
        ps_type = job.cluster.ps_resource
        cap = job.cluster.type(ps_type).max_instances
        shortfall = estimate.disk.shortfall(cap) if estimate.disk is not None else ""
        _refuse_unholdable(table, ps_type, cap, file or f"job {job.name!r}", shortfall)


def _refuse_unholdable(table: PSTable, ps_type: str, cap: int, file: str, disk: str = "") -> None:
    """`disk`: where the table went to disk, why `cap` shards' disks cannot hold it (else figures' own)."""
    if table.shards_needed > cap:
        raise InfeasibleError(
            f"{file}: no plan can hold the table: {figures(table, ps_type, cap, disk)}. Possible fixes: "
            "(1) raise the PS type's max_instances or table_memory_gb / node_memory_gb in the cluster "
            "config, or give it a local disk (disk_gb and disk_dir; a larger disk_gb); (2) cap the table "
            "(table.max_shard_mb, table.ttl_batches); (3) a smaller embedding_dim",
            0.0,
        )


def hosted_fits(job: JobConfig, first_type: str, num_shards: int, estimate: TableEstimate | None) -> bool:
    """Whether one actor of `first_type` (stage 0's) holds the whole table, as shards hosted in its
    DataWorker need (else they run as actors on the PS type)."""
    if estimate is None:
        return True
    held = min(estimate.total_bytes, estimate.shard_cap_bytes * num_shards)
    return held <= job.cluster.table_memory_gb(first_type) * GIB


def check_plan_holds(
    job: JobConfig, estimate: TableEstimate | None, num_shards: int, plan_file: str | None
) -> None:
    """Refuse (ConfigError, exit 2) a plan whose `num_shards` shard actors on the PS type cannot hold
    `job`'s table within the type's table budget."""
    if estimate is None or (estimate.disk is not None and num_shards >= estimate.disk.shards):
        return
    budget = job.cluster.table_memory_gb(job.cluster.ps_resource) * GIB
    per_shard = min(estimate.total_bytes / num_shards, estimate.shard_cap_bytes)
    if per_shard <= budget:
        return
    need = estimate.shards_within(budget)
    raise ConfigError(
        plan_file,
        "ps_shards",
        f"PS shards that hold the table: {estimate.figure()} over {num_shards} shard(s) on {job.cluster.ps_resource!r} is "
        f"{gib(per_shard / GIB)} GiB per shard, over the type's table budget of {gib(budget / GIB)} GiB per "
        f"actor (at least {need:,} shards needed, its max_instances is "
        f"{job.cluster.type(job.cluster.ps_resource).max_instances})",
        num_shards,
    )


# -- where the rows live (DESIGN.md §1, "Table tiers") ----------------------------------------------

PLACES = ("gpu", "gpu_cache", "ps")


@dataclass(frozen=True)
class TablePlace:
    """Where a plan's table rows live: all in the GPU memory of stage 0's DataWorker (``gpu``), the most
    recently used there as a cache in front of the PS shards (``gpu_cache``), or on the shards (``ps``).
    `gpu_rows`: the rows the GPU holds at most (-1: as the device's free memory allows, measured by the
    actor; 0 on the shards)."""

    place: str
    type: str
    gpu_rows: int = 0
    why: str = ""

    def describe(self) -> str:
        if self.place == "ps":
            return f"on the PS shards ({self.why})" if self.why else "on the PS shards"
        held = "as the device's free memory allows" if self.gpu_rows < 0 else f"up to {self.gpu_rows:,} rows"
        kind = "all rows" if self.place == "gpu" else "a cache of the most recently used rows"
        return f"in {self.type}'s GPU memory: {kind} ({held})"


def gpu_table_setting(job: JobConfig) -> str:
    """``runtime.gpu_table`` as it applies to `job`: "off" also where the shards manage its rows'
    lifetime (TTL or a row cap): they would expire or evict rows the GPU holds."""
    if job.table.ttl_batches or job.table.max_shard_mb:
        return "off"
    return job.runtime.gpu_table


def table_place(
    job: JobConfig, stage0_type: str, hosted: bool, estimate: TableEstimate | None, dim: int
) -> TablePlace:
    """Where `job`'s table lives under a plan whose stage 0 runs on `stage0_type` and `hosted` says
    whether it hosts its shards (one DataWorker and no replicated stage: a row it holds is the row): in
    that GPU's memory when the type is cuda and the job lets it (:func:`gpu_table_setting`); all rows
    when the estimate fits its ``gpu_memory_gb``, else a cache. The cost model prices by the same rule
    (runtime_terms.table_rate)."""
    rtype = job.cluster.type(stage0_type)
    ps = job.cluster.ps_resource
    if not hosted and estimate is not None and estimate.disk is not None:  # shard actors, the PS type's disk
        return TablePlace("ps", ps, why=estimate.disk.describe())
    if rtype.device != "cuda":
        return TablePlace("ps", ps)
    if gpu_table_setting(job) == "off":
        return TablePlace("ps", ps, why="runtime.gpu_table: off, or the shards expire or cap its rows")
    if not hosted:
        return TablePlace("ps", ps, why="shard actors: several DataWorkers or replicated stages")
    if rtype.gpu_memory_gb is None:
        return TablePlace("gpu", stage0_type, -1)
    rows = device_rows_within(rtype.gpu_memory_gb * GIB, dim, sparse_spec(job, dim, 0.0).optimizer)
    if rows < 1:
        return TablePlace("ps", ps, why=f"{stage0_type}'s gpu_memory_gb holds no row")
    fits = estimate is None or estimate.rows <= rows
    return TablePlace("gpu" if fits else "gpu_cache", stage0_type, rows)


def _embedding_dim(job: JobConfig) -> int:
    from heterps_ray.models import build_model

    return build_model(job.model).embedding_dim


def gpu_rows_of(job: JobConfig, dim: int, measured: dict[str, int]) -> dict[str, int]:
    """The rows each cuda type's GPU memory holds for `job`'s table: from its ``gpu_memory_gb``, else
    as `measured` by the profile (its device's free memory less a reserve); types with neither left out."""
    optimizer = sparse_spec(job, dim, 0.0).optimizer
    out = {}
    for rtype in job.cluster.resource_types:
        if rtype.device != "cuda":
            continue
        if rtype.gpu_memory_gb is not None:
            out[rtype.name] = device_rows_within(rtype.gpu_memory_gb * GIB, dim, optimizer)
        elif rtype.name in measured:
            out[rtype.name] = int(measured[rtype.name])
    return out
