"""SparseTable: lazy rows from (key, seed), Adagrad identical to torch's, sharding-invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heterps_ray.ps.table import SparseTable, initial_rows

DIM = 9


def _random_keys(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, n, dtype=np.int64)


def test_new_rows_depend_only_on_key_and_seed():
    keys = _random_keys(1000, 0)
    a = SparseTable(DIM, seed=7, init_scale=0.05)
    b = SparseTable(DIM, seed=7, init_scale=0.05)
    rows_a = a.pull(keys)
    b.pull(keys[::-1][:500])  # other keys first, other order
    rows_b = b.pull(keys)
    np.testing.assert_array_equal(rows_a, rows_b)
    assert rows_a.dtype == np.float32 and rows_a.shape == (1000, DIM)
    assert np.abs(rows_a).max() <= 0.05 and rows_a.std() > 0.02  # uniform(-0.05, 0.05) spread
    other_seed = SparseTable(DIM, seed=8, init_scale=0.05).pull(keys)
    assert not np.allclose(rows_a, other_seed)
    # columns of one row differ (the column index is mixed in)
    assert np.all(rows_a[:, 0] != rows_a[:, 1])


def test_pull_repeated_keys_and_evaluation_pull_creates_nothing():
    table = SparseTable(DIM, seed=1)
    keys = np.array([5, 5, -3, 5, 2**62], dtype=np.int64)
    peek = table.pull(keys, create=False)
    assert len(table) == 0
    rows = table.pull(keys)
    assert len(table) == 3
    np.testing.assert_array_equal(peek, rows)
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[0], initial_rows(np.array([5]), DIM, 1, table.init_scale)[0])


def test_push_matches_torch_adagrad_with_duplicate_keys():
    lr, acc0 = 0.05, 0.1
    vocab = np.array([11, -42, 2**40 + 3, 7], dtype=np.int64)
    table = SparseTable(DIM, seed=3, lr=lr, init_accumulator=acc0, init_scale=0.1)
    weight = torch.nn.Parameter(torch.from_numpy(table.pull(vocab, create=False).copy()))
    adagrad = torch.optim.Adagrad([weight], lr=lr, initial_accumulator_value=acc0)
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = rng.integers(0, len(vocab), 12)  # repeated keys within a step
        keys = vocab[ids]
        table.pull(keys)
        grads = rng.standard_normal((12, DIM)).astype(np.float32)
        table.push(keys, grads)
        dense_grad = np.zeros((len(vocab), DIM), dtype=np.float64)
        np.add.at(dense_grad, ids, grads)
        seen = np.unique(ids)  # torch updates every row; the table only rows that got gradients
        adagrad.zero_grad()
        weight.grad = torch.from_numpy(dense_grad.astype(np.float32))
        mask = torch.zeros(len(vocab), dtype=torch.bool)
        mask[seen] = True
        before = weight.detach().clone()
        adagrad.step()
        with torch.no_grad():  # rows with zero gradient do not move in Adagrad either
            assert torch.equal(weight[~mask], before[~mask])
    np.testing.assert_allclose(table.pull(vocab), weight.detach().numpy(), rtol=1e-6, atol=1e-7)
    state = table.state()
    order = np.argsort(vocab)
    np.testing.assert_allclose(state["accumulators"], adagrad.state[weight]["sum"].numpy()[order], rtol=1e-6)


def test_repeated_key_gradients_are_summed():
    one, two = SparseTable(DIM, seed=0), SparseTable(DIM, seed=0)
    g = np.random.default_rng(1).standard_normal((2, DIM)).astype(np.float32)
    one.push(np.array([9, 9]), g)
    two.push(np.array([9]), g.sum(0, keepdims=True))
    np.testing.assert_allclose(one.pull(np.array([9])), two.pull(np.array([9])), rtol=1e-7)
    assert one.pull(np.array([9]))[0, 0] != initial_rows(np.array([9]), DIM, 0, 0.01)[0, 0]


def test_hash_sharded_tables_hold_exactly_the_rows_of_one_table():
    whole = SparseTable(DIM, seed=5)
    shards = [SparseTable(DIM, seed=5) for _ in range(3)]
    rng = np.random.default_rng(2)
    vocab = _random_keys(5000, 3)
    for _ in range(4):
        keys = vocab[rng.zipf(1.3, 2000) % len(vocab)]
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        whole.pull(keys)
        whole.push(keys, grads)
        owner = keys.view(np.uint64) % np.uint64(3)
        for s, shard in enumerate(shards):
            mine = owner == s
            shard.pull(keys[mine])
            shard.push(keys[mine], grads[mine])
    states = [shard.state() for shard in shards]
    merged = {name: np.concatenate([st[name] for st in states]) for name in states[0]}
    order = np.argsort(merged["keys"])
    expected = whole.state()
    for name in expected:
        np.testing.assert_array_equal(merged[name][order], expected[name])


def test_index_stays_correct_through_growth_and_colliding_keys():
    table = SparseTable(2, seed=0)
    # Keys that are equal modulo every power of two up to 2^40 crowd the same probe chains.
    colliding = np.arange(300, dtype=np.int64) << 40
    keys = np.concatenate([colliding, _random_keys(200_000, 4), np.array([0, -1, 2**63 - 1, -(2**63)])])
    for chunk in np.array_split(keys, 7):
        table.pull(chunk)
    assert len(table) == len(np.unique(keys))
    state = table.state()
    np.testing.assert_array_equal(state["keys"], np.unique(keys))
    np.testing.assert_array_equal(table.pull(keys), initial_rows(keys, 2, 0, table.init_scale))
    assert len(table) == len(np.unique(keys))


def test_state_round_trip_and_bad_state():
    table = SparseTable(DIM, seed=0)
    keys = _random_keys(100, 5)
    table.pull(keys)
    table.push(keys, np.ones((100, DIM), dtype=np.float32))
    copy = SparseTable(DIM, seed=0)
    copy.load_state(table.state())
    np.testing.assert_array_equal(copy.pull(keys), table.pull(keys))
    for name, value in copy.state().items():
        np.testing.assert_array_equal(value, table.state()[name])
    bad = table.state()
    bad["keys"][1] = bad["keys"][0]
    with pytest.raises(ValueError, match="distinct"):
        copy.load_state(bad)
