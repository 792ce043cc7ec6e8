"""ps/device_table.py: the GPU tier of a sparse table, here on the CPU (the same tensor code a GPU runs).
What it must keep: the rows and optimizer state the CPU store (ps/_rows.c) computes, bit for bit, whether
it holds every row or a cache 4x smaller than the table; the shards behind it get every changed row and
count every batch at a flush."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heterps_ray.ps.client import PSClient
from heterps_ray.ps.device_table import DeviceTable, KeyIndex
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
        slots = table.resolve(keys, table.locate(keys), client, "t", step)
        got = table.gather(torch.from_numpy(slots), step).numpy()
        worst = max(worst, float(np.abs(got - expected).max()))
        store.push(keys.ravel(), grads)
        table.apply(torch.from_numpy(slots), torch.from_numpy(grads), (0, step, 0))
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
        slots = table.resolve(keys, None, client, "t", batch)
        table.apply(torch.from_numpy(slots), torch.ones(10, 2), (0, batch, 0))
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
    slots = table.resolve(np.arange(4, dtype=np.int64), None, client, "t", 0)
    table.apply(torch.from_numpy(slots), torch.ones(4, 2), (0, 0, 0))
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
        table.resolve(np.arange(8, dtype=np.int64), None, client, "t", 0)


def test_the_key_index_reuses_freed_slots_and_bumps_its_version():
    index = KeyIndex()
    slots = index.insert(np.array([10, 20, 30], dtype=np.int64))
    assert list(slots) == [0, 1, 2]
    found, version = index.lookup(np.array([20, 99], dtype=np.int64))
    assert list(found) == [1, -1] and version == 0
    index.remove(np.array([20], dtype=np.int64))
    assert index.version == 1 and list(index.insert(np.array([40], dtype=np.int64))) == [1]


def test_lookups_from_several_threads_beside_inserts_find_each_key_its_own_slot():
    """The reader threads look up while the training thread inserts: a lookup finds a key's slot or
    nothing, never another key's (each lookup runs without the GIL, with a buffer of its own)."""
    import threading

    index = KeyIndex()
    keys = np.arange(1, 200_001, dtype=np.int64) * 2654435761
    wrong: list[int] = []

    def read() -> None:
        for _ in range(30):
            slots, _ = index.lookup(keys)
            held = slots >= 0
            truth, _ = index.lookup(keys[held])  # inserts never move a held key
            wrong.append(int((truth != slots[held]).sum()))

    readers = [threading.Thread(target=read) for _ in range(3)]
    for r in readers:
        r.start()
    for part in np.array_split(keys, 50):
        index.insert(part)
    for r in readers:
        r.join()
    assert sum(wrong) == 0
    slots, _ = index.lookup(keys)
    assert sorted(slots.tolist()) == list(range(len(keys)))
