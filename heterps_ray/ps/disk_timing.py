"""The PS type's local disk, timed as its disk tier uses it (ps/disk_tier.py; DESIGN.md §3b,
``runtime.disk_ms_per_row``): a file of the table's records under the type's ``disk_dir``, then

* cold reads (the file dropped from the page cache before each batch) at several numbers of reads in
  flight, and warm reads (the file in the page cache) at the job's;
* appends, as a spill writes rows;
* a row RAM misses, as the tier pays it at the job's setting: the row read back cold, and one row
  written out in its place (the tier's RAM is full: each row that comes in sends one out).

The price takes the last one, cold: the node's page cache is not the shard's to count on (other work,
other shards), so a plan priced cold meets its floor with or without it; a run whose file stays cached
achieves more than predicted (BENCHMARKS.md, "The disk tier").

Example::

    timings = time_disk("/mnt/nvme", record_dtype(9, 9), reads_in_flight=32)
    [t for t in timings if t.what == "miss"][0].ms_per_row
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heterps_ray.ps.disk_tier import DiskRows

DEPTHS = (1, 16, 64)  # reads in flight the cold sweep times, besides the job's own setting
RECORDS = 400_000  # records in the file: enough pages that a batch's rows seldom share one
BATCH_ROWS = 1024  # rows a batch reads (a quickstart batch's distinct keys missing from RAM, about)
BATCHES = 4  # batches timed per setting
MAX_DISK_SHARE = 0.25  # of the free space under the directory (and of the type's disk_gb) the file may take


@dataclass(frozen=True)
class DiskTiming:
    """`rows` records moved in `ms`: `what` is "cold" or "warm" (reads), "append" or "miss" (a row read
    back cold and one written out); `depth`: reads in flight."""

    what: str
    depth: int
    rows: int
    ms: float

    @property
    def ms_per_row(self) -> float:
        return self.ms / self.rows if self.rows else 0.0


def time_disk(
    directory: str | Path,
    dtype: np.dtype,
    reads_in_flight: int,
    disk_gb: float | None = None,
    seed: int = 0,
) -> list[DiskTiming]:
    """Time the disk under `directory` with records of `dtype` (ps/disk_tier.record_dtype): the cold
    sweep over DEPTHS and `reads_in_flight`, warm reads and misses at `reads_in_flight`, and appends.
    The file goes in a folder of its own under `directory`, removed after; it takes at most
    MAX_DISK_SHARE of the free space (and of `disk_gb`)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    room = shutil.disk_usage(directory).free * MAX_DISK_SHARE
    if disk_gb is not None:
        room = min(room, disk_gb * 2**30 * MAX_DISK_SHARE)
    records = int(min(RECORDS, room // dtype.itemsize))
    if records < 2 * BATCH_ROWS:
        raise OSError(
            f"{directory}: room for {records:,} records of {dtype.itemsize} B to time the disk, "
            f"expected at least {2 * BATCH_ROWS:,} (free space or disk_gb too small)"
        )
    rng = np.random.default_rng(seed)
    folder = tempfile.mkdtemp(prefix="heterps-profile-disk-", dir=directory)
    try:
        store = DiskRows(folder, dtype, reads_in_flight)
        out = [_append(store, records)]
        depths = sorted({*DEPTHS, reads_in_flight})
        for depth in depths:
            store.reads = depth
            out.append(_reads(store, rng, "cold", depth))
        store.reads = reads_in_flight
        store.path.read_bytes()  # into the page cache
        out.append(_reads(store, rng, "warm", reads_in_flight))
        out.append(_misses(store, rng, reads_in_flight))
        store.close()
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _append(store: DiskRows, records: int) -> DiskTiming:
    """Fill the file, a batch's worth of rows at a time as spills write them, keys 0..records-1."""
    ms = 0.0
    for first in range(0, records, BATCH_ROWS * 16):
        chunk = np.zeros(min(BATCH_ROWS * 16, records - first), dtype=store.dtype)
        chunk["key"] = np.arange(first, first + len(chunk))
        start = time.perf_counter()
        store.write(chunk)
        ms += (time.perf_counter() - start) * 1000.0
    return DiskTiming("append", 1, records, ms)


def _reads(store: DiskRows, rng: np.random.Generator, what: str, depth: int) -> DiskTiming:
    ms = 0.0
    for _ in range(BATCHES):
        pos = _live_batch(store, rng)
        if what == "cold":
            _drop_from_page_cache(store.path)
        start = time.perf_counter()
        store.read(pos)
        ms += (time.perf_counter() - start) * 1000.0
    return DiskTiming(what, depth, BATCHES * BATCH_ROWS, ms)


def _misses(store: DiskRows, rng: np.random.Generator, depth: int) -> DiskTiming:
    """Rows read back cold, forgotten on disk, and as many written at the file's end (the rows the tier
    sends out to make room; here the same records, so the file keeps its rows)."""
    ms = 0.0
    for _ in range(BATCHES):
        pos = _live_batch(store, rng)
        _drop_from_page_cache(store.path)
        start = time.perf_counter()
        records = store.read(pos)
        store.forget(pos)
        store.write(records)
        ms += (time.perf_counter() - start) * 1000.0
    return DiskTiming("miss", depth, BATCHES * BATCH_ROWS, ms)


def _live_batch(store: DiskRows, rng: np.random.Generator) -> np.ndarray:
    """Index positions of BATCH_ROWS distinct live rows, at random."""
    return np.sort(rng.choice(np.flatnonzero(store.live), BATCH_ROWS, replace=False))


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages stay in the cache: written first, they can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
