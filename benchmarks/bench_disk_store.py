"""Benchmark: the design options of the disk tier (issue 42, BENCHMARKS.md "Tables"), on this disk.

1. Rows a RAM tier serves, on a Criteo-shaped dataset's key stream: the share of lookups that hit the
   most-used rows when RAM holds a quarter of the table's rows (a row cache), against the share that
   hits the most-used 4 KiB pages of the same bytes (the page cache over the row store's segments
   mapped from files, rows in first-seen order as the store places them).
2. Random row reads and appends, records of the table's row size: one pread each (the disk tier's
   store; with the file in the page cache, and with it dropped before each batch by
   ``posix_fadvise(DONTNEED)``) at each number of reads in flight (``--depths``: threads of pread,
   the store's ``table.disk_reads_in_flight``), SQLite (the embedded store in the standard library:
   batched ``SELECT ... WHERE key IN``, ``INSERT OR REPLACE``), and with ``--rocksdict`` RocksDB
   (``pip install -e .[bench]``) set up as FBGEMM's SSD tables set it: raw bytes, no compression, no
   write-ahead log, 10-bit Bloom filters, no block cache of its own, one ``MultiGet`` a batch, warm and
   with its files dropped.

    .venv/bin/python benchmarks/bench_disk_store.py --data /tmp/ck1m --rows 2000000 --rocksdict
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import numpy as np
from heterps_ray.ps._rows import pread_records

from heterps_ray.data.dataset import Dataset
from heterps_ray.ps.row_bytes import row_bytes

PAGE = 4096
BATCH = 4096  # rows read per batch (a Criteo batch of 512 has ~3-4k distinct keys missing from RAM at most)


def hot_shares(keys: np.ndarray, record: int, ram_share: float) -> dict[str, float]:
    """Lookups served by the most-used rows (row cache) or the most-used pages (page cache) when RAM
    holds `ram_share` of the table's bytes."""
    uniq, first, counts = np.unique(keys, return_index=True, return_counts=True)
    row_of = np.empty(len(uniq), dtype=np.int64)
    row_of[np.argsort(first, kind="stable")] = np.arange(len(uniq))  # rows in first-seen order
    budget_rows = int(len(uniq) * ram_share)
    by_row = np.sort(counts)[::-1]
    per_page = PAGE // record
    page_counts = np.bincount(row_of // per_page, weights=counts)
    by_page = np.sort(page_counts)[::-1]
    budget_pages = max(1, budget_rows // per_page)
    total = counts.sum()
    return {
        "rows": len(uniq),
        "lookups": int(total),
        "row_cache_hit_share": round(float(by_row[:budget_rows].sum() / total), 4),
        "page_cache_hit_share": round(float(by_page[:budget_pages].sum() / total), 4),
        "pages_with_a_top_row": round(
            float(len(np.unique(row_of[np.argsort(counts)[::-1][:budget_rows]] // per_page)) / len(by_page)),
            4,
        ),
    }


def drop_from_page_cache(paths: list[Path]) -> None:
    """The files' pages out of the page cache: the next read goes to the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def pread_rates(path: Path, n: int, record: int, batches: int, cold: bool, depth: int) -> float:
    """Rows/s of the disk tier's read (sorted offsets, `depth` reads in flight, no read-ahead)."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the store opens its file (ps/disk_tier.py)
    if not cold:  # the whole file into the page cache first (a cold run before may have dropped it)
        with open(path, "rb") as whole:
            while whole.read(1 << 24):
                pass
    rng = np.random.default_rng(0)
    out = np.empty(BATCH * record, dtype=np.uint8)
    spent = 0.0
    for _ in range(batches):
        offsets = np.sort(rng.integers(0, n, BATCH)) * record
        if cold:
            drop_from_page_cache([path])
        start = time.perf_counter()
        pread_records(fd, offsets, out, depth)
        spent += time.perf_counter() - start
    os.close(fd)
    return BATCH * batches / spent


def one_at_a_time_rate(path: Path, n: int, record: int, batches: int) -> float:
    """Rows/s of the store before reads in flight, cold: one ``os.pread`` a record, each waiting for the
    device before the next starts (Python's call costs nothing beside the device's wait)."""
    fd = os.open(path, os.O_RDONLY)
    rng = np.random.default_rng(0)
    spent = 0.0
    for _ in range(batches):
        offsets = np.sort(rng.integers(0, n, BATCH)) * record
        drop_from_page_cache([path])
        start = time.perf_counter()
        for offset in offsets.tolist():
            os.pread(fd, record, offset)
        spent += time.perf_counter() - start
    os.close(fd)
    return BATCH * batches / spent


def rocksdict_rates(folder: Path, n: int, record: int, batches: int) -> dict[str, float]:
    """RocksDB through rocksdict, as FBGEMM's SSD embedding tables configure it: raw 8-byte keys and the
    record as the value, no compression, no write-ahead log, 10-bit Bloom filters; one MultiGet of a
    batch's keys (sorted), warm and with the database's files dropped from the page cache first."""
    from rocksdict import BlockBasedOptions, DBCompressionType, Options, Rdict, WriteBatch, WriteOptions

    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.set_compression_type(DBCompressionType.none())
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.disable_cache()  # the page cache is its only cache, as for the store's file: cold is cold
    options.set_block_based_table_factory(table)
    no_wal = WriteOptions()
    no_wal.disable_wal = True
    db = Rdict(str(folder / "rocksdb"), options)
    value = bytes(record)
    start = time.perf_counter()
    for first in range(0, n, 100_000):
        batch = WriteBatch(raw_mode=True)
        for key in range(first, min(first + 100_000, n)):
            batch.put(key.to_bytes(8, "big"), value)
        db.write(batch, no_wal)
    db.flush()
    db.compact_range(None, None)  # one sorted run, as a long-lived table's files settle
    write = n / (time.perf_counter() - start)
    files = list((folder / "rocksdb").glob("*.sst"))
    result = {"rocksdict_write_rows_per_s": round(write)}
    for cold in (False, True):
        for path in files if not cold else []:  # warm: its files in the page cache first
            path.read_bytes()
        rng = np.random.default_rng(0)
        spent = 0.0
        for _ in range(batches):
            keys = [int(k).to_bytes(8, "big") for k in np.sort(rng.integers(0, n, BATCH))]
            if cold:
                drop_from_page_cache(files)
            start = time.perf_counter()
            got = db.get(keys)
            spent += time.perf_counter() - start
            assert all(v is not None for v in got)
        result[f"rocksdict_{'cold' if cold else 'warm'}_rows_per_s"] = round(BATCH * batches / spent)
    db.close()
    return result


def sqlite_rates(folder: Path, n: int, record: int, batches: int) -> dict[str, float]:
    db = sqlite3.connect(folder / "rows.sqlite")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("CREATE TABLE rows (key INTEGER PRIMARY KEY, rec BLOB)")
    blob = bytes(record)
    start = time.perf_counter()
    db.executemany("INSERT OR REPLACE INTO rows VALUES (?, ?)", ((i, blob) for i in range(n)))
    db.commit()
    write = n / (time.perf_counter() - start)
    rng = np.random.default_rng(0)
    spent = 0.0
    for _ in range(batches):
        keys = rng.integers(0, n, BATCH).tolist()
        start = time.perf_counter()
        for i in range(0, BATCH, 500):  # SQLite's bound-parameter limit
            part = keys[i : i + 500]
            db.execute(
                f"SELECT key, rec FROM rows WHERE key IN ({','.join('?' * len(part))})", part
            ).fetchall()
        spent += time.perf_counter() - start
    db.close()
    return {"sqlite_read_rows_per_s": round(BATCH * batches / spent), "sqlite_write_rows_per_s": round(write)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", type=Path, required=True, help="a Criteo-shaped dataset (heterps data synth)"
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows in the read/write files")
    parser.add_argument("--dim", type=int, default=9)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument(
        "--depths", default="1,16,32,64", help="reads in flight to measure the store's reads at (comma-separated)"
    )
    parser.add_argument("--rocksdict", action="store_true", help="also RocksDB through rocksdict (.[bench])")
    args = parser.parse_args()
    record = row_bytes(args.dim, tracked=True)
    keys = Dataset(args.data).load("train")["keys"].ravel()
    result: dict[str, object] = {"record_bytes": record, **hot_shares(keys, record, 0.25)}
    folder = Path(tempfile.mkdtemp(prefix="disk-store-", dir="/tmp"))
    path = folder / "rows.dat"
    data = np.random.default_rng(1).integers(0, 255, args.rows * record, dtype=np.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    start = time.perf_counter()
    for i in range(0, len(data), 1 << 24):
        os.pwrite(fd, data[i : i + (1 << 24)].data, i)
    os.fsync(fd)
    result["append_mb_per_s"] = round(len(data) / 2**20 / (time.perf_counter() - start))
    os.close(fd)
    for depth in (int(d) for d in args.depths.split(",")):
        for cold in (False, True):
            rate = pread_rates(path, args.rows, record, args.batches, cold, depth)
            result[f"pread_{'cold' if cold else 'warm'}_depth{depth}_rows_per_s"] = round(rate)
    result["pread_cold_one_at_a_time_rows_per_s"] = round(one_at_a_time_rate(path, args.rows, record, args.batches))
    result.update(sqlite_rates(folder, args.rows, record, args.batches))
    if args.rocksdict:
        result.update(rocksdict_rates(folder, args.rows, record, args.batches))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
