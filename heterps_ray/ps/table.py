"""A sparse embedding table addressed by 64-bit keys, with Adagrad, on a compact compiled row store.

Rows are created lazily on first use. A new row's initial value depends only on (key, seed), so a
table split into hash shards holds exactly the rows one big table would.

Memory. The rows live in the C extension ``heterps_ray.ps._rows`` (built by the package's setup,
``setup.py``): fixed segments of 65,536 rows that are never copied as the table grows, each row its
key, weights and optimizer state side by side (plus 8 B of counters when admission or eviction is
on), and an open-addressing index of 4-byte row numbers at load <= 3/4 (5.3-10.7 B/row). Growing
copies only the index, so the peak stays near the steady size. Numpy could not get there: its
arrays grow by copying, and a per-call hash probe costs several passes over the keys.

Optimizer, per element (``optimizer="adagrad"``, as ``torch.optim.Adagrad``, lr decay 0, weight
decay 0)::

    accum += g * g
    w     -= lr * g / (sqrt(accum) + 1e-10)

or per row (``optimizer="rowwise_adagrad"``, FBGEMM's exact row-wise Adagrad, one accumulator per
row: 4 B of state instead of 4·dim)::

    accum += mean(g * g)
    w     -= lr / (sqrt(accum) + 1e-10) * g

where ``g`` is the sum of the gradients pushed for that key in one call (summed in float64, so the
result does not depend on the order of duplicates), and ``accum`` starts at ``init_accumulator``.

Admission and eviction (all off by default; on any of them the table keeps a pull count and the
step last seen per row):

* ``admit_after=n``: a key gets a row of its own at the n-th pull call that contains it (a call
  counts once however often the key repeats in it, so hash shards count alike). Until then it
  reads the shared default row, **zeros** (the embedding adds nothing, as an absent feature), and
  its gradients are dropped; its count is kept in a small side store (key, count, last seen:
  16 B). Zeros rather than the key's initial row: serving then scores a key the model never
  admitted exactly as training did without storing anything for it, and an admitted row starts
  from its initial value as before. Evaluation pulls (``create=False``) of absent keys read zeros
  too once admission is on.
* ``ttl=t``: a row (or candidate) not pulled in the last ``t`` steps is gone: the next lookup
  treats it as a new key. The step is the caller's global batch index (``pull(..., step=)``), so a
  replay after a fault is exact; without it the table counts its own pull calls. Expiry is exact
  at lookup; the memory of expired rows is reclaimed by sweeps every ``t/4`` steps.
* ``max_rows=m``: a cap per table (per shard): before a call could exceed it, the rows of lowest
  score are evicted to 1/16 below the cap, score = step last seen (``evict="lru"``) or pull count
  (``evict="lfu"``), ties in row order. Keys waiting for admission are capped alike.

Counters and the clock are part of :meth:`state` (keys ``counts``, ``last_seen``, ``step`` and
``candidate_*``) only when a table tracks keys, so a table with all of it off has exactly the state
it always had.

Counters, snapshots and restores: ps/table_snapshots.py.

Example::

    table = SparseTable(dim=9, seed=0, lr=0.05, init_accumulator=0.1, init_scale=0.01)
    rows = table.pull(batch["keys"].ravel())          # float32[n, 9]
    table.push(batch["keys"].ravel(), grads)          # grads float32[n, 9]
"""

from __future__ import annotations

import numpy as np

from heterps_ray.ps.disk_tier import DiskTier
from heterps_ray.ps.row_bytes import stored_bytes_per_row
from heterps_ray.ps.table_snapshots import TableSnapshots

try:
    from heterps_ray.ps._rows import Rows as _Rows
except ImportError as exc:  # pragma: no cover - a checkout whose extension was never built
    raise ImportError(
        "heterps_ray.ps._rows (the compiled row store) is not built: run `pip install -e .` "
        "(or `bash scripts/setup.sh`) in the repository; it needs a C compiler"
    ) from exc
if not hasattr(_Rows, "export_from"):  # pragma: no cover - built before streamed snapshots
    raise ImportError(
        "heterps_ray.ps._rows was built from an older _rows.c: rebuild it with `pip install -e .` "
        "(or `python setup.py build_ext --inplace`) in the repository"
    )

ADAGRAD_EPS = 1e-10  # same as torch.optim.Adagrad's default eps
OPTIMIZERS = ("adagrad", "rowwise_adagrad")
EVICTION = ("lru", "lfu")

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


def _seed_mix(seed: int) -> int:
    return int(splitmix64(np.array([seed]))[0])


def initial_rows(keys: np.ndarray, dim: int, seed: int, scale: float) -> np.ndarray:
    """Initial values of the rows for `keys`: uniform(-scale, scale), a function of (key, seed) only."""
    base = splitmix64(np.asarray(keys, dtype=np.int64).view(np.uint64) ^ np.uint64(_seed_mix(seed)))
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


class SparseTable(TableSnapshots):
    """Embedding rows of width `dim` for 64-bit keys, created lazily, trained with Adagrad."""

    def __init__(
        self,
        dim: int,
        seed: int = 0,
        lr: float = 0.05,
        init_accumulator: float = 0.1,
        init_scale: float = 0.01,
        optimizer: str = "adagrad",
        admit_after: int = 1,
        ttl: int = 0,
        max_rows: int = 0,
        evict: str = "lru",
        ram_rows: int = 0,
        disk_dir: str = "",
        disk_reads_in_flight: int = 32,
    ):
        if dim < 1:
            raise ValueError(f"dim must be >= 1 (got {dim})")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS} (got {optimizer!r})")
        if evict not in EVICTION:
            raise ValueError(f"evict must be one of {EVICTION} (got {evict!r})")
        if admit_after < 1 or ttl < 0 or max_rows < 0:
            raise ValueError(
                f"need admit_after >= 1, ttl >= 0, max_rows >= 0 (got {admit_after}, {ttl}, {max_rows})"
            )
        self.dim, self.seed, self.lr = dim, seed, lr
        self.init_accumulator, self.init_scale = init_accumulator, init_scale
        self.optimizer, self.admit_after, self.ttl, self.max_rows, self.evict = (
            optimizer,
            admit_after,
            ttl,
            max_rows,
            evict,
        )
        if disk_dir and (ttl or max_rows or ram_rows < 1):
            raise ValueError(
                f"a disk tier (disk_dir {disk_dir!r}) needs ram_rows >= 1 and no ttl or max_rows "
                f"(got ram_rows {ram_rows}, ttl {ttl}, max_rows {max_rows})"
            )
        # a disk tier spills the least recently seen rows: it keeps the counters
        self.tracked = admit_after > 1 or ttl > 0 or max_rows > 0 or bool(disk_dir)
        self._acc_width = 1 if optimizer == "rowwise_adagrad" else dim
        self._sweep_every = max(1, ttl // 4)
        self._rows = _Rows(
            dim, _seed_mix(seed), float(init_scale), float(lr), float(init_accumulator),
            optimizer == "rowwise_adagrad", self.tracked, admit_after, ttl, max_rows, evict == "lfu",
        )  # fmt: skip
        self._step = 0
        self._disk = None
        if disk_dir:
            cost = stored_bytes_per_row(dim, optimizer, tracked=True)
            self._disk = DiskTier(
                self._rows, disk_dir, ram_rows, dim, self._acc_width, row_cost=cost, reads=disk_reads_in_flight
            )
        # the disk file's records up to this one are in the last durable snapshot (generation, records)
        self._disk_mark = self._disk_taken = (0, 0)

    def __len__(self) -> int:
        return len(self._rows) + (len(self._disk) if self._disk is not None else 0)

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier (rows beyond ``ram_rows`` on local disk), or None: every row in RAM."""
        return self._disk

    @property
    def step(self) -> int:
        """The clock: the step of the last creating pull."""
        return self._step

    @property
    def nbytes(self) -> int:
        """Bytes the table holds (rows, index, free list, and the keys waiting for admission)."""
        return int(self._rows.info()["bytes"])

    def stats(self) -> dict[str, int]:
        """rows, candidates (keys waiting for admission), bytes, row_bytes, step, and since this
        object was made: admitted, expired, evicted."""
        out = {k: int(v) for k, v in self._rows.info().items()}
        if self._disk is not None:
            stats = self._disk.stats
            out.update(
                disk_rows=len(self._disk), disk_hits=stats.hits, disk_misses=stats.misses,
                disk_fetched=stats.fetched, disk_written_back=stats.written_back, disk_evicted=stats.evicted,
                disk_file_bytes=self._disk.disk.records * self._disk.disk.dtype.itemsize,
                disk_index_bytes=self._disk.disk.nbytes,
            )  # fmt: skip
        return out

    def pull(
        self, keys: np.ndarray, create: bool = True, unique: bool = False, step: int | None = None
    ) -> np.ndarray:
        """Rows for `keys` (any shape is flattened), float32[n, dim]. Missing rows are created, or,
        with ``create=False`` (evaluation), returned at their initial value (zeros with admission on)
        without being stored. ``unique=True`` promises the keys are distinct (a PS client already
        de-duplicated them). `step`: the global batch index (the clock of TTL; default: this
        table's pull calls)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        out = np.empty((len(keys), self.dim), dtype=np.float32)
        if create:
            self._advance(self._step + 1 if step is None else step)
            if self._disk is not None:
                self._disk.before_pull(keys, unique)
        self._rows.pull(keys, out, unique, create, self._step)
        if self._disk is not None and not create:
            self._disk.fill(keys, out)
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray, unique: bool = False) -> int:
        """Apply one Adagrad step with `grads` (float32[n, dim]); gradients of repeated keys are summed.
        ``unique=True`` promises the keys are distinct (their gradients already summed). Keys not
        admitted are skipped. Returns the number of rows updated."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        grads = np.ascontiguousarray(grads, dtype=np.float32).reshape(len(keys), self.dim)
        if self._disk is None:
            return int(self._rows.push(keys, grads, unique))
        self._disk.before_write(keys, unique)
        applied = int(self._rows.push(keys, grads, unique))
        self._disk.make_room(0)  # rows brought back for the write leave again once it is done
        return applied

    def fetch(self, keys: np.ndarray, step: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a tier above this table (ps/device_table.py) taking rows it does not hold: distinct
        `keys` are pulled as :meth:`pull` does (created, counted for admission), then their whole rows
        are read: (weights float32[n, dim], accumulators float32[n, acc], admitted bool[n]). A key not
        admitted has no row: zeros, and the tier keeps reading the default row for it."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        self.pull(keys, unique=True, step=step)
        weights = np.zeros((len(keys), self.dim), dtype=np.float32)
        accum = np.zeros((len(keys), self._acc_width), dtype=np.float32)
        found = np.zeros(len(keys), dtype=np.uint8)
        self._rows.get(keys, weights, accum, found)
        return weights, accum, found.astype(bool)

    def put(self, keys: np.ndarray, weights: np.ndarray, accumulators: np.ndarray) -> int:
        """A tier above writes rows back: the weights and accumulators of `keys` (rows this table
        holds) are replaced and marked changed for the next delta checkpoint; counters unchanged.
        Returns the keys it does not hold (skipped; none when the tier took its rows from here)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        weights = np.ascontiguousarray(weights, dtype=np.float32).reshape(len(keys), self.dim)
        accum = np.ascontiguousarray(accumulators, dtype=np.float32).reshape(len(keys), self._acc_width)
        if self._disk is None:
            return int(self._rows.set(keys, weights, accum))
        self._disk.before_write(keys)
        absent = int(self._rows.set(keys, weights, accum))
        self._disk.make_room(0)  # a tier's write-back of many rows does not stay in RAM past the budget
        return absent

    def sweep(self) -> int:
        """Reclaim the memory of expired rows now (lookups already treat them as absent)."""
        return int(self._rows.expire())

    def _advance(self, step: int) -> None:
        if not 0 <= step < 2**32 - 1:
            raise ValueError(f"step must be in [0, 2^32 - 1) (got {step})")
        previous, self._step = self._step, step
        self._rows.set_clock(step)
        if self.ttl and step // self._sweep_every != previous // self._sweep_every:
            self._rows.expire()
