"""A sparse embedding table addressed by 64-bit keys, with Adagrad, in vectorised numpy.

Rows are created lazily on first use. A new row's initial value depends only on (key, seed), so a
table split into hash shards holds exactly the rows one big table would. Keys are mapped to rows
by an open-addressing hash index whose probes run over all keys of a call at once (no Python loop
over keys).

Adagrad, as in ``torch.optim.Adagrad`` (lr decay 0, weight decay 0), per element::

    accum += g * g
    w     -= lr * g / (sqrt(accum) + 1e-10)

where ``g`` is the sum of the gradients pushed for that key in one call (summed in float64, so the
result does not depend on the order of duplicates), and ``accum`` starts at ``init_accumulator``.

Example::

    table = SparseTable(dim=9, seed=0, lr=0.05, init_accumulator=0.1, init_scale=0.01)
    rows = table.pull(batch["keys"].ravel())          # float32[n, 9]
    table.push(batch["keys"].ravel(), grads)          # grads float32[n, 9]
"""

from __future__ import annotations

import numpy as np

ADAGRAD_EPS = 1e-10  # same as torch.optim.Adagrad's default eps

# splitmix64 constants (Steele, Lea, Flood: "Fast splittable pseudorandom number generators", 2014).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of ``x + golden``, elementwise on uint64 (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def initial_rows(keys: np.ndarray, dim: int, seed: int, scale: float) -> np.ndarray:
    """Initial values of the rows for `keys`: uniform(-scale, scale), a function of (key, seed) only."""
    base = splitmix64(np.asarray(keys, dtype=np.int64).view(np.uint64) ^ splitmix64(np.array([seed]))[0])
    columns = np.arange(1, dim + 1, dtype=np.uint64) * _GOLDEN
    bits = splitmix64(base[:, None] + columns[None, :])
    unit = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # [0, 1), 53 bits
    return ((2.0 * unit - 1.0) * scale).astype(np.float32)


def sum_rows(inverse: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """float32[n, dim]: the rows of `values` summed by group `inverse` (in float64, so the result does
    not depend on the order of duplicates). bincount per column is much faster than np.add.at."""
    flat = np.asarray(values, dtype=np.float32).reshape(len(inverse), -1)
    out = np.empty((n, flat.shape[1]), dtype=np.float32)
    for column in range(flat.shape[1]):
        out[:, column] = np.bincount(inverse, weights=flat[:, column], minlength=n)
    return out


class _KeyIndex:
    """Open-addressing hash map int64 key -> int64 row (linear probing, load factor <= 1/2).

    Every probe round handles all pending keys at once, so a call costs a few numpy passes.
    """

    def __init__(self, capacity: int = 1024):
        self._slot_keys = np.zeros(capacity, dtype=np.int64)
        self._slot_rows = np.full(capacity, -1, dtype=np.int64)  # -1: empty slot
        self.size = 0

    def _home(self, keys: np.ndarray) -> np.ndarray:
        mask = np.uint64(len(self._slot_rows) - 1)
        return (splitmix64(keys.view(np.uint64)) & mask).astype(np.int64)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, or -1 where the key is absent."""
        rows = np.full(len(keys), -1, dtype=np.int64)
        pending = np.arange(len(keys))
        slots = self._home(keys)
        mask = len(self._slot_rows) - 1
        while len(pending):
            found = self._slot_rows[slots]
            hit = (found >= 0) & (self._slot_keys[slots] == keys[pending])
            rows[pending[hit]] = found[hit]
            go_on = (found >= 0) & ~hit
            pending, slots = pending[go_on], (slots[go_on] + 1) & mask
        return rows

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Add keys (distinct, all absent) with their rows; grows to keep the load <= 1/2."""
        needed = self.size + len(keys)
        if 2 * needed > len(self._slot_rows):
            self._grow(needed)
        pending = np.arange(len(keys))
        slots = self._home(keys)
        mask = len(self._slot_rows) - 1
        while len(pending):
            empty = self._slot_rows[slots] < 0
            # Several keys may probe the same empty slot in one round: the first one takes it.
            _, first = np.unique(slots[empty], return_index=True)
            winners = np.flatnonzero(empty)[first]
            self._slot_keys[slots[winners]] = keys[pending[winners]]
            self._slot_rows[slots[winners]] = rows[pending[winners]]
            losers = np.ones(len(pending), dtype=bool)
            losers[winners] = False
            pending, slots = pending[losers], (slots[losers] + 1) & mask
        self.size = needed

    def _grow(self, needed: int) -> None:
        capacity = len(self._slot_rows)
        while 2 * needed > capacity:
            capacity *= 2
        occupied = self._slot_rows >= 0
        keys, rows = self._slot_keys[occupied], self._slot_rows[occupied]
        self._slot_keys = np.zeros(capacity, dtype=np.int64)
        self._slot_rows = np.full(capacity, -1, dtype=np.int64)
        self.size = 0
        self.insert(keys, rows)


class SparseTable:
    """Embedding rows of width `dim` for 64-bit keys, created lazily, trained with Adagrad."""

    def __init__(
        self,
        dim: int,
        seed: int = 0,
        lr: float = 0.05,
        init_accumulator: float = 0.1,
        init_scale: float = 0.01,
    ):
        if dim < 1:
            raise ValueError(f"dim must be >= 1 (got {dim})")
        self.dim, self.seed, self.lr = dim, seed, lr
        self.init_accumulator, self.init_scale = init_accumulator, init_scale
        self._index = _KeyIndex()
        self._keys = np.zeros(0, dtype=np.int64)
        self._weights = np.zeros((0, dim), dtype=np.float32)
        self._accum = np.zeros((0, dim), dtype=np.float32)
        self._num_rows = 0

    def __len__(self) -> int:
        return self._num_rows

    def pull(self, keys: np.ndarray, create: bool = True, unique: bool = False) -> np.ndarray:
        """Rows for `keys` (any shape is flattened), float32[n, dim]. Missing rows are created, or,
        with ``create=False`` (evaluation), returned at their initial value without being stored.
        ``unique=True`` promises the keys are distinct (a PS client already de-duplicated them)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        if unique:
            distinct, inverse = keys, None
        else:
            distinct, inverse = np.unique(keys, return_inverse=True)
        rows = self._index.lookup(distinct)
        missing = rows < 0
        if missing.any() and create:
            rows[missing] = self._create(distinct[missing])
        if create or not missing.any():
            values = self._weights[rows]
        else:
            values = np.empty((len(distinct), self.dim), dtype=np.float32)
            values[~missing] = self._weights[rows[~missing]]
            values[missing] = initial_rows(distinct[missing], self.dim, self.seed, self.init_scale)
        return values if inverse is None else values[inverse]

    def push(self, keys: np.ndarray, grads: np.ndarray, unique: bool = False) -> None:
        """Apply one Adagrad step with `grads` (float32[n, dim]); gradients of repeated keys are summed.
        ``unique=True`` promises the keys are distinct (their gradients already summed)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        grads = np.asarray(grads).reshape(len(keys), self.dim)
        if unique:
            distinct, g = keys, np.asarray(grads, dtype=np.float32)
        else:
            distinct, inverse = np.unique(keys, return_inverse=True)
            g = sum_rows(inverse, grads, len(distinct))
        rows = self._index.lookup(distinct)
        missing = rows < 0
        if missing.any():  # a push before any pull (e.g. async mode): start from the initial row
            rows[missing] = self._create(distinct[missing])
        accum = self._accum[rows] + g * g
        self._accum[rows] = accum
        self._weights[rows] -= self.lr * g / (np.sqrt(accum) + np.float32(ADAGRAD_EPS))

    def state(self) -> dict[str, np.ndarray]:
        """All rows, sorted by key (so equal tables give equal states whatever the insertion order)."""
        n = self._num_rows
        order = np.argsort(self._keys[:n], kind="stable")
        return {
            "keys": self._keys[:n][order].copy(),
            "weights": self._weights[:n][order].copy(),
            "accumulators": self._accum[:n][order].copy(),
        }

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Replace the contents with a :meth:`state` (keys must be distinct)."""
        keys = np.asarray(state["keys"], dtype=np.int64)
        weights = np.asarray(state["weights"], dtype=np.float32).reshape(len(keys), self.dim)
        accum = np.asarray(state["accumulators"], dtype=np.float32).reshape(len(keys), self.dim)
        if len(np.unique(keys)) != len(keys):
            raise ValueError("state keys must be distinct")
        self._index = _KeyIndex()
        self._keys, self._weights, self._accum = keys.copy(), weights.copy(), accum.copy()
        self._num_rows = len(keys)
        self._index.insert(keys, np.arange(len(keys), dtype=np.int64))

    def _create(self, keys: np.ndarray) -> np.ndarray:
        """Append rows for distinct absent keys at their initial values; returns their row numbers."""
        start, end = self._num_rows, self._num_rows + len(keys)
        if end > len(self._weights):
            self._reserve(max(end, 2 * len(self._weights), 1024))
        self._keys[start:end] = keys
        self._weights[start:end] = initial_rows(keys, self.dim, self.seed, self.init_scale)
        self._accum[start:end] = self.init_accumulator
        rows = np.arange(start, end, dtype=np.int64)
        self._index.insert(keys, rows)
        self._num_rows = end
        return rows

    def _reserve(self, capacity: int) -> None:
        n = self._num_rows
        keys = np.zeros(capacity, dtype=np.int64)
        weights = np.zeros((capacity, self.dim), dtype=np.float32)
        accum = np.zeros((capacity, self.dim), dtype=np.float32)
        keys[:n], weights[:n], accum[:n] = self._keys[:n], self._weights[:n], self._accum[:n]
        self._keys, self._weights, self._accum = keys, weights, accum
