"""A sparse table's rows beyond its RAM budget, on local disk: the level below the row store.

A :class:`~heterps_ray.ps.table.SparseTable` with a disk tier keeps at most ``ram_rows`` rows in its
compiled row store (the RAM tier, the hot rows); the rest are records in one file on local disk,
with their keys' index in memory (sorted arrays: 8 B key + 4 B slot + 1 B flag = 13 B a row on
disk). Before a call is served, its keys that are on disk are read back into RAM (promoted: in one
read, in the file's order, ``table.disk_reads_in_flight`` records at a time), and,
where RAM would pass its budget, the rows seen least recently (or least often, ``evict="lfu"``)
leave for disk first (spilled), never a row the call itself uses. A row leaves and comes back as
its exact bytes (key, pull count, last seen, weights, optimizer state), so training with a disk tier
is bit for bit training with every row in RAM: where a row lives changes the time, not the values.

Why an explicit RAM cache over a file of records, and not the row store's segments mapped from
files with the page cache as the RAM tier, nor an embedded key-value store (BENCHMARKS.md "Tables",
the disk tier; benchmarks/bench_disk_store.py): on the Criteo-shaped key stream the hottest quarter of
the pages would serve nearly as many lookups as the hottest quarter of the rows (0.88 against 0.90:
hot keys come first and sit together), so hit rate does not decide it. What does: mapped pages count
in the process's RSS and the kernel, not the budget, decides how many stay; dirty pages are written
back when the kernel likes, so a checkpoint could not take the file as it is (the file here is never
changed in place, so a hard link is a snapshot); and the row moves whole, with its counters, under
the table's own LRU. SQLite (the embedded store of the standard library; no extra wheel) read rows
3.3x slower than one pread each (0.46M against 1.53M rows/s from the page cache) and wrote them
13x slower than appending (0.70M rows/s against 760 MB/s = 9M rows/s).

The file is append-only: a spilled row is written at its end, and bytes once written are never
changed. That is what lets a checkpoint hard-link the file instead of copying it (its index says
which records are its rows; what is appended later is not), and a restore link it back. A promoted
row's record stays in the file, no longer live; :meth:`DiskRows.compact` rewrites the live records
into a new file when most of it is dead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from heterps_ray.errors import DataError, StorageError
from heterps_ray.ps._rows import pread_records
from heterps_ray.ps.atomic import Member, NpzReader
from heterps_ray.ps.tier_stats import TierStats

# The file of a table's records in its directory; a compaction starts the next generation.
_FILE = "rows.{generation}.dat"
# Index bytes per row on disk at its peak: key, slot and flag (13 B), and while a spill merges new keys
# in, the old and the new key array side by side (8 B more).
INDEX_BYTES_PEAK = 8 + 4 + 1 + 8
# The RAM tier keeps at least this share of its budget in rows, however big the index grows.
MIN_RAM_SHARE = 1 / 8
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter (malloc.h)
# Compact when the file holds this many times the live records (and at least this many records).
_COMPACT_RATIO = 3.0
_COMPACT_MIN_RECORDS = 1 << 16
# Reads a compaction or a restore keeps in flight (threads of pread in _rows.c; a table's own reads:
# table.disk_reads_in_flight): a read from the device waits on it, not on the CPU, and the device serves
# many at once (BENCHMARKS.md "The disk tier": rows/s by reads in flight).
READS_IN_FLIGHT = 32


def peak_file_bytes(live_rows: int, record_bytes: int) -> int:
    """The most bytes a table's files on disk reach for `live_rows` live rows: the file at the point
    where it is compacted (dead records and all) and the new file the compaction writes beside it."""
    at_compaction = max(int(_COMPACT_RATIO * live_rows), _COMPACT_MIN_RECORDS) if live_rows else 0
    return (at_compaction + live_rows) * record_bytes


def table_record_dtype(dim: int, optimizer: str) -> np.dtype:
    """The record of a row of a table of `dim` with sparse `optimizer` (rowwise Adagrad: one accumulator)."""
    return record_dtype(dim, 1 if optimizer == "rowwise_adagrad" else dim)


def record_dtype(dim: int, acc_width: int) -> np.dtype:
    """One record: the row store's row as it is in RAM (a tracked row: key, count, last seen, weights,
    accumulators), so a row goes to disk and back as a copy of its bytes."""
    return np.dtype([("key", "<i8"), ("meta", "<u4", (2,)), ("w", "<f4", (dim,)), ("acc", "<f4", (acc_width,))])


class DiskRows:
    """Records of fixed size in an append-only file under `directory`, and the in-memory index of the
    keys whose live row is there. A new object starts empty (an old file there is unlinked, never
    truncated: a checkpoint may hold a link to it). `reads`: records read from the file at once."""

    def __init__(self, directory: str | Path, dtype: np.dtype, reads: int = READS_IN_FLIGHT):
        self.directory = Path(directory)
        self.dtype, self.reads = dtype, reads
        self.directory.mkdir(parents=True, exist_ok=True)
        for old in self.directory.glob(_FILE.format(generation="*")):
            old.unlink()
        self.generation = 0
        self._fd = -1
        self._open(create=True)
        self.keys = np.zeros(0, dtype=np.int64)  # sorted
        self.slots = np.zeros(0, dtype=np.uint32)  # record number in the file
        self.live = np.zeros(0, dtype=bool)  # False: the row is in RAM (or gone); the record is stale
        self.live_count = 0

    @property
    def path(self) -> Path:
        return self.directory / _FILE.format(generation=self.generation)

    @property
    def records(self) -> int:
        """Records in the file (live or not)."""
        return self._end // self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Memory of the index."""
        return int(self.keys.nbytes + self.slots.nbytes + self.live.nbytes)

    def _open(self, create: bool) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(self.path, flags, 0o644)
        # rows are read where their keys take them: the kernel's read-ahead would read pages no one asked
        # for, and take the device's reads from those that were
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(self._fd).st_size
        # appended at the end only; a torn record left by a crash is skipped, never overwritten
        self._end = -(-size // self.dtype.itemsize) * self.dtype.itemsize

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in the index, live on disk) of `keys`."""
        pos = np.searchsorted(self.keys, keys)
        if len(self.keys) == 0:
            return pos, np.zeros(len(keys), dtype=bool)
        pos = np.minimum(pos, len(self.keys) - 1)
        return pos, (self.keys[pos] == keys) & self.live[pos]

    def read(self, pos: np.ndarray) -> np.ndarray:
        """The records at index positions `pos` (structured, ``dtype``), in that order: read in the
        file's order, one pread each, `reads` at once."""
        offsets = self.slots[pos].astype(np.int64) * self.dtype.itemsize
        order = np.argsort(offsets, kind="stable")
        in_file_order = np.empty(len(pos), dtype=self.dtype)
        pread_records(self._fd, offsets[order], in_file_order.view(np.uint8), self.reads)
        out = np.empty_like(in_file_order)
        out[order] = in_file_order
        return out

    def forget(self, pos: np.ndarray) -> None:
        """The rows at `pos` are no longer on disk (read back into RAM, or removed)."""
        pos = pos[self.live[pos]]
        self.live[pos] = False
        self.live_count -= len(pos)

    def write(self, records: np.ndarray) -> None:
        """Append `records` (distinct keys) and index them as the live rows of their keys."""
        n = len(records)
        if not n:
            return
        first = self.records
        if first + n >= 2**32:
            raise OSError(f"{self.path}: 2^32 records in one file (compaction could not keep up)")
        written = self._append(np.ascontiguousarray(records).view(np.uint8))
        if written != n * self.dtype.itemsize:
            raise OSError(f"{self.path}: short write ({written} of {n * self.dtype.itemsize} bytes)")
        self._end += written
        self._index(records["key"], np.arange(first, first + n, dtype=np.uint32))

    def _append(self, data: np.ndarray) -> int:
        """Write `data` at the file's end; a full disk is a StorageError that says what to do."""
        try:
            return os.pwrite(self._fd, data.data, self._end)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            free = shutil.disk_usage(self.directory).free
            raise StorageError(
                f"{self.path}: the disk of table.disk_dir is full: {data.nbytes:,} B of rows to write, "
                f"{free:,} B free ({os.strerror(exc.errno)}). This shard's rows in flight are lost; the "
                "run's checkpoints are untouched (resume from the last one with --resume once there is "
                "room): free space under disk_dir, give it a larger disk, or raise table.ram_mb"
            ) from exc

    def _index(self, keys: np.ndarray, slots: np.ndarray) -> None:
        order = np.argsort(keys, kind="stable")
        keys, slots = keys[order], slots[order]
        pos = np.searchsorted(self.keys, keys)
        known = pos < len(self.keys)
        known[known] = self.keys[pos[known]] == keys[known]
        at = pos[known]
        self.live_count += int((~self.live[at]).sum())
        self.slots[at], self.live[at] = slots[known], True
        fresh = ~known
        if fresh.any():
            self.keys = np.insert(self.keys, pos[fresh], keys[fresh])
            self.slots = np.insert(self.slots, pos[fresh], slots[fresh])
            self.live = np.insert(self.live, pos[fresh], True)
            self.live_count += int(fresh.sum())

    def live_positions(self) -> np.ndarray:
        return np.flatnonzero(self.live)

    def chunks(self, size: int) -> list[np.ndarray]:
        """The index positions of the live rows, in chunks of at most `size` (for streamed reads)."""
        live = self.live_positions()
        return [live[i : i + size] for i in range(0, len(live), size)] or [live]

    def clear(self) -> None:
        """Hold nothing: the next generation's file, empty (the old one unlinked, not truncated)."""
        self.close()
        self.path.unlink(missing_ok=True)
        self.generation += 1
        self._open(create=True)
        self.keys = np.zeros(0, dtype=np.int64)
        self.slots = np.zeros(0, dtype=np.uint32)
        self.live = np.zeros(0, dtype=bool)
        self.live_count = 0

    def dead_share(self) -> float:
        return 1.0 - self.live_count / max(self.records, 1)

    def maybe_compact(self) -> bool:
        """Compact when the file is mostly dead records (see :meth:`compact`)."""
        if self.records < _COMPACT_MIN_RECORDS or self.records < _COMPACT_RATIO * max(self.live_count, 1):
            return False
        self.compact()
        return True

    def compact(self, chunk: int = 1 << 16) -> None:
        """Rewrite the live records into the next generation's file and unlink this one (a checkpoint's
        hard link keeps its data)."""
        old_fd, old_path = self._fd, self.path
        live = self.live_positions()
        self._fd = -1
        self.generation += 1
        self._open(create=True)
        try:
            for i in range(0, len(live), chunk):
                part = live[i : i + chunk]
                out = np.empty(len(part), dtype=self.dtype)
                offsets = self.slots[part].astype(np.int64) * self.dtype.itemsize
                pread_records(old_fd, offsets, out.view(np.uint8), self.reads)
                self._end += self._append(out.view(np.uint8))
            keys = self.keys[live]
            self.keys, self.live = keys, np.ones(len(keys), dtype=bool)
            self.slots = np.arange(len(keys), dtype=np.uint32)
            self.live_count = len(keys)
        finally:
            os.close(old_fd)
        old_path.unlink()

    def adopt(self, source: Path, keys: np.ndarray, slots: np.ndarray) -> None:
        """Take the file `source` (a checkpoint's hard link, linked here in turn) as this table's file,
        its live rows the records `slots` of `keys` (sorted): a restore reads nothing of it."""
        self.close()
        self.path.unlink(missing_ok=True)
        self.generation += 1
        _link_or_copy(source, self.path)
        self._open(create=False)
        self.keys = np.array(keys, dtype=np.int64)  # copies: the index is changed in place later
        self.slots = np.array(slots, dtype=np.uint32)
        self.live = np.ones(len(keys), dtype=bool)
        self.live_count = len(keys)

    def link_into(self, target: Path) -> str:
        """Hard-link the file to `target` (a copy where the filesystem cannot link) and fsync it; the
        record count now is what the link's index may reference. Returns how: "link" or "copy"."""
        return _link_or_copy(self.path, target)


class DiskTier:
    """The RAM budget of one table's row store (`rows`, a tracked ``_rows.Rows``: at most `ram_rows`
    rows, briefly more between a write and the next pull) and its rows beyond it (:class:`DiskRows`).
    The table calls :meth:`before_pull` and :meth:`before_write` before serving a call, so the call
    finds all its rows in RAM."""

    def __init__(
        self,
        rows: Any,
        directory: str | Path,
        ram_rows: int,
        dim: int,
        acc_width: int,
        row_cost: float,
        reads: int = READS_IN_FLIGHT,
    ):
        if ram_rows < 1:
            raise ValueError(f"a disk tier needs a RAM budget of at least 1 row (got {ram_rows})")
        self.rows, self.ram_rows = rows, ram_rows
        # the key index of the rows on disk lives in the same budget: each disk row's index bytes
        # displace RAM rows of `row_cost` bytes each (the budget per row the caller sized ram_rows by)
        self._index_rows_per_disk_row = INDEX_BYTES_PEAK / row_cost
        self.index_outgrew = False  # True once the index left the RAM tier only its floor
        _return_freed_memory()
        self.disk = DiskRows(directory, record_dtype(dim, acc_width), reads)
        # in key lookups, as the GPU tier counts them: a hit found its row in RAM, a miss did not (its
        # row came from disk, or is new); rows read back from disk are `fetched`
        self.stats = TierStats()
        # spill 1/16 below the budget at a time, as the row cap does: the scan for the least recent
        # rows then runs once per ram_rows/16 new rows
        self._slack = max(1, ram_rows // 16)

    def __len__(self) -> int:
        return self.disk.live_count

    def before_pull(self, keys: np.ndarray, unique: bool = False) -> None:
        """A creating pull of `keys` (`unique`: distinct) is next: its rows in RAM are kept there (seen
        now), room is made for the rest (the least recent rows spilled), and those on disk are read back."""
        found = np.empty(len(keys), dtype=np.uint8)
        self.rows.has(keys, found, True)
        absent = found == 0
        missing = _distinct_sorted(keys[absent], unique)
        self.stats.misses += int(absent.sum())
        self.stats.hits += len(keys) - int(absent.sum())
        self.make_room(len(missing))  # first: a spill re-indexes the disk rows (positions move)
        pos, on_disk = self.disk.find(missing)
        self._promote(pos[on_disk])

    def before_write(self, keys: np.ndarray, unique: bool = False) -> None:
        """A push or a tier's write-back of `keys` (`unique`: distinct) is next: their rows on disk
        (spilled since their pull, by another call's pull) come back, past the budget until the write
        is done (the table then calls :meth:`make_room`: a spill before it could take a row the write
        needs)."""
        found = np.empty(len(keys), dtype=np.uint8)
        self.rows.has(keys, found, False)
        if found.all():
            return
        pos, on_disk = self.disk.find(_distinct_sorted(keys[found == 0], unique))
        self._promote(pos[on_disk])

    @property
    def ram_cap(self) -> int:
        """Rows RAM may hold now: the budget less the disk index's share, at least 1/8 of it."""
        index = int(self.disk.live_count * self._index_rows_per_disk_row)
        floor = max(1, int(self.ram_rows * MIN_RAM_SHARE))
        if self.ram_rows - index < floor and not self.index_outgrew:
            self.index_outgrew = True
            warnings.warn(
                f"{self.disk.directory}: the index of {self.disk.live_count:,} rows on disk "
                f"({self.disk.nbytes / 2**20:.0f} MiB) takes most of the RAM budget of "
                f"{self.ram_rows:,} rows; RAM keeps {floor:,} rows and the process grows past its budget",
                stacklevel=2,
            )
        return max(floor, self.ram_rows - index)

    def make_room(self, need: int, keep_now: bool = True) -> None:
        """Spill rows (least recently or least often seen; with `keep_now` not those seen at the clock)
        so that `need` more fit in the budget."""
        live, cap = len(self.rows), self.ram_cap
        if live + need <= cap:
            return
        target = max(0, cap - need - self._slack)
        out = np.empty(live - target, dtype=self.disk.dtype)
        n = int(self.rows.spill(target, out.view(np.uint8), keep_now))
        self.disk.write(out[:n])
        self.stats.evicted += n
        self.stats.written_back += n
        self.rows.repack()  # where the RAM share shrank: the row store's freed segments go back
        self.disk.maybe_compact()

    def _promote(self, pos: np.ndarray) -> None:
        if not len(pos):
            return
        records = self.disk.read(pos)
        self.rows.insert(records.view(np.uint8))
        self.disk.forget(pos)
        self.stats.fetched += len(pos)

    def fill(self, keys: np.ndarray, out: np.ndarray) -> None:
        """A pull that creates nothing (evaluation) read the RAM tier into `out`; the rows of `keys`
        on disk are read from there (not brought into RAM: evaluation does not change the hot set)."""
        pos, on_disk = self.disk.find(keys)
        if on_disk.any():
            out[on_disk] = self.disk.read(pos[on_disk])["w"]

    def position(self) -> tuple[int, int]:
        """(file generation, records): what a delta is relative to (records appended later are new)."""
        return self.disk.generation, self.disk.records

    def written_since(self, mark: tuple[int, int]) -> np.ndarray:
        """Index positions of the live rows written after `mark` (all of them after a compaction)."""
        since = mark[1] if mark[0] == self.disk.generation else 0
        return np.flatnonzero(self.disk.live & (self.disk.slots >= since))

    def held(self, keys: np.ndarray) -> np.ndarray:
        """bool per key: the table holds its row (in RAM or on disk)."""
        found = np.empty(len(keys), dtype=np.uint8)
        self.rows.has(keys, found, False)
        return found.astype(bool) | self.disk.find(keys)[1]

    def removed(self, keys: np.ndarray) -> None:
        """`keys` are gone from the table (a delta's removed keys): their records are dead too."""
        pos, on_disk = self.disk.find(np.unique(keys))
        self.disk.forget(pos[on_disk])


    def link_members(self, target: Path) -> list[Member]:
        """A full snapshot's rows on disk, not copied: the file hard-linked to `target` (beside the
        snapshot; a copy where the filesystem cannot link) and, as snapshot members, the index of its
        live records and the record count it had (what is appended later is not the snapshot's)."""
        how = self.disk.link_into(target)
        # the whole index as it is (no copies: a copy of the live part took 60 MiB of a 3M-row shard)
        return [
            Member.of("disk_keys", self.disk.keys),
            Member.of("disk_slots", self.disk.slots),
            Member.of("disk_live", self.disk.live),
            Member.of("disk_records", np.array(self.disk.records, dtype=np.int64)),
            Member.of("disk_file", np.frombuffer(target.name.encode(), dtype=np.uint8)),
            Member.of("disk_linked", np.array(how == "link")),
        ]

    def adopt_linked(self, npz: NpzReader, prefix: str) -> None:
        """Restore the rows on disk of a snapshot written with :meth:`link_members`: its file linked
        back here, read nothing of it."""
        source, keys, slots = linked_rows(npz, prefix, self.disk.dtype)
        self.disk.adopt(source, keys, slots)


def linked_rows(npz: NpzReader, prefix: str, dtype: np.dtype) -> tuple[Path, np.ndarray, np.ndarray]:
    """(file, keys, slots) of a snapshot's linked rows on disk; a DataError naming the snapshot when
    the file is gone or shorter than the snapshot's records."""
    name = npz.array(prefix + "disk_file").tobytes().decode()
    source = npz.path.parent / name
    records = int(npz.array(prefix + "disk_records"))
    size = source.stat().st_size if source.exists() else -1
    if size < records * dtype.itemsize:
        raise DataError(
            f"{npz.path}: its rows on disk, {source}, are {'missing' if size < 0 else f'{size} bytes'}; "
            f"expected at least {records} records of {dtype.itemsize} B"
        )
    live = npz.array(prefix + "disk_live")
    return source, npz.array(prefix + "disk_keys")[live], npz.array(prefix + "disk_slots")[live]


def read_linked(npz: NpzReader, prefix: str, dtype: np.dtype, chunk: int) -> Iterator[np.ndarray]:
    """The records of a snapshot's linked rows on disk, `chunk` at a time (a restore into a table
    without a disk tier)."""
    source, _, slots = linked_rows(npz, prefix, dtype)
    fd = os.open(source, os.O_RDONLY)
    try:
        for i in range(0, len(slots), chunk):
            out = np.empty(len(slots[i : i + chunk]), dtype=dtype)
            offsets = slots[i : i + chunk].astype(np.int64) * dtype.itemsize
            pread_records(fd, offsets, out.view(np.uint8), READS_IN_FLIGHT)
            yield out
    finally:
        os.close(fd)


def _distinct_sorted(keys: np.ndarray, unique: bool) -> np.ndarray:
    """`keys` distinct and sorted (the index's lookups go in its order); `unique`: distinct already (a
    PS client sent each key once), so a sort does."""
    return np.sort(keys) if unique else np.unique(keys)


def _return_freed_memory() -> None:
    """Have glibc give freed heap memory back to the system past 1 MiB. Its default threshold grows
    to the largest block freed so far, so the index's merged copies (tens of MiB) stayed in the
    process: 43 MiB of RSS growth where the tiers held 24, and 28 with this (1.1M rows, dim 9)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc: its own policy
        pass


def _link_or_copy(source: Path, target: Path) -> str:
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
        how = "link"
    except OSError:  # another filesystem, or one without hard links
        import shutil

        shutil.copyfile(source, target)
        how = "copy"
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return how
