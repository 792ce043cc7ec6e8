"""ps/device_table.py and ps/device_index.py: the GPU tier of a sparse table and its key index, here on
the CPU (the same tensor code a GPU runs). What it must keep: the rows and optimizer state the CPU store
(ps/_rows.c) computes, bit for bit, whether it holds every row or a cache 4x smaller than the table; no
row a batch in flight uses is evicted; the shards behind it get every changed row and count every batch
at a flush; the index finds every key it holds, and only those."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heterps_ray.ps.client import PSClient
from heterps_ray.ps.device_index import DeviceIndex
from heterps_ray.ps.device_table import DeviceTable
from heterps_ray.ps.shard import PSShard
from heterps_ray.ps.spec import TableSpec
from heterps_ray.ps.table import SparseTable

CPU = torch.device("cpu")


def _batches(seed: int, steps: int, batch: int = 48, slots: int = 4, vocabulary: int = 400):
    """Skewed keys (Zipf-like: many repeats within a batch, a long tail of new ones) and gradients."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = (rng.zipf(1.3, size=(batch, slots)) % vocabulary).astype(np.int64) * 7919 + 3
        yield keys, rng.normal(scale=0.5, size=(batch * slots, 3)).astype(np.float32)


def _train_both(spec: TableSpec, capacity: int, steps: int = 40):
    """The same pulls and pushes on a CPU store and on a device table in front of a hosted shard;
    returns (store, shard, device table, rows the two handed out differ at most)."""
    store = SparseTable(
        **{
            k: getattr(spec, k)
            for k in ("dim", "seed", "lr", "init_accumulator", "init_scale", "optimizer", "admit_after")
        }
    )
    shard = PSShard(0, 1, {"t": spec})
    client = PSClient([shard], hosted=True)
    table = DeviceTable(spec, CPU, capacity)
    worst = 0.0
    for step, (keys, grads) in enumerate(_batches(5, steps)):
        expected = store.pull(keys.ravel(), step=step)
        batch = table.resolve(table.dedupe(keys), client, "t", step)
        got = table.gather(batch).reshape(-1, spec.dim).numpy()
        worst = max(worst, float(np.abs(got - expected).max()))
        store.push(keys.ravel(), grads)
        table.apply(batch, torch.from_numpy(grads), (0, step, 0))
    table.flush(client, "t")
    return store, shard, table, worst


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("admit_after", [1, 2])
def test_all_rows_in_device_memory_train_what_the_cpu_store_trains(optimizer, admit_after):
    spec = TableSpec(
        dim=3,
        seed=4,
        lr=0.3,
        init_accumulator=0.01,
        init_scale=0.1,
        optimizer=optimizer,
        admit_after=admit_after,
    )
    store, shard, table, worst = _train_both(spec, capacity=100_000)
    assert worst == 0.0  # every pull, bit for bit
    mine, theirs = shard.state(), store.state()
    for field in ("keys", "weights", "accumulators"):
        np.testing.assert_array_equal(mine[f"sparse/t/{field}"], theirs[field])
    assert table.stats.evicted == 0 and table.stats.hits > table.stats.misses


def test_a_cache_four_times_smaller_than_the_table_trains_the_same_rows():
    spec = TableSpec(dim=3, seed=4, lr=0.3, init_accumulator=0.01, init_scale=0.1, admit_after=2)
    store, _, whole_table, _ = _train_both(spec, capacity=100_000)
    rows = len(store)
    store, shard, cache, worst = _train_both(spec, capacity=rows // 4)
    assert worst == 0.0
    mine, theirs = shard.state(), store.state()
    for field in ("keys", "weights", "accumulators"):
        np.testing.assert_array_equal(mine[f"sparse/t/{field}"], theirs[field])
    assert cache.stats.evicted > 0 and len(cache) <= rows // 4
    # a smaller cache serves fewer lookups from the device, more than nothing
    assert 0.3 < cache.stats.hit_rate < whole_table.stats.hit_rate


def test_a_flush_counts_every_batch_on_every_shard_and_writes_back_what_changed():
    spec = TableSpec(dim=2, seed=1)
    shards = [PSShard(i, 2, {"t": spec}) for i in range(2)]
    client = PSClient(shards, hosted=True)
    table = DeviceTable(spec, CPU, 1000)
    keys = np.arange(10, dtype=np.int64)
    for batch in range(3):
        resolved = table.resolve(table.dedupe(keys), client, "t", batch)
        table.apply(resolved, torch.ones(10, 2), (0, batch, 0))
    before = [s.state() for s in shards]
    table.flush(client, "t")

    def counts(shard: PSShard) -> list[int]:
        return np.trim_zeros(shard.applied()[0], "b").tolist()

    for shard, old in zip(shards, before, strict=True):
        assert counts(shard) == [1, 1, 1]
        new = shard.state()
        assert not np.array_equal(new["sparse/t/weights"], old["sparse/t/weights"])
    assert table.stats.written_back == 10
    table.flush(client, "t")  # nothing changed since: nothing written, nothing counted twice
    assert table.stats.written_back == 10 and all(counts(s) == [1, 1, 1] for s in shards)


def test_a_flush_of_an_older_generation_is_dropped_whole():
    spec = TableSpec(dim=2)
    shard = PSShard(0, 1, {"t": spec})
    client = PSClient([shard], hosted=True)
    table = DeviceTable(spec, CPU, 100)
    resolved = table.resolve(table.dedupe(np.arange(4, dtype=np.int64)), client, "t", 0)
    table.apply(resolved, torch.ones(4, 2), (0, 0, 0))
    shard.fence(1)  # a recovery happened meanwhile
    before = shard.state()["sparse/t/weights"]
    table.flush(client, "t")
    np.testing.assert_array_equal(shard.state()["sparse/t/weights"], before)
    assert shard.applied() == {}


def test_a_batch_bigger_than_the_cache_is_refused_with_the_figures():
    spec = TableSpec(dim=2)
    client = PSClient([PSShard(0, 1, {"t": spec})], hosted=True)
    table = DeviceTable(spec, CPU, 5)
    with pytest.raises(RuntimeError, match="holds 5 rows and one batch needs 8"):
        table.resolve(table.dedupe(np.arange(8, dtype=np.int64)), client, "t", 0)


def test_rows_a_batch_in_flight_uses_are_not_evicted_and_freed_slots_are_reused():
    """Async: a batch's rows stay pinned from its pull to its push, so the pulls of later batches
    that need room evict other rows; slots given back are reused, never past the capacity."""
    spec = TableSpec(dim=2)
    client = PSClient([PSShard(0, 1, {"t": spec})], hosted=True)
    table = DeviceTable(spec, CPU, 8)
    first = table.resolve(table.dedupe(np.arange(4, dtype=np.int64)), client, "t", 0)
    held = table.gather(first).clone()
    for step in range(1, 6):  # 4 new keys each: the 4 unpinned rows go, never the first batch's
        later = table.resolve(table.dedupe(np.arange(4, dtype=np.int64) + 10 * step), client, "t", step)
        table.apply(later, torch.ones(4, 2))
    torch.testing.assert_close(table.gather(first), held, rtol=0, atol=0)
    assert table.stats.evicted > 0 and len(table) <= 8 and table._used <= 8 + 1
    table.apply(first, torch.ones(4, 2))
    with pytest.raises(RuntimeError, match="holds 8 rows and one batch needs 12"):
        pinned = table.resolve(table.dedupe(np.arange(4, dtype=np.int64) + 1000), client, "t", 9)
        table.resolve(table.dedupe(np.arange(8, dtype=np.int64) + 2000), client, "t", 10)
    table.release(pinned)


@pytest.mark.parametrize("compact", [True, False], ids=["cpu-rounds", "gpu-rounds"])
def test_the_key_index_finds_every_key_it_holds_through_inserts_removals_and_growth(compact):
    """Keys from the whole int64 range and small dense ones, inserted, looked up and removed in
    batches as a dict would; both ways of probing (gathering out the keys found each round on the
    CPU, a fixed number of rounds for every key on a GPU) answer the same."""
    rng = np.random.default_rng(0)
    index = DeviceIndex(CPU)
    index._compact = compact
    truth: dict[int, int] = {}
    for step in range(60):
        if step % 2:
            raw = rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
        else:
            raw = rng.integers(0, 30_000, 3000).astype(np.int64)
        keys = torch.unique(torch.from_numpy(raw))
        expected = torch.tensor([truth.get(int(k), -1) for k in keys])
        assert torch.equal(index.lookup(keys), expected), step
        new = keys[expected < 0]
        slots = torch.arange(len(new)) + 10 * step * 3000
        index.insert(new, slots)
        truth.update(zip(new.tolist(), slots.tolist(), strict=True))
        if step % 5 == 4:
            gone = keys[: len(keys) // 3]
            index.remove(gone)
            for k in gone.tolist():
                truth.pop(k, None)
        assert len(index) == len(truth)
    held, slots = index.items()
    assert dict(zip(held.tolist(), slots.tolist(), strict=True)) == truth
    assert 2 * len(index) <= index.buckets
