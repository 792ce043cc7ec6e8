"""The disk tier (ps/disk_tier.py): a table whose rows beyond its RAM budget live on local disk trains
bit for bit as the all-in-RAM table, a row read back equals the row written, and snapshots (full,
deltas, a checkpoint that never commits) rebuild it exactly, into a table with or without a disk tier."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from heterps_ray.ps._rows import pread_records

from heterps_ray.config import TableConfig
from heterps_ray.errors import ConfigError
from heterps_ray.ps.disk_tier import DiskRows, record_dtype
from heterps_ray.ps.shard import PSShard
from heterps_ray.ps.spec import TableSpec
from heterps_ray.ps.table import SparseTable

DIM, VOCAB, RAM_ROWS = 6, 20_000, 400
# these tables are 10-15x over their RAM budget: the index of their rows on disk outgrows it (said once)
pytestmark = pytest.mark.filterwarnings("ignore:.*takes most of the RAM budget:UserWarning")


def _skewed(rng: np.random.Generator, n: int = 300) -> np.ndarray:
    """Zipf-like keys: a few hot, most cold (as CTR data's), so a small RAM tier serves most lookups."""
    return (rng.zipf(1.3, size=n) % VOCAB).astype(np.int64)


def _trained_shard(disk: Path, seed: int, steps: int) -> tuple[PSShard, np.random.Generator]:
    """A one-table shard with a disk tier under `disk`, trained `steps` calls on skewed keys; and its
    random generator, to go on with."""
    shard = PSShard(0, 1, {"e": TableSpec(dim=DIM, ram_rows=RAM_ROWS, disk_dir=str(disk))})
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        keys = _skewed(rng)
        shard.pull("e", keys, step=step)
        shard.push("e", keys, rng.standard_normal((len(keys), DIM)).astype(np.float32))
    return shard, rng


def _train_pair(a: SparseTable, b: SparseTable, steps: range, seed: int = 0) -> None:
    """The same calls on both tables; every pull must agree exactly."""
    rng = np.random.default_rng(seed)
    for step in steps:
        keys = _skewed(rng)
        np.testing.assert_array_equal(a.pull(keys, step=step), b.pull(keys, step=step), err_msg=f"step {step}")
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        assert a.push(keys, grads) == b.push(keys, grads)
        if step % 10 == 0:  # evaluation reads rows on disk without bringing them into RAM
            probe = rng.integers(0, VOCAB, 200)
            in_ram = len(b._rows)
            np.testing.assert_array_equal(a.pull(probe, create=False), b.pull(probe, create=False))
            assert len(b._rows) == in_ram


def _assert_same_state(a: SparseTable, b: SparseTable) -> None:
    sa, sb = a.state(), b.state()
    for name in ("keys", "weights", "accumulators"):
        np.testing.assert_array_equal(sb[name], sa[name], err_msg=name)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("admit_after", [1, 2])
def test_a_table_over_its_ram_budget_trains_exactly_as_all_in_ram(tmp_path, optimizer, admit_after):
    a = SparseTable(dim=DIM, seed=3, optimizer=optimizer, admit_after=admit_after)
    b = SparseTable(
        dim=DIM, seed=3, optimizer=optimizer, admit_after=admit_after, ram_rows=RAM_ROWS, disk_dir=str(tmp_path)
    )
    with pytest.warns(UserWarning, match="takes most of the RAM budget"):
        _train_pair(a, b, range(1, 150))
    assert len(b) == len(a)
    assert b.disk is not None and len(b.disk) > 2 * RAM_ROWS  # most rows are on disk
    assert len(b._rows) <= RAM_ROWS
    stats = b.disk.stats
    assert stats.misses > 0 and stats.evicted == stats.written_back > 0
    assert stats.hit_rate is not None and stats.hit_rate > 0.5  # skewed keys: most lookups hit RAM
    _assert_same_state(a, b)


@pytest.mark.parametrize("evict", ["lru", "lfu"])
def test_a_row_read_back_from_disk_equals_the_row_written(tmp_path, evict):
    table = SparseTable(dim=DIM, seed=1, ram_rows=64, disk_dir=str(tmp_path), evict=evict)
    keys = np.arange(1_000, dtype=np.int64)
    table.pull(keys[:500], step=1)
    table.push(keys[:500], np.full((500, DIM), 0.5, np.float32))
    before = table.state()
    table.pull(keys[500:], step=2)  # the first 500 rows leave for disk
    assert table.disk is not None and len(table.disk) >= 500 - 64
    found = table.state()
    i = np.searchsorted(found["keys"], before["keys"])
    for name in ("weights", "accumulators", "counts", "last_seen"):
        np.testing.assert_array_equal(found[name][i], before[name], err_msg=name)
    # and read back into RAM by a pull, each is its record: exactly the rows of a table never spilled
    fresh = SparseTable(dim=DIM, seed=1)
    fresh.pull(keys[:500], step=1)
    fresh.push(keys[:500], np.full((500, DIM), 0.5, np.float32))
    np.testing.assert_array_equal(table.pull(keys[:500], step=3), fresh.pull(keys[:500], step=3))


def test_two_jobs_given_one_disk_dir_keep_their_rows_apart(tmp_path):
    """Each job's shards keep their files in a folder of the job's own under disk_dir (its name and its
    output_dir): a second job starting there unlinks nothing of the first, and both read back their
    own rows."""
    from helpers import tiny_sync_job

    from heterps_ray.ps.spec import sparse_spec

    def job(name: str, out: str):
        base = tiny_sync_job(name, tmp_path / "data", tmp_path / out)
        disk = {"disk_dir": str(tmp_path / "disk"), "ram_mb": 0.01, "admit_after": 1}
        return base.model_copy(update={"table": base.table.model_copy(update=disk)})

    specs = [sparse_spec(j, DIM, 0.01).for_shard(0, 1, "embedding") for j in (job("a", "out-a"), job("a", "out-b"))]
    assert specs[0].disk_dir != specs[1].disk_dir
    assert all(Path(s.disk_dir).is_relative_to(tmp_path / "disk") for s in specs)
    keys = np.arange(2_000, dtype=np.int64)
    tables = []
    for i, spec in enumerate(specs):  # the second starts after the first spilled to its file
        table = SparseTable(**asdict(spec))
        table.pull(keys, step=1)
        table.push(keys, np.full((len(keys), DIM), 0.5 * (i + 1), np.float32))
        table.pull(keys + 10_000, step=2)  # the rows above leave for disk
        tables.append(table)
    for i, table in enumerate(tables):
        assert table.disk is not None and len(table.disk) > 0
        fresh = SparseTable(**{**asdict(specs[i]), "disk_dir": "", "ram_rows": 0})  # all in RAM
        fresh.pull(keys, step=1)
        fresh.push(keys, np.full((len(keys), DIM), 0.5 * (i + 1), np.float32))
        np.testing.assert_array_equal(table.pull(keys, step=3), fresh.pull(keys, step=3))


def test_a_full_disk_is_a_clear_error_and_the_last_snapshot_restores(tmp_path):
    """ENOSPC while rows leave for disk: a StorageError names the file, the bytes and what to do; the
    snapshot taken before (its rows on disk hard-linked) still restores the shard as it was. The full
    disk is the kernel's own: the tier's file descriptor is pointed at /dev/full, whose every write
    fails with ENOSPC."""
    import os

    from heterps_ray.errors import StorageError

    shard, rng = _trained_shard(tmp_path / "disk", seed=3, steps=39)
    snapshot = tmp_path / "last.npz"
    shard.snapshot(str(snapshot))
    shard.snapshot_durable()
    saved = shard.state()

    rows = shard._tables["e"].disk
    assert rows is not None
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, rows.disk._fd)  # the snapshot's hard link keeps the file's rows
    os.close(full)
    with pytest.raises(StorageError, match="the disk of table.disk_dir is full: .* B of rows to write") as err:
        for step in range(40, 80):
            shard.pull("e", _skewed(rng) + 10**9, step=step)  # new keys: rows must leave for disk
    assert re.search(r"rows\.\d+\.dat", str(err.value)) and "--resume" in str(err.value) and "table.ram_mb" in str(err.value)
    rebuilt = PSShard(0, 1, {"e": TableSpec(dim=DIM, ram_rows=RAM_ROWS, disk_dir=str(tmp_path / "again"))})
    rebuilt.restore(str(snapshot))
    again = rebuilt.state()
    for name in ("sparse/e/keys", "sparse/e/weights", "sparse/e/accumulators"):
        np.testing.assert_array_equal(again[name], saved[name], err_msg=name)


def test_the_tiers_hits_and_misses_count_key_lookups_as_the_gpu_tiers_do(tmp_path):
    """A hit is a lookup whose row was in RAM, a miss one whose row was not (on disk, or new), each
    repeat of a key a lookup; rows read back from disk are counted apart (fetched)."""
    table = SparseTable(dim=DIM, seed=1, ram_rows=64, disk_dir=str(tmp_path))
    first = np.repeat(np.arange(100, dtype=np.int64), 2)  # 100 new keys, each looked up twice
    table.pull(first, step=1)
    stats = table.stats()
    assert (stats["disk_hits"], stats["disk_misses"], stats["disk_fetched"]) == (0, 200, 0)
    table.pull(np.arange(100, 300, dtype=np.int64), step=2)  # the first 100 rows leave for disk
    on_disk = int(table.stats()["disk_rows"])
    assert on_disk >= 100
    again = np.concatenate([np.arange(10, dtype=np.int64)] * 3)  # 10 rows on disk, 3 lookups each
    table.pull(again, step=3)
    stats = table.stats()
    assert stats["disk_hits"] + stats["disk_misses"] == 200 + 200 + 30
    assert stats["disk_fetched"] == 10 and stats["disk_misses"] == 200 + 200 + 30
    table.pull(again, step=4)  # now in RAM: 30 hits
    assert table.stats()["disk_hits"] == 30


def test_the_tier_above_writes_back_rows_that_were_spilled_since_it_fetched_them(tmp_path):
    a = SparseTable(dim=DIM, seed=2)
    b = SparseTable(dim=DIM, seed=2, ram_rows=100, disk_dir=str(tmp_path))
    keys = np.arange(80, dtype=np.int64)
    wa, acc_a, _ = a.fetch(keys, step=1)
    wb, acc_b, _ = b.fetch(keys, step=1)
    np.testing.assert_array_equal(wa, wb)
    b.pull(np.arange(1_000, 1_200), step=2)  # another call's pull spills the fetched rows
    assert b.disk is not None and len(b.disk) > 0
    assert a.put(keys, wa + 1, acc_a + 1) == b.put(keys, wb + 1, acc_b + 1) == 0
    a.pull(np.arange(1_000, 1_200), step=2)
    _assert_same_state(a, b)


def test_compaction_keeps_the_live_rows_and_drops_the_dead_records(tmp_path):
    rows = DiskRows(tmp_path, record_dtype(DIM, DIM))
    records = np.zeros(1_000, dtype=rows.dtype)
    records["key"] = np.arange(1_000)
    records["w"] = np.arange(1_000)[:, None]
    for _ in range(4):  # the same keys written again: the older records are dead
        rows.write(records)
    rows.forget(rows.find(np.arange(500))[0])
    old = rows.path
    rows.compact()
    assert not old.exists() and rows.records == rows.live_count == 500
    pos, live = rows.find(np.arange(1_000))
    assert not live[:500].any() and live[500:].all()
    np.testing.assert_array_equal(rows.read(pos[500:])["w"][:, 0], np.arange(500, 1_000))


def test_reads_in_flight_hand_back_each_record_in_the_order_asked(tmp_path):
    """A read splits its records over threads in the file's order; what comes back is in the caller's
    order, equal to one pread at a time, and a record past the file's end is an error named by offset."""
    rows = DiskRows(tmp_path, record_dtype(DIM, DIM))
    records = np.zeros(5_000, dtype=rows.dtype)
    records["key"] = np.arange(5_000) * 7
    records["w"] = np.arange(5_000)[:, None] * 0.5
    rows.write(records)
    asked = np.random.default_rng(0).permutation(5_000)[:3_000] * 7
    pos, live = rows.find(asked)
    assert live.all()
    got = rows.read(pos)
    np.testing.assert_array_equal(got["key"], asked)
    np.testing.assert_array_equal(got["w"][:, 0], asked / 7 * 0.5)
    offsets = rows.slots[pos].astype(np.int64) * rows.dtype.itemsize
    one, many = (np.empty(len(pos), dtype=rows.dtype) for _ in range(2))
    pread_records(rows._fd, offsets, one.view(np.uint8), 1)
    pread_records(rows._fd, offsets, many.view(np.uint8), 64)
    assert one.tobytes() == many.tobytes() == got.tobytes()
    past = offsets.copy()
    past[2_500] = rows.records * rows.dtype.itemsize  # the end of the file: a short read
    with pytest.raises(OSError, match=f"short read of record 2500 at offset {past[2_500]}"):
        pread_records(rows._fd, past, many.view(np.uint8), 64)
    with pytest.raises(ValueError, match="depth: expected at least 1"):
        pread_records(rows._fd, offsets, many.view(np.uint8), 0)


@pytest.mark.parametrize("rebuilt_on_disk", [True, False], ids=["into-disk-tier", "into-ram"])
def test_a_chain_of_snapshots_rebuilds_a_shard_with_rows_on_disk(tmp_path, rebuilt_on_disk):
    """Full, deltas, and one checkpoint that never commits (its rows stay pending); a spill is not a
    removal in a delta, and the rows written to disk since the last snapshot are in it."""
    spec = TableSpec(dim=DIM, ram_rows=RAM_ROWS, disk_dir=str(tmp_path / "disk"))
    shard = PSShard(0, 1, {"e": spec})
    rng = np.random.default_rng(4)

    def train(steps: range) -> None:
        for step in steps:
            keys = _skewed(rng)
            shard.pull("e", keys, step=step)
            shard.push("e", keys, rng.standard_normal((len(keys), DIM)).astype(np.float32))

    train(range(1, 30))
    links = []
    for i in range(4):
        path = str(tmp_path / f"link-{i}.npz")
        shard.snapshot(path, delta=i > 0)
        if i != 2:  # the third never commits
            shard.snapshot_durable()
            links.append(path)
        train(range(30 + 20 * i, 50 + 20 * i))
    final = str(tmp_path / "final.npz")
    shard.snapshot(final, delta=True)
    target = TableSpec(dim=DIM, ram_rows=RAM_ROWS, disk_dir=str(tmp_path / "again")) if rebuilt_on_disk else spec
    if not rebuilt_on_disk:
        target = TableSpec(dim=DIM)
    rebuilt = PSShard(0, 1, {"e": target})
    rebuilt.restore_chain([*links, final])
    live, again = shard.state(), rebuilt.state()
    for name in ("sparse/e/keys", "sparse/e/weights", "sparse/e/accumulators"):
        np.testing.assert_array_equal(again[name], live[name], err_msg=name)
    table = rebuilt._tables["e"]
    if rebuilt_on_disk:
        assert table.disk is not None and len(table._rows) <= RAM_ROWS and len(table.disk) > 0


def test_the_disk_tier_settings_are_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="table.ram_mb"):
        TableConfig(disk_dir="/tmp/rows")
    with pytest.raises(ConfigError, match="table.disk_dir"):
        TableConfig(ram_mb=64)
    with pytest.raises(ConfigError, match="table.disk_dir.*absolute"):
        TableConfig(disk_dir="rows", ram_mb=64)
    with pytest.raises(ConfigError, match="table.ttl_batches"):
        TableConfig(disk_dir="/tmp/rows", ram_mb=64, ttl_batches=10)
    with pytest.raises(ValueError, match="needs ram_rows >= 1"):
        SparseTable(dim=4, disk_dir="/tmp/rows")


def test_a_full_snapshot_links_the_rows_on_disk_instead_of_copying_them(tmp_path):
    """The rows on disk are hard-linked beside the snapshot (the same file, not a copy); training on
    and compacting the live file leave the snapshot's rows as they were; the link gone, the restore
    is refused naming the snapshot."""
    from heterps_ray.errors import DataError

    shard, rng = _trained_shard(tmp_path / "disk", seed=5, steps=59)
    table = shard._tables["e"]
    assert table.disk is not None
    live_file = table.disk.disk.path
    snapshot = tmp_path / "full.npz"
    shard.snapshot(str(snapshot))
    shard.snapshot_durable()
    link = tmp_path / "full.e.rows"
    assert link.stat().st_ino == live_file.stat().st_ino  # linked, not copied
    saved = shard.state()
    # the npz holds the rows in RAM only: a fraction of a snapshot that copies every row
    copied = tmp_path / "copied.npz"
    from heterps_ray.ps.atomic import write_npz_streamed

    write_npz_streamed(str(copied), table.row_members())
    assert snapshot.stat().st_size * 2 < copied.stat().st_size
    for step in range(60, 90):  # the live file grows and is compacted into a new one
        keys = _skewed(rng)
        shard.pull("e", keys, step=step)
        shard.push("e", keys, rng.standard_normal((len(keys), DIM)).astype(np.float32))
    table.disk.disk.compact()
    assert not live_file.exists() and link.exists()
    again_on_disk = TableSpec(dim=DIM, ram_rows=RAM_ROWS, disk_dir=str(tmp_path / "again"))
    for target in (again_on_disk, TableSpec(dim=DIM)):
        rebuilt = PSShard(0, 1, {"e": target})
        rebuilt.restore(str(snapshot))
        again = rebuilt.state()
        for name in ("sparse/e/keys", "sparse/e/weights", "sparse/e/accumulators"):
            np.testing.assert_array_equal(again[name], saved[name], err_msg=name)
    link.unlink()
    with pytest.raises(DataError, match="full.npz"):
        PSShard(0, 1, {"e": TableSpec(dim=DIM, ram_rows=RAM_ROWS, disk_dir=str(tmp_path / "disk"))}).restore(
            str(snapshot)
        )


def test_rows_leaving_for_disk_give_their_memory_back_and_deltas_still_hold(tmp_path):
    """When the RAM share shrinks (here set down by hand; in a run, as the index of the rows on disk
    grows), the row store moves its rows down and returns the segments above them; the moved rows
    are in the next delta, and a chain across the move rebuilds the table."""
    keys = np.arange(300_000, dtype=np.int64)
    shard = PSShard(0, 1, {"e": TableSpec(dim=4, ram_rows=400_000, disk_dir=str(tmp_path / "disk"))})
    plain = SparseTable(dim=4)
    grads = np.full((len(keys), 4), 0.25, np.float32)
    for table in (shard._tables["e"], plain):
        table.pull(keys, step=1)
        table.push(keys, grads)
    table = shard._tables["e"]
    shard.snapshot(str(tmp_path / "full.npz"))
    shard.snapshot_durable()
    before = table.nbytes
    assert table.disk is not None
    table.disk.ram_rows = 20_000
    for t in (table, plain):
        t.pull(keys[:1_000], step=2)
        t.push(keys[:1_000], grads[:1_000])
    assert len(table._rows) <= 20_000 and table.nbytes * 4 < before
    _assert_same_state(plain, table)
    shard.snapshot(str(tmp_path / "delta.npz"), delta=True)
    rebuilt = PSShard(0, 1, {"e": TableSpec(dim=4)})
    rebuilt.restore_chain([str(tmp_path / "full.npz"), str(tmp_path / "delta.npz")])
    _assert_same_state(plain, rebuilt._tables["e"])
