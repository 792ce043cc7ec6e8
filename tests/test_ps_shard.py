"""PS shards as real Ray actors: the documented key -> shard hash, sharded pull/push equal to one
table, dense tables with torch's Adam, and snapshots that round-trip without pickle."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from heterps_ray.config import TableConfig, load_job
from heterps_ray.ps.client import PSClient
from heterps_ray.ps.row_bytes import max_rows_for
from heterps_ray.ps.shard import PSShard, reshard_states, start_shards
from heterps_ray.ps.spec import TableSpec, shard_of, sparse_spec
from heterps_ray.ps.table import SparseTable

REPO = Path(__file__).resolve().parents[1]
SPEC = TableSpec(dim=4, seed=7, lr=0.05, init_accumulator=0.1, init_scale=0.01)
SHARD_OPTIONS = {"num_cpus": 0.25, "resources": {"cpu_small": 1.0}}

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """Plain-Python splitmix64 finaliser, written independently of the numpy one."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _kill(actors):
    import ray

    for a in actors:
        ray.kill(a)


def test_shard_of_follows_the_documented_hash_and_balances():
    keys = np.array([0, 1, -1, 2**62 + 12345, -(2**40)], dtype=np.int64)
    for n in (1, 2, 3, 4, 7):
        expected = [(_splitmix64((int(k) & _M64) ^ 0x5BA4D5A2E1F3C7B9) >> 32) % n for k in keys]
        assert shard_of(keys, n).tolist() == expected
    many = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, size=200_000, dtype=np.int64)
    counts = np.bincount(shard_of(many, 4), minlength=4)
    assert counts.min() > 0.23 * len(many) and counts.max() < 0.27 * len(many)
    # sequential keys (a worst case for weak hashes) spread too
    counts = np.bincount(shard_of(np.arange(100_000, dtype=np.int64) * 4, 4), minlength=4)
    assert counts.min() > 0.23 * 100_000


@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_sharded_pull_push_equals_one_table(ray_local, num_shards):
    rng = np.random.default_rng(num_shards)
    local = SparseTable(**vars(SPEC))
    shards = start_shards(num_shards, {"emb": SPEC}, SHARD_OPTIONS)
    try:
        client = PSClient(shards)
        for _ in range(5):
            keys = rng.integers(0, 300, size=(64, 26)).astype(np.int64) * 7919 - 10**6  # many repeats
            rows = client.pull("emb", keys)
            assert rows.shape == (64, 26, 4)
            np.testing.assert_array_equal(rows, local.pull(keys.ravel()).reshape(64, 26, 4))
            grads = rng.normal(size=(64, 26, 4)).astype(np.float32)
            ray_local.get(client.push("emb", keys, grads))
            local.push(keys.ravel(), grads.reshape(-1, 4))
        stats = client.stats()
        assert sum(s["rows"]["emb"] for s in stats) == len(local)
        assert all(s["pulls"] >= 1 and s["keys_per_s"] > 0 for s in stats)
        merged = {
            k: np.concatenate([st[f"sparse/emb/{k}"] for st in client.states()]) for k in ("keys", "weights")
        }
        order = np.argsort(merged["keys"])
        np.testing.assert_array_equal(merged["keys"][order], local.state()["keys"])
        np.testing.assert_allclose(merged["weights"][order], local.state()["weights"], rtol=0, atol=1e-7)
    finally:
        _kill(shards)


def test_one_hosted_shard_trains_its_table_exactly_like_the_reference_table():
    """The one-stage plan's PS (one shard in the DataWorker) takes a batch's keys whole, repeats and
    all: rows, counters and Adagrad state equal the reference trainer's one table bit for bit."""
    spec = TableSpec(dim=4, seed=5, admit_after=2)
    rng = np.random.default_rng(3)
    vocab = rng.integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64)
    client = PSClient([PSShard(0, 1, {"emb": spec})], hosted=True)
    local = SparseTable(**vars(spec))
    assert client.split(vocab[:10]) is None  # nothing split or de-duplicated before the shard
    for step in range(1, 21):
        keys = vocab[(rng.zipf(1.3, (32, 26)) - 1) % len(vocab)]  # many repeats in a batch
        rows = client.pull("emb", keys, step=step)
        np.testing.assert_array_equal(rows, local.pull(keys.ravel(), step=step).reshape(32, 26, 4))
        grads = rng.standard_normal((32, 26, 4)).astype(np.float32)
        assert client.push("emb", keys, grads, (0, step, 0)) == []
        local.push(keys.ravel(), grads.reshape(-1, 4))
    (state,) = client.states()
    for name, value in local.state().items():
        np.testing.assert_array_equal(state[f"sparse/emb/{name}"], value, err_msg=name)
    assert client.shards[0].applied()[0][1:21].tolist() == [1] * 20


def test_pull_without_create_stores_nothing(ray_local):
    shards = start_shards(2, {"emb": SPEC}, SHARD_OPTIONS)
    try:
        client = PSClient(shards)
        keys = np.arange(50, dtype=np.int64)
        first = client.pull("emb", keys, create=False)
        assert sum(s["rows"]["emb"] for s in client.stats()) == 0
        np.testing.assert_array_equal(first, client.pull("emb", keys))  # same initial rows
        assert sum(s["rows"]["emb"] for s in client.stats()) == 50
    finally:
        _kill(shards)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_dense_table_steps_like_torch(optimizer):
    rng = np.random.default_rng(1)
    params = {
        "fc1.linear.weight": rng.normal(size=(5, 3)).astype(np.float32),
        "fc1.linear.bias": np.zeros(5, np.float32),
    }
    torch_params = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    opt_cls = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    torch_opt = opt_cls(list(torch_params.values()), lr=0.01)
    shard = PSShard(0, 1, {"emb": SPEC})  # the actor's class, called in-process: pure arithmetic
    assert shard.register_dense("stage1", params, optimizer, 0.01) == 0
    for step in range(1, 6):
        grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
        assert shard.push_dense("stage1", grads) == (step, None)
        for k, p in torch_params.items():
            p.grad = torch.from_numpy(grads[k])
        torch_opt.step()
    version, pulled = shard.pull_dense("stage1")
    assert version == 5
    for k, p in torch_params.items():
        np.testing.assert_allclose(pulled[k], p.detach().numpy(), rtol=1e-5, atol=1e-7)


def test_snapshot_restores_rows_and_optimizer_state_without_pickle(ray_local, tmp_path):
    rng = np.random.default_rng(2)
    shards = start_shards(2, {"emb": SPEC}, SHARD_OPTIONS)
    fresh = start_shards(2, {"emb": SPEC}, SHARD_OPTIONS)
    try:
        client = PSClient(shards)
        keys = rng.integers(0, 10_000, size=(32, 26)).astype(np.int64)
        client.pull("emb", keys)
        ray_local.get(client.push("emb", keys, rng.normal(size=(32, 26, 4)).astype(np.float32)))
        ray_local.get(shards[0].register_dense.remote("stage1", {"w": np.ones(3, np.float32)}, "adam", 0.1))
        ray_local.get(shards[0].push_dense.remote("stage1", {"w": np.ones(3, np.float32)}))
        reports = ray_local.get(
            [s.snapshot.remote(str(tmp_path / f"shard{i}.npz")) for i, s in enumerate(shards)]
        )
        paths = [str(tmp_path / r["file"]) for r in reports]
        for report, path in zip(reports, paths, strict=True):  # what the shard wrote, as it reports it
            assert report["sha256"] == hashlib.sha256(Path(path).read_bytes()).hexdigest()
            assert report["node"] == ray_local.get_runtime_context().get_node_id()
        with np.load(paths[0], allow_pickle=False) as data:  # plain arrays only
            assert "sparse/emb/keys" in data.files and "dense/stage1/exp_avg/w" in data.files
        ray_local.get(fresh[0].register_dense.remote("stage1", {"w": np.zeros(3, np.float32)}, "adam", 0.1))
        ray_local.get([s.restore.remote(p) for s, p in zip(fresh, paths, strict=True)])
        restored = PSClient(fresh)
        np.testing.assert_array_equal(restored.pull("emb", keys), client.pull("emb", keys))
        grads = rng.normal(size=(32, 26, 4)).astype(np.float32)
        ray_local.get(client.push("emb", keys, grads) + restored.push("emb", keys, grads))  # accumulators too
        np.testing.assert_array_equal(restored.pull("emb", keys), client.pull("emb", keys))
        v_old, w_old = ray_local.get(shards[0].pull_dense.remote("stage1"))
        v_new, w_new = ray_local.get(fresh[0].pull_dense.remote("stage1"))
        assert v_old == v_new == 1
        np.testing.assert_array_equal(w_old["w"], w_new["w"])
    finally:
        _kill(shards + fresh)


def test_state_of_another_shard_is_refused():
    a, b = PSShard(0, 2, {"emb": SPEC}), PSShard(1, 2, {"emb": SPEC})
    with pytest.raises(ValueError, match="shard 0/2"):
        b.load_state(a.state())


def _table_union(states, table="emb"):
    """Every row field and every waiting key of one table over all shard states, sorted by key."""
    prefix = f"sparse/{table}/"
    out = {}
    for group in ("", "candidate_"):
        names = sorted(
            {k[len(prefix) :] for st in states for k in st if k.startswith(prefix + group)} - {"step"}
        )
        names = [n for n in names if group or not n.startswith("candidate_")]
        order = np.argsort(np.concatenate([st[prefix + group + "keys"] for st in states]))
        for name in names:
            out[name] = np.concatenate([st[prefix + name] for st in states])[order]
    return out


def test_resharding_keeps_admission_counters_waiting_keys_and_the_clock():
    spec = TableSpec(dim=4, seed=3, admit_after=2, ttl=50)
    rng = np.random.default_rng(6)
    vocab = rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
    batches = [(step, vocab[(rng.zipf(1.3, (16, 26)) - 1) % len(vocab)]) for step in range(1, 31)]
    grads = rng.standard_normal((16, 26, 4)).astype(np.float32)
    old = PSClient([PSShard(i, 2, {"emb": spec}) for i in range(2)], hosted=True)
    for step, keys in batches[:15]:
        old.pull("emb", keys, step=step)
        old.push("emb", keys, grads)
    states = old.states()
    new = PSClient([PSShard(i, 3, {"emb": spec}) for i in range(3)], hosted=True)
    for shard, state in zip(new.shards, reshard_states(states, 3), strict=True):
        shard.load_state(state)
    before, after = _table_union(states), _table_union(new.states())
    assert set(before) >= {"keys", "counts", "last_seen", "candidate_keys", "candidate_counts"}
    assert len(before["candidate_keys"]) > 0 and before["counts"].max() > 2
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert all(int(st["sparse/emb/step"]) == 15 for st in new.states())
    for step, keys in batches[15:]:  # both layouts go on alike: the counters came along
        np.testing.assert_array_equal(new.pull("emb", keys, step=step), old.pull("emb", keys, step=step))
        old.push("emb", keys, grads)
        new.push("emb", keys, grads)
    final_old, final_new = _table_union(old.states()), _table_union(new.states())
    for name in final_old:
        np.testing.assert_array_equal(final_new[name], final_old[name], err_msg=name)


def test_job_table_settings_become_the_table_spec_and_admit_at_the_second_batch_by_default():
    job = load_job(REPO / "configs" / "jobs" / "quickstart.yaml")
    assert job.table == TableConfig()
    default = sparse_spec(job, dim=9, init_scale=0.01)  # BENCHMARKS.md "Admission" chose admit_after 2
    assert (default.admit_after, default.ttl, default.max_rows) == (2, 0, 0)
    plain = sparse_spec(job.model_copy(update={"table": TableConfig(admit_after=1)}), dim=9, init_scale=0.01)
    assert SparseTable(**vars(plain)).tracked is False  # admission off: no counters, as before
    assert default.lr == job.optimizer.sparse_lr and default.seed == job.seed
    settings = TableConfig(admit_after=3, ttl_batches=500, max_shard_mb=64.0, evict="lfu")
    spec = sparse_spec(job.model_copy(update={"table": settings}), dim=9, init_scale=0.01)
    assert (spec.admit_after, spec.ttl, spec.evict) == (3, 500, "lfu")
    # 64 MiB over rows of 88 B (key, weights, accumulators, counters), the index (a 4 B slot and a 1 B
    # tag at load 3/8: 13.4 B) and waiting keys
    assert spec.max_rows == max_rows_for(64 * 2**20, 9, admit_after=3)
    assert 64 * 2**20 / (88 + 13.4 + 16 + 13.4) < spec.max_rows < 64 * 2**20 / (88 + 13.3 + 16 + 13.3)
    with pytest.raises(ValueError, match="admit_after"):
        TableConfig(admit_after=0)
