"""The disk tier in the plan: where a table goes that the PS type's memory cannot hold (DESIGN.md §4,
"Table memory"; docs/tables.md "The disk tier").

The rule: RAM when RAM can hold the table, as before (its shards_needed by the PS type's table budget
is within the type's max_instances); else, where the PS type declares a local disk (``disk_gb``,
``disk_dir`` in the cluster file), the disk. Each shard then keeps a hot set in RAM within its
table budget and the rest on disk (ps/disk_tier.py):

* its RAM budget in rows is ``max_rows_for(budget)`` (tracked rows, as ``table.ram_mb`` is sized);
* each row on disk keeps ``INDEX_BYTES_PEAK`` of key index in RAM, displacing that share of a RAM row
  (the tier's own rule), so with R rows on a shard and a budget of B rows, the rows on disk are
  D = (R - B) / (1 - k), k = INDEX_BYTES_PEAK / row bytes, and the hot rows R - D;
* the hot set may not fall under the tier's floor (1/8 of the budget: past it, the process outgrows
  its budget) and the files on disk, at their peak (``peak_file_bytes``), within ``disk_gb``.

The shard count is the fewest that meets both; more than the type's max_instances is refused with the
figures (check_job_table). The share of lookups the shards' RAM serves is an LRU cache's over the
data's key counts (hit_rates.cache_hit_rate), with every shard's hot set together as the cache:
keys are hashed evenly over the shards.

Example::

    disk = disk_plan(job, estimate_table(job), dim=9, optimizer="adagrad")  # None: RAM holds it
    disk.shards, disk.split(disk.shards).disk_rows, disk.hit_rate
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from heterps_ray.config import JobConfig, ResourceType
from heterps_ray.costmodel.hit_rates import cache_hit_rate
from heterps_ray.costmodel.problem import PSTable
from heterps_ray.ps.disk_tier import INDEX_BYTES_PEAK, MIN_RAM_SHARE, peak_file_bytes, table_record_dtype
from heterps_ray.ps.row_bytes import max_rows_for, stored_bytes_per_row

if TYPE_CHECKING:
    from heterps_ray.costmodel.table_memory import TableEstimate

GIB = 2**30
SHARDS_LIMIT = 2**31 - 1  # the search's bound: more shards than any type has


@dataclass(frozen=True)
class ShardSplit:
    """What one of `shards` PS shards keeps: its hot rows in RAM, its rows on disk and its files' bytes
    on disk at their peak."""

    shards: int
    hot_rows: int
    disk_rows: int
    disk_bytes: int


@dataclass(frozen=True)
class DiskPlan:
    """A table of `rows` held by PS shards that each keep their hot rows in RAM (within `ram_rows`, less
    the index of their rows on disk) and the rest on the PS type's local disk (`disk_gb` each, under
    `disk_dir`). `shards`: the fewest that hold it (SHARDS_LIMIT: none; may exceed max_instances);
    `hit_rate`: the share of key lookups a shard's RAM serves at that count."""

    rows: int
    ram_rows: int  # each shard's RAM budget in rows (TableSpec.ram_rows), from its table budget
    index_share: float  # a RAM row's share one row on disk takes for its index (the tier's rule)
    record_bytes: int  # one row's record in the file
    disk_gb: float
    disk_dir: str  # the PS type's (the job's folder goes under it)
    shards: int = 0
    hit_rate: float = 1.0

    @property
    def hot_floor(self) -> int:
        """The fewest hot rows the tier keeps: past it the disk rows' index outgrows the budget."""
        return max(1, int(self.ram_rows * MIN_RAM_SHARE))

    def split(self, shards: int) -> ShardSplit:
        """What one of `shards` shards keeps, its rows being the table's share."""
        per_shard = math.ceil(self.rows / shards)
        on_disk = max(0, math.ceil((per_shard - self.ram_rows) / (1.0 - self.index_share)))
        return ShardSplit(shards, per_shard - on_disk, on_disk, peak_file_bytes(on_disk, self.record_bytes))

    def holds(self, shards: int) -> bool:
        """Whether `shards` shards hold the table: a hot set above the floor, the files within disk_gb."""
        split = self.split(shards)
        hot_ok = split.disk_rows == 0 or split.hot_rows >= self.hot_floor
        return self.ram_rows >= 1 and hot_ok and split.disk_bytes <= self.disk_gb * GIB

    def section(self) -> dict[str, Any]:
        """Its fields of the problem's ``ps.table``: disk_rows (all shards), ram_hit_rate, disk_gb."""
        on_disk = self.split(self.shards).disk_rows * self.shards if self.shards < SHARDS_LIMIT else 0
        return {"disk_rows": on_disk, "ram_hit_rate": round(self.hit_rate, 4), "disk_gb": self.disk_gb}

    def describe(self) -> str:
        """'hot rows in RAM, the rest on disk under D: per shard ~H rows in RAM, ~R on disk; ~h of the
        lookups served from RAM (estimated)', for the plan and the run report."""
        split = self.split(self.shards)
        return (
            f"hot rows in RAM, the rest on disk under {self.disk_dir}: per shard ~{split.hot_rows:,} rows in "
            f"RAM, ~{split.disk_rows:,} on disk; ~{self.hit_rate:.1%} of lookups from RAM (estimated)"
        )

    def shortfall(self, cap: int) -> str:
        """Why `cap` shards (the PS type's max_instances) cannot hold the table, in figures."""
        split = self.split(cap)
        return (
            f"with the PS type's disk, each of {cap} shards would keep ~{split.disk_rows:,} rows on disk "
            f"({split.disk_bytes / GIB:.4g} GiB of files at their peak; disk_gb is {self.disk_gb:g}) and "
            f"~{split.hot_rows:,} hot rows of its RAM budget of {self.ram_rows:,} rows (at least "
            f"{self.hot_floor:,})"
        )


def disk_plan(job: JobConfig, estimate: TableEstimate, dim: int, optimizer: str) -> DiskPlan | None:
    """Where `job`'s table (`estimate`, embedding `dim`, sparse `optimizer`) goes on disk: None where the
    PS type's memory holds it within its max_instances, the type declares no disk, the job keeps its own
    disk tier (``table.disk_dir``), or the shards expire or cap their rows (no disk tier then)."""
    if _ram_shards(job, estimate) <= _ps_type(job).max_instances:
        return None  # RAM holds it
    return _on_types_disk(job, estimate, dim, optimizer)


def disk_option(job: JobConfig, estimate: TableEstimate, dim: int, optimizer: str) -> DiskPlan | None:
    """The table on the PS type's disk as an alternative where RAM holds it too, but on more shards than
    the disk needs (more PS instances): the planner weighs the two, its price deciding whether the disk
    rows' time costs less than the instances they save (closedloop/run.py). None where RAM alone holds
    it on the fewest shards, or there is no disk tier to weigh (as for :func:`disk_plan`)."""
    ram = _ram_shards(job, estimate)
    if ram > _ps_type(job).max_instances or ram <= job.cluster.ps.min_shards:
        return None
    plan = _on_types_disk(job, estimate, dim, optimizer)
    return plan if plan is not None and plan.shards < ram else None


def _ps_type(job: JobConfig) -> ResourceType:
    return job.cluster.type(job.cluster.ps_resource)


def _ram_shards(job: JobConfig, estimate: TableEstimate) -> int:
    """The shards that hold `estimate`'s table in the PS type's table memory alone."""
    # table_memory sizes the table and imports this module
    from heterps_ray.costmodel.table_memory import shards_needed

    budget = job.cluster.table_memory_gb(job.cluster.ps_resource) * GIB
    return shards_needed(estimate.total_bytes, budget, estimate.shard_cap_bytes)


def _on_types_disk(job: JobConfig, estimate: TableEstimate, dim: int, optimizer: str) -> DiskPlan | None:
    """The table laid out on the PS type's disk with its hit rate from the job's data; None where the
    type declares no disk, the job keeps its own disk tier, or its shards expire or cap rows."""
    settings, ps = job.table, _ps_type(job)
    if ps.disk_gb is None or ps.disk_dir is None or settings.disk_dir:
        return None
    if settings.ttl_batches or settings.max_shard_mb:
        return None
    budget = job.cluster.table_memory_gb(ps.name) * GIB
    plan = disk_layout(estimate.rows, budget, dim, optimizer, settings.admit_after, ps.disk_gb, ps.disk_dir)
    split = plan.split(min(plan.shards, ps.max_instances))
    hit = cache_hit_rate(job, split.shards * split.hot_rows, plan.rows) if split.disk_rows else 1.0
    return replace(plan, hit_rate=hit)


def disk_layout(
    rows: int, budget: float, dim: int, optimizer: str, admit_after: int, disk_gb: float, disk_dir: str
) -> DiskPlan:
    """A table of `rows` (embedding `dim`, sparse `optimizer`, admission after `admit_after` pulls) on
    shards of `budget` bytes of table memory and `disk_gb` of disk under `disk_dir` each, laid out over
    the fewest shards that hold it (SHARDS_LIMIT: none do); its hit rate is the caller's to set (a job's
    data: :func:`disk_plan`; a simulated table: its key popularity)."""
    plan = DiskPlan(
        rows,
        max_rows_for(budget, dim, optimizer, admit_after=admit_after) if budget > 0 else 0,
        INDEX_BYTES_PEAK / stored_bytes_per_row(dim, optimizer, tracked=True),
        table_record_dtype(dim, optimizer).itemsize,
        disk_gb,
        disk_dir,
    )
    return replace(plan, shards=_fewest(plan.holds))


def disk_figure(table: PSTable) -> str:
    """A table on disk as the refusal shows it: the disk of each shard and the rows there."""
    return (
        f"on the PS type's disk: {table.disk_rows:,} rows over {table.shards_needed:,} shards, disk_gb "
        f"{table.disk_gb:g} GiB each, the hot rows in RAM serving ~{table.ram_hit_rate:.1%} of lookups"
    )


def _fewest(holds: Callable[[int], bool]) -> int:
    """The fewest shards n for which `holds(n)` (true from some n on: more shards, fewer rows each);
    SHARDS_LIMIT where none does."""
    if not holds(SHARDS_LIMIT):
        return SHARDS_LIMIT
    low, high = 1, SHARDS_LIMIT  # holds(high)
    while low < high:
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid + 1
    return low
