"""SparseTable: lazy rows from (key, seed), Adagrad identical to torch's, sharding-invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heterps_ray.ps.table import ADAGRAD_EPS, SparseTable, initial_rows, sum_rows

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


# -- admission, eviction, row-wise Adagrad -------------------------------------------------------


class _ReferenceTable:
    """The documented rules of SparseTable's admission, TTL and optimizers, one key at a time in
    plain Python (no row cap): what the compiled table must equal exactly."""

    def __init__(self, dim, seed=0, lr=0.05, init_accumulator=0.1, init_scale=0.01, optimizer="adagrad",
                 admit_after=1, ttl=0):  # fmt: skip
        self.dim, self.seed, self.lr, self.acc0, self.scale = (
            dim,
            seed,
            np.float32(lr),
            init_accumulator,
            init_scale,
        )
        self.rowwise, self.admit_after, self.ttl = optimizer == "rowwise_adagrad", admit_after, ttl
        self.rows: dict[int, list] = {}  # key -> [weights, accumulators, count, last_seen]
        self.candidates: dict[int, list] = {}  # key -> [count, last_seen]
        self.step = 0

    def _expired(self, last):
        return self.ttl > 0 and last + self.ttl < self.step

    def _new(self, key, count):
        w = initial_rows(np.array([key]), self.dim, self.seed, self.scale)[0]
        acc = np.full(1 if self.rowwise else self.dim, self.acc0, dtype=np.float32)
        self.rows[key] = [w, acc, count, self.step]

    def pull(self, keys, step, create=True):
        if create:
            self.step = step
        values = {key: self._resolve(key, create) for key in dict.fromkeys(keys.tolist())}  # counted once
        return np.array([values[key] for key in keys.tolist()], dtype=np.float32).reshape(len(keys), self.dim)

    def _default(self, key):
        if self.admit_after > 1:
            return np.zeros(self.dim, dtype=np.float32)
        return initial_rows(np.array([key]), self.dim, self.seed, self.scale)[0]

    def _resolve(self, key, create):
        row = self.rows.get(key)
        if row is not None and self._expired(row[3]):
            if not create:
                return self._default(key)
            del self.rows[key]
            row = None
        if row is not None:
            if create:
                row[2] += 1
                row[3] = self.step
            return row[0].copy()
        if not create:
            return self._default(key)
        count = 1
        if self.admit_after > 1:
            cand = self.candidates.get(key)
            count = 1 if cand is None or self._expired(cand[1]) else cand[0] + 1
            if count < self.admit_after:
                self.candidates[key] = [count, self.step]
                return self._default(key)
            self.candidates.pop(key, None)
        self._new(key, count)
        return self.rows[key][0].copy()

    def push(self, keys, grads):
        distinct, inverse = np.unique(keys, return_inverse=True)
        summed = sum_rows(inverse, grads, len(distinct))
        for key, g in zip(distinct.tolist(), summed, strict=True):
            row = self.rows.get(key)
            if row is not None and self._expired(row[3]):
                del self.rows[key]
                row = None
            if row is None:
                if self.admit_after > 1:
                    continue
                self._new(key, 1)
                row = self.rows[key]
            w, acc = row[0], row[1]
            if self.rowwise:
                acc += np.float32(np.sum(g.astype(np.float64) ** 2) / self.dim)
                w -= (self.lr / (np.sqrt(acc) + np.float32(ADAGRAD_EPS))) * g
            else:
                acc += g * g
                w -= self.lr * g / (np.sqrt(acc) + np.float32(ADAGRAD_EPS))

    def state(self):
        keys = np.array(sorted(self.rows), dtype=np.int64)
        cand = np.array(sorted(self.candidates), dtype=np.int64)
        return {
            "keys": keys,
            "weights": np.array([self.rows[k][0] for k in keys.tolist()], np.float32).reshape(-1, self.dim),
            "accumulators": np.array([self.rows[k][1] for k in keys.tolist()], np.float32).reshape(
                len(keys), -1
            ),
            "counts": np.array([self.rows[k][2] for k in keys.tolist()], np.uint32),
            "last_seen": np.array([self.rows[k][3] for k in keys.tolist()], np.uint32),
            "candidate_keys": cand,
            "candidate_counts": np.array([self.candidates[k][0] for k in cand.tolist()], np.uint32),
            "candidate_last_seen": np.array([self.candidates[k][1] for k in cand.tolist()], np.uint32),
        }


def _alive(state, now, ttl):
    """The rows and candidates of a state that a lookup at step `now` still sees (expired ones are
    gone whether or not a sweep has reclaimed them yet)."""
    out = {}
    for group in ("", "candidate_"):
        if group + "keys" not in state:
            continue
        keep = np.ones(len(state[group + "keys"]), dtype=bool)
        if ttl:
            keep = state[group + "last_seen"].astype(np.int64) + ttl >= now
        for name, value in state.items():
            if name.startswith(group) and (group or not name.startswith("candidate_")) and name != "step":
                out[name] = value[keep]
    return out


def _assert_states_equal(actual, expected):
    assert set(actual) == set(expected), (sorted(actual), sorted(expected))
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


def _stream(seed, steps, vocab_size=400, batch=300):
    """Zipf-distributed keys over a small vocabulary, steps advancing with gaps (as a plan with
    several DataWorkers gives one shard), and gradients."""
    rng = np.random.default_rng(seed)
    vocab = _random_keys(vocab_size, seed + 100)
    step = 0
    for _ in range(steps):
        step += int(rng.integers(1, 4))
        keys = vocab[(rng.zipf(1.3, batch) - 1) % vocab_size]
        yield step, keys, rng.standard_normal((batch, DIM)).astype(np.float32)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize(("admit_after", "ttl"), [(1, 0), (3, 0), (1, 6), (2, 9)])
def test_admission_and_ttl_equal_the_reference_rules_exactly(optimizer, admit_after, ttl):
    settings = dict(seed=4, lr=0.05, init_accumulator=0.1, init_scale=0.05, optimizer=optimizer)
    table = SparseTable(DIM, **settings, admit_after=admit_after, ttl=ttl)
    reference = _ReferenceTable(DIM, **settings, admit_after=admit_after, ttl=ttl)
    tracked = admit_after > 1 or ttl > 0
    for step, keys, grads in _stream(1, 40):
        np.testing.assert_array_equal(table.pull(keys, step=step), reference.pull(keys, step))
        table.push(keys, grads)
        reference.push(keys, grads)
        probe = keys[::7]
        np.testing.assert_array_equal(
            table.pull(probe, create=False), reference.pull(probe, step, create=False)
        )
    expected = reference.state()
    if not tracked:
        expected = {k: expected[k] for k in ("keys", "weights", "accumulators")}
    elif admit_after == 1:
        expected = {k: v for k, v in expected.items() if not k.startswith("candidate_")}
    state = table.state()
    if tracked:
        assert int(state.pop("step")) == reference.step
    _assert_states_equal(_alive(state, reference.step, ttl), _alive(expected, reference.step, ttl))
    assert len(state["keys"]) > 50  # the stream did create rows
    if admit_after > 1:  # some keys are still waiting, every row was admitted once at least
        assert len(state["candidate_keys"]) > 0 and table.stats()["admitted"] >= len(state["keys"])
    if ttl:
        assert table.stats()["expired"] > 0


def test_a_key_reads_zeros_until_admitted_and_learns_only_after():
    table = SparseTable(DIM, seed=2, admit_after=3)
    key = np.array([77, 77], dtype=np.int64)  # repeated in a call: counted once
    g = np.ones((2, DIM), dtype=np.float32)
    for step in (1, 2):
        np.testing.assert_array_equal(table.pull(key, step=step), np.zeros((2, DIM), np.float32))
        assert table.push(key, g) == 0 and len(table) == 0
    np.testing.assert_array_equal(table.pull(key[:1], create=False), np.zeros((1, DIM), np.float32))
    admitted = table.pull(key, step=3)
    np.testing.assert_array_equal(admitted[0], initial_rows(key[:1], DIM, 2, table.init_scale)[0])
    assert len(table) == 1 and table.push(key, g) == 1
    assert np.all(table.pull(key[:1], create=False) < admitted[:1])  # it learned (positive gradient)
    state = table.state()
    assert state["counts"].tolist() == [3] and state["last_seen"].tolist() == [3]
    assert len(state["candidate_keys"]) == 0


def test_ttl_expires_a_row_unseen_for_longer_than_ttl_steps():
    table = SparseTable(DIM, seed=0, ttl=5)
    a, b = np.array([1], dtype=np.int64), np.array([2], dtype=np.int64)
    table.pull(a, step=1)
    table.push(a, np.ones((1, DIM), np.float32))
    trained = table.pull(a, step=6)  # 1 + 5 >= 6: still there
    assert not np.array_equal(trained, initial_rows(a, DIM, 0, table.init_scale))
    table.pull(b, step=12)  # a last seen at 6: 6 + 5 < 12, gone
    np.testing.assert_array_equal(table.pull(a, create=False), initial_rows(a, DIM, 0, table.init_scale))
    np.testing.assert_array_equal(table.pull(a, step=12), initial_rows(a, DIM, 0, table.init_scale))
    assert table.state()["counts"].tolist() == [1, 1]  # a starts counting again


def test_sweeps_reclaim_expired_rows_and_their_memory_is_reused():
    table = SparseTable(DIM, seed=0, ttl=8)
    for step in range(1, 5):
        table.pull(_random_keys(20_000, step), step=step)
    full = table.nbytes
    assert len(table) == 80_000
    table.pull(_random_keys(10, 99), step=100)  # crosses a sweep boundary: everything expired
    assert len(table) == 10 and table.stats()["expired"] == 80_000
    for step in range(101, 105):
        table.pull(_random_keys(20_000, step), step=step)
    assert len(table) == 80_010 and table.nbytes <= full * 1.05  # freed rows were reused


@pytest.mark.parametrize("evict", ["lru", "lfu"])
def test_row_cap_evicts_the_least_recently_or_frequently_seen(evict):
    table = SparseTable(DIM, seed=0, max_rows=1000, evict=evict)
    hot = _random_keys(100, 7)
    for step in range(1, 40):
        table.pull(np.concatenate([hot, _random_keys(200, 1000 + step)]), step=step)
        assert len(table) <= 1000
    state = table.state()
    assert np.isin(hot, state["keys"]).all()  # pulled every step: most recent and most frequent
    assert len(state["keys"]) > 800  # evicts to 1/16 below the cap, not far below
    assert table.stats()["evicted"] == 100 + 39 * 200 - len(state["keys"])
    if evict == "lru":  # the rows kept are the most recently seen
        cold = ~np.isin(state["keys"], hot)
        assert state["last_seen"][cold].min() >= 39 - 4
    twin = SparseTable(DIM, seed=0, max_rows=1000, evict=evict)  # the same calls: the same rows
    for step in range(1, 40):
        twin.pull(np.concatenate([hot, _random_keys(200, 1000 + step)]), step=step)
    _assert_states_equal(twin.state(), state)


def test_state_round_trip_keeps_counters_candidates_and_clock():
    settings = dict(seed=1, admit_after=2, ttl=10)
    table, copy = SparseTable(DIM, **settings), SparseTable(DIM, **settings)
    stream = list(_stream(3, 30))
    for step, keys, grads in stream[:15]:
        table.pull(keys, step=step)
        table.push(keys, grads)
    copy.load_state(table.state())
    _assert_states_equal(copy.state(), table.state())
    assert len(table.state()["candidate_keys"]) > 0
    for step, keys, grads in stream[15:]:
        np.testing.assert_array_equal(copy.pull(keys, step=step), table.pull(keys, step=step))
        copy.push(keys, grads)
        table.push(keys, grads)
    _assert_states_equal(copy.state(), table.state())
    with pytest.raises(ValueError, match="per row"):
        SparseTable(DIM, optimizer="rowwise_adagrad").load_state(table.state())


def test_hash_shards_with_admission_and_ttl_hold_the_rows_of_one_table():
    settings = dict(seed=5, admit_after=2, ttl=7)
    whole = SparseTable(DIM, **settings)
    shards = [SparseTable(DIM, **settings) for _ in range(3)]
    for step, keys, grads in _stream(4, 40):
        whole.pull(keys, step=step)
        whole.push(keys, grads)
        owner = keys.view(np.uint64) % np.uint64(3)
        for s, shard in enumerate(shards):
            mine = owner == s
            if mine.any():  # a shard without keys in a batch gets no call
                shard.pull(keys[mine], step=step)
                shard.push(keys[mine], grads[mine])
    now = whole.step
    merged: dict[str, list] = {}
    for shard in shards:
        for name, value in _alive(shard.state(), now, 7).items():
            merged.setdefault(name, []).append(value)
    expected = _alive(whole.state(), now, 7)
    for group in ("", "candidate_"):
        order = np.argsort(np.concatenate(merged[group + "keys"]))
        for name in expected:
            if name.startswith(group) and (group or not name.startswith("candidate_")):
                np.testing.assert_array_equal(
                    np.concatenate(merged[name])[order], expected[name], err_msg=name
                )


def test_memory_per_row_is_the_payload_plus_little():
    for optimizer, tracked in (("adagrad", {}), ("rowwise_adagrad", {"ttl": 100})):
        table = SparseTable(16, optimizer=optimizer, **tracked)
        for step in range(1, 41):
            table.pull(_random_keys(512 * 26, step), step=step)
        payload = 8 + 4 * 16 + 4 * (1 if optimizer == "rowwise_adagrad" else 16)
        per_row = table.nbytes / len(table)
        print(f"{optimizer} {tracked}: {per_row:.1f} B/row for a payload of {payload}")
        assert payload < per_row <= payload + 24
