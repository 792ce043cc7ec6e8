"""What a sharded table is: how each shard creates its partition (:class:`TableSpec`, from a job's
``table:`` section by :func:`sparse_spec`) and which shard owns a key (:func:`shard_of`).

Key -> shard is the high 32 bits of ``splitmix64(key XOR 0x5ba4d5a2e1f3c7b9)`` modulo the shard count.
It is salted so it does not correlate with the low bits the :class:`~heterps_ray.ps.table.SparseTable`
hash index uses inside a shard, and it is not Python's ``hash()`` (salted per process). Rows are
created from (key, seed) only, so a model trained with 1, 2 or 4 shards is the same model.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from heterps_ray.ps.row_bytes import max_rows_for
from heterps_ray.ps.table import splitmix64

if TYPE_CHECKING:
    from heterps_ray.config import JobConfig

_SHARD_SALT = np.uint64(0x5BA4D5A2E1F3C7B9)


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard index (int64) of each key; a pure function of (key, num_shards)."""
    mixed = splitmix64(np.ascontiguousarray(keys, dtype=np.int64).ravel().view(np.uint64) ^ _SHARD_SALT)
    return ((mixed >> np.uint64(32)) % np.uint64(num_shards)).astype(np.int64)


@dataclass(frozen=True)
class TableSpec:
    """How to create one sparse table (every shard holds a partition of it); the fields are
    :class:`~heterps_ray.ps.table.SparseTable`'s arguments. Admission and eviction are off by
    default; `max_rows` caps each shard's partition."""

    dim: int
    seed: int = 0
    lr: float = 0.05
    init_accumulator: float = 0.1
    init_scale: float = 0.01
    optimizer: str = "adagrad"  # or "rowwise_adagrad"
    admit_after: int = 1  # pull calls that see a key before it gets a row (1: at once)
    ttl: int = 0  # steps a row lives unseen (0: forever)
    max_rows: int = 0  # rows per shard before the least recently (or frequently) seen go (0: no cap)
    evict: str = "lru"  # or "lfu"
    ram_rows: int = 0  # with disk_dir: rows per shard in RAM, the rest on local disk (ps/disk_tier.py)
    disk_dir: str = ""  # the job's folder of the disk tier on each PS node (each shard and table a folder in it)
    disk_reads_in_flight: int = 32  # rows read from disk at once (threads of pread)

    def for_shard(self, index: int, num_shards: int, table: str) -> TableSpec:
        """This spec as one shard's table: its disk tier in a folder of its own."""
        if not self.disk_dir:
            return self
        folder = Path(self.disk_dir) / f"shard-{index:05d}-of-{num_shards:05d}" / table
        return replace(self, disk_dir=str(folder))


class PlannedDisk(Protocol):
    """The planner's disk tier for a table (costmodel/table_disk.py DiskPlan): each shard's RAM budget
    in rows and the PS type's disk_dir."""

    @property
    def ram_rows(self) -> int: ...

    @property
    def disk_dir(self) -> str: ...


def job_disk_folder(job: JobConfig, disk_dir: str | None = None) -> Path:
    """Where `job`'s rows on disk go under `disk_dir` (default ``table.disk_dir``): a folder named by
    the job and a digest of its output_dir, so that two jobs given one disk_dir (or one job run into two
    output dirs) never touch each other's files (a shard's table starts by unlinking the files in its
    folder)."""
    digest = hashlib.sha1(str(Path(job.output_dir).resolve()).encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", job.name)[:40]
    return Path(disk_dir or job.table.disk_dir) / f"{name}-{digest}"


def sparse_spec(job: JobConfig, dim: int, init_scale: float, disk: PlannedDisk | None = None) -> TableSpec:
    """The TableSpec of a job's sparse table: the job's Adagrad settings and its ``table:`` section
    (admission, TTL in batches, each shard's memory cap as a row cap, eviction order, its disk tier).
    `disk`: the plan's disk tier, for shard actors on a PS type that declares a disk (the job's own
    ``table.disk_dir`` and ``ram_mb`` win)."""
    settings = job.table
    max_rows = ram_rows = 0
    disk_dir = ""
    if settings.max_shard_mb:
        max_rows = max_rows_for(settings.max_shard_mb * 2**20, dim, admit_after=settings.admit_after)
    if settings.disk_dir:
        ram_rows = max_rows_for(settings.ram_mb * 2**20, dim, admit_after=settings.admit_after)
        disk_dir = str(job_disk_folder(job))
    elif disk is not None:
        ram_rows, disk_dir = disk.ram_rows, str(job_disk_folder(job, disk.disk_dir))
    return TableSpec(
        dim=dim,
        seed=job.seed,
        lr=job.optimizer.sparse_lr,
        init_accumulator=job.optimizer.sparse_init_accumulator,
        init_scale=init_scale,
        admit_after=settings.admit_after,
        ttl=settings.ttl_batches,
        max_rows=max_rows,
        evict=settings.evict,
        ram_rows=ram_rows,
        disk_dir=disk_dir,
        disk_reads_in_flight=settings.disk_reads_in_flight,
    )
