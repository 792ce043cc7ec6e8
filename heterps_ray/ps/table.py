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

Changes (incremental checkpoints): from a table's first snapshot or restore on, the row store keeps
a dirty bit per row and a log of removed keys. :meth:`snapshot_state` takes them (a full state, or
with ``delta=True`` only the rows written and the keys removed since the last durable snapshot);
:meth:`snapshot_durable` forgets them once the checkpoint is committed, so a snapshot that is never
committed leaves its rows to the next one. :meth:`apply_snapshot_changes` replays a delta file onto a
table.

Example::

    table = SparseTable(dim=9, seed=0, lr=0.05, init_accumulator=0.1, init_scale=0.01)
    rows = table.pull(batch["keys"].ravel())          # float32[n, 9]
    table.push(batch["keys"].ravel(), grads)          # grads float32[n, 9]
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from heterps_ray.ps.atomic import Member, NpzReader
from heterps_ray.ps.disk_tier import DiskTier, read_linked, record_dtype

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
# B/row of the index at its sparsest (load 3/8, just after doubling): a uint32 row number and a uint8 tag
# per slot (_rows.c). 136 B of payload + 13.3 = 149.3 B/row is what 10M fresh dim-16 keys measured.
_INDEX_BYTES = (4 + 1) / 0.375
_CANDIDATE_BYTES = 16  # key, count, last seen of a key waiting for admission
# Rows per chunk of a streamed snapshot or restore: 1 MiB of dim-16 weights (a few such buffers are alive).
SNAPSHOT_CHUNK_ROWS = 1 << 14

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


def row_bytes(dim: int, optimizer: str = "adagrad", tracked: bool = False) -> int:
    """Bytes of one stored row: key, weights, optimizer state (and 8 B of counters when tracked)."""
    return 8 + 4 * dim + 4 * (1 if optimizer == "rowwise_adagrad" else dim) + (8 if tracked else 0)


def stored_bytes_per_row(dim: int, optimizer: str = "adagrad", tracked: bool = False) -> float:
    """Memory one row takes in the store at its worst: the row and its share of the index at its sparsest."""
    return row_bytes(dim, optimizer, tracked) + _INDEX_BYTES


# a bucket of the GPU tier's key index (ps/device_index.py): an int64 key, an int32 slot, an int32 claim;
# the index keeps its load at most 1/2, so two buckets a row
DEVICE_INDEX_BUCKET_BYTES = 8 + 4 + 4


def device_row_bytes(dim: int, optimizer: str = "adagrad") -> int:
    """GPU bytes of one row the GPU tier holds (ps/device_table.py): weights, optimizer state, per slot
    a dirty and a held flag, the batch it was last used in and its key (int64 each), the batches in
    flight that pin it (int32), and two buckets of the key index."""
    state = 4 * (1 if optimizer == "rowwise_adagrad" else dim)
    return 4 * dim + state + 1 + 1 + 8 + 8 + 4 + 2 * DEVICE_INDEX_BUCKET_BYTES


def device_rows_within(budget_bytes: float, dim: int, optimizer: str = "adagrad") -> int:
    """Rows the GPU tier may hold within `budget_bytes` of device memory: its slots double as it fills,
    so at the last doubling the old half and the new whole are both alive (1.5x the rows' bytes)."""
    return max(0, int(budget_bytes // (1.5 * device_row_bytes(dim, optimizer))))


def max_rows_for(memory_bytes: float, dim: int, optimizer: str = "adagrad", admit_after: int = 1) -> int:
    """The row cap (``max_rows``) that keeps one table within `memory_bytes` at its worst: rows with
    counters, the index at its sparsest, and as many keys waiting for admission as rows."""
    per_row = stored_bytes_per_row(dim, optimizer, tracked=True)
    if admit_after > 1:
        per_row += _CANDIDATE_BYTES + _INDEX_BYTES
    return max(1, int(memory_bytes // per_row))


class SparseTable:
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
            self._disk = DiskTier(self._rows, disk_dir, ram_rows, dim, self._acc_width, row_cost=cost)
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
                disk_written_back=stats.written_back, disk_evicted=stats.evicted,
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
                self._disk.before_pull(keys)
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
        self._disk.before_write(keys)
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

    def state(self) -> dict[str, np.ndarray]:
        """All rows, sorted by key (so equal tables give equal states whatever the insertion order);
        with tracking also their counters, the clock and the keys waiting for admission."""
        n = len(self._rows)
        keys = np.empty(n, dtype=np.int64)
        weights = np.empty((n, self.dim), dtype=np.float32)
        accum = np.empty((n, self._acc_width), dtype=np.float32)
        meta = np.empty((n, 2), dtype=np.uint32) if self.tracked else None
        self._rows.export(0, keys, weights, accum, meta)
        if self._disk is not None:
            records = self._disk.disk.read(self._disk.disk.live_positions())
            keys, weights = np.concatenate([keys, records["key"]]), np.concatenate([weights, records["w"]])
            accum, meta = np.concatenate([accum, records["acc"]]), np.concatenate([meta, records["meta"]])
            del records
        order = np.argsort(keys, kind="stable")
        # sorted one array at a time, each unsorted one freed as soon as its copy exists
        out: dict[str, np.ndarray] = {"keys": keys[order]}
        del keys
        out["weights"] = weights[order]
        del weights
        out["accumulators"] = accum[order]
        del accum
        if meta is not None:
            out["counts"], out["last_seen"] = meta[order, 0], meta[order, 1]
            out["step"] = np.array(self._step, dtype=np.int64)
        if self.admit_after > 1:
            m = int(self._rows.info()["candidates"])
            ckeys, cmeta = np.empty(m, dtype=np.int64), np.empty((m, 2), dtype=np.uint32)
            self._rows.export(1, ckeys, None, None, cmeta)
            corder = np.argsort(ckeys, kind="stable")
            out["candidate_keys"] = ckeys[corder]
            out["candidate_counts"], out["candidate_last_seen"] = cmeta[corder, 0], cmeta[corder, 1]
        return out

    def pending_changes(self) -> tuple[int, int] | None:
        """(rows a delta snapshot now would hold at most, rows held): takes the changes as
        :meth:`snapshot_state` does (a later snapshot takes the same ones); None before the first
        snapshot or restore (no delta is possible yet)."""
        if not self._rows.info()["recording"]:
            return None
        rows = self._rows.track_changes(1)[0]
        if self._disk is not None:
            rows += len(self._disk.written_since(self._disk_mark))
        return int(rows), len(self)

    def snapshot_members(self, delta: bool = False, link_to: Path | None = None) -> list[Member]:
        """What :meth:`snapshot_state` holds, as the members of a streamed .npz: a full snapshot's
        fields are read from the row store in chunks while the file is written, so writing one needs
        no copy of the table (rows in the store's row order, not sorted by key); a delta's are
        its changes (bounded by the caller: a delta of most rows is written full). The changes are
        taken now; the table must not change until the members are written. With a disk tier and
        `link_to`, a full snapshot holds the rows in RAM, and the file of the rows on disk is hard-linked
        to `link_to` (ps/disk_tier.py: append-only, so the link is the snapshot's as it is now)."""
        if not self._rows.info()["recording"]:
            if delta:
                raise ValueError("a delta snapshot needs an earlier snapshot or restore to be relative to")
            self._rows.track_changes(0)  # from now on: what the checkpoint below holds is the base
        else:
            self._rows.track_changes(1)
        if self._disk is not None:
            self._disk_taken = self._disk.position()
        if delta:
            state = self.snapshot_state(delta=True)
            return [Member.of(k, v) for k, v in state.items()]
        if self._disk is not None and link_to is not None:
            return self.row_members(with_disk=False) + self._disk.link_members(link_to)
        return self.row_members()

    def row_members(self, with_disk: bool = True) -> list[Member]:
        """The whole :meth:`state` (unsorted) as streamed .npz members, read from the row store in
        chunks as they are written (the rows on disk too, unless not `with_disk`); change tracking is
        left as it is."""
        members = self._store_members(0, "", with_disk)
        if self.tracked:
            members.append(Member.of("step", np.array(self._step, dtype=np.int64)))
        if self.admit_after > 1:
            members += self._store_members(1, "candidate_")
        return members

    def _store_members(self, which: int, prefix: str, with_disk: bool = True) -> list[Member]:
        rows = which == 0
        n = int(self._rows.info()["rows" if rows else "candidates"])
        on_disk = len(self._disk) if self._disk is not None and rows and with_disk else 0
        total = n + on_disk
        fields: list[tuple[str, Any, tuple[int, ...]]] = [("keys", np.int64, (total,))]
        if rows:
            fields += [
                ("weights", np.float32, (total, self.dim)),
                ("accumulators", np.float32, (total, self._acc_width)),
            ]
        if self.tracked or not rows:
            fields += [("counts", np.uint32, (total,)), ("last_seen", np.uint32, (total,))]
        return [
            Member(prefix + name, dtype, shape, self._all_chunks(which, name, n, on_disk))
            for name, dtype, shape in fields
        ]

    def _all_chunks(self, which: int, field: str, n: int, on_disk: int) -> Iterator[np.ndarray]:
        """One field of the RAM tier's `n` rows, then of the `on_disk` rows of the disk tier."""
        yield from self._chunks(which, field, n)
        if on_disk and self._disk is not None:
            for part in self._disk.disk.chunks(SNAPSHOT_CHUNK_ROWS):
                records = self._disk.disk.read(part)
                column = {"keys": "key", "weights": "w", "accumulators": "acc"}.get(field, "meta")
                values = records[column]
                yield values if column != "meta" else values[:, 0 if field == "counts" else 1]

    def _chunks(self, which: int, field: str, n: int) -> Iterator[np.ndarray]:
        """One field of a store's `n` live rows, chunk by chunk, in row order (export_from)."""
        size = min(n, SNAPSHOT_CHUNK_ROWS)
        keys = np.empty(size, dtype=np.int64)
        buffers: dict[str, Any] = {"weights": None, "accumulators": None, "meta": None}
        if field == "weights":
            buffers["weights"] = np.empty((size, self.dim), dtype=np.float32)
        elif field == "accumulators":
            buffers["accumulators"] = np.empty((size, self._acc_width), dtype=np.float32)
        elif field in ("counts", "last_seen"):
            buffers["meta"] = np.empty((size, 2), dtype=np.uint32)
        cursor, done = 0, 0
        while done < n:
            got, cursor = self._rows.export_from(
                which,
                cursor,
                keys[: min(size, n - done)],
                *(None if b is None else b[: min(size, n - done)] for b in buffers.values()),
            )
            if got == 0:
                raise RuntimeError(f"the row store changed while a snapshot was written ({done} of {n} rows)")
            done += got
            if field == "keys":
                yield keys[:got]
            elif field in ("weights", "accumulators"):
                yield buffers[field][:got]
            else:
                yield buffers["meta"][:got, 0 if field == "counts" else 1]

    def snapshot_state(self, delta: bool = False) -> dict[str, np.ndarray]:
        """What a checkpoint writes of this table: :meth:`state`, or with `delta` the changes since
        the last durable snapshot or restore: the rows written (their whole :meth:`state` fields),
        ``removed_keys`` (keys gone and not back), the clock, and the same for the keys waiting for
        admission (``candidate_*``). The changes stay pending until :meth:`snapshot_durable`."""
        if not self._rows.info()["recording"]:
            if delta:
                raise ValueError("a delta snapshot needs an earlier snapshot or restore to be relative to")
            self._rows.track_changes(0)  # from now on: what the checkpoint below holds is the base
            if self._disk is not None:
                self._disk_taken = self._disk.position()
            return self.state()
        rows, removed, cand_rows, cand_removed = self._rows.track_changes(1)
        if self._disk is not None:
            self._disk_taken = self._disk.position()
        if not delta:
            return self.state()
        out = self._changes(0, rows, removed)
        if self._disk is not None:
            self._add_disk_changes(out)
        if self.tracked:
            out["step"] = np.array(self._step, dtype=np.int64)
        if self.admit_after > 1:
            cand = self._changes(1, cand_rows, cand_removed)
            out.update({f"candidate_{k}": v for k, v in cand.items()})
        return out

    def _changes(self, which: int, bound: int, removed: int) -> dict[str, np.ndarray]:
        rows = which == 0
        keys = np.empty(bound, dtype=np.int64)
        weights = np.empty((bound, self.dim), dtype=np.float32) if rows else None
        accum = np.empty((bound, self._acc_width), dtype=np.float32) if rows else None
        meta = np.empty((bound, 2), dtype=np.uint32) if self.tracked or not rows else None
        gone = np.empty(removed, dtype=np.int64)
        n = self._rows.export_changes(which, keys, weights, accum, meta, gone)
        # in row order, not sorted: a sorted copy would double what a big delta holds in memory
        out: dict[str, np.ndarray] = {"keys": keys[:n]}
        if weights is not None and accum is not None:
            out["weights"], out["accumulators"] = weights[:n], accum[:n]
        if meta is not None:
            out["counts"], out["last_seen"] = meta[:n, 0], meta[:n, 1]
        # a key removed and then back is in `keys`; removed twice, it is listed once
        out["removed_keys"] = np.setdiff1d(gone, out["keys"]) if len(gone) else gone
        return out

    def _add_disk_changes(self, out: dict[str, np.ndarray]) -> None:
        """A delta of a table with a disk tier: also the rows written to disk since the last durable
        snapshot, and not as removed the keys that only moved between RAM and disk (a spill is a
        removal to the row store)."""
        assert self._disk is not None
        records = self._disk.disk.read(self._disk.written_since(self._disk_mark))
        out["keys"] = np.concatenate([out["keys"], records["key"]])
        out["weights"] = np.concatenate([out["weights"], records["w"]])
        out["accumulators"] = np.concatenate([out["accumulators"], records["acc"]])
        out["counts"] = np.concatenate([out["counts"], records["meta"][:, 0]])
        out["last_seen"] = np.concatenate([out["last_seen"], records["meta"][:, 1]])
        gone = out["removed_keys"]
        out["removed_keys"] = gone[~self._disk.held(gone)]

    def snapshot_durable(self) -> None:
        """The last :meth:`snapshot_state` is committed: its changes are no longer pending."""
        if self._rows.info()["recording"]:
            self._rows.track_changes(2)
            self._disk_mark = self._disk_taken

    def apply_snapshot_changes(self, npz: NpzReader, prefix: str) -> None:
        """Replay a delta snapshot file's members named `prefix` + field (``snapshot_state(delta=True)``)
        onto this table, which holds the state it was relative to: the removed keys go, then the rows
        are set chunk by chunk; then what the table holds is the base of the next delta."""
        if prefix + "step" in npz.names:
            self._step = int(npz.array(prefix + "step"))
            self._rows.set_clock(self._step)
        counted = self.tracked and prefix + "counts" in npz.names
        fields = ["keys", "weights", "accumulators"] + (["counts", "last_seen"] if counted else [])
        self._load_chunks(0, npz, prefix, fields, removed=npz.array(prefix + "removed_keys"))
        if self.admit_after > 1 and prefix + "candidate_keys" in npz.names:
            names = ["candidate_keys", "candidate_counts", "candidate_last_seen"]
            self._load_chunks(1, npz, prefix, names, removed=npz.array(prefix + "candidate_removed_keys"))
        self._restored()

    def load_snapshot(self, npz: NpzReader, prefix: str) -> None:
        """:meth:`load_state` from a full snapshot file's members named `prefix` + field, read in
        chunks into the row store (a restore holds no copy of the table beside it)."""
        self._step = int(npz.array(prefix + "step")) if prefix + "step" in npz.names else 0
        self._rows.set_clock(self._step)
        acc = npz.shape(prefix + "accumulators")
        if acc[1:] != (self._acc_width,):
            raise ValueError(
                f"state accumulators have shape {acc}; optimizer {self.optimizer!r} keeps {self._acc_width} per row"
            )
        counted = self.tracked and prefix + "counts" in npz.names
        fields = ["keys", "weights", "accumulators"] + (["counts", "last_seen"] if counted else [])
        if prefix + "disk_keys" in npz.names:  # the rows on disk are a linked file beside the snapshot
            self._load_linked(npz, prefix)
            self._load_chunks(0, npz, prefix, fields, removed=np.zeros(0, dtype=np.int64))
        else:
            self._load_chunks(0, npz, prefix, fields)
        if self.admit_after > 1:
            waiting = prefix + "candidate_keys" in npz.names
            names = ["candidate_keys", "candidate_counts", "candidate_last_seen"] if waiting else []
            self._load_chunks(1, npz, prefix, names)
        self._restored()

    def _load_linked(self, npz: NpzReader, prefix: str) -> None:
        """Empty the table, then take a snapshot's linked rows on disk: as this table's disk tier, or
        (without one) read into RAM."""
        empty = np.zeros(0, dtype=np.int64)
        self._rows.load(0, empty, np.zeros((0, self.dim), np.float32), np.zeros((0, self._acc_width), np.float32), None)
        if self._disk is not None:
            self._disk.adopt_linked(npz, prefix)
            return
        dtype = record_dtype(self.dim, self._acc_width)
        for records in read_linked(npz, prefix, dtype, SNAPSHOT_CHUNK_ROWS):
            meta = np.ascontiguousarray(records["meta"]) if self.tracked else None
            self._rows.apply(
                0, np.ascontiguousarray(records["key"]), np.ascontiguousarray(records["w"]),
                np.ascontiguousarray(records["acc"]), meta, empty,
            )  # fmt: skip

    def _restored(self) -> None:
        """A restored state is the base of the next delta (RAM and disk alike)."""
        self._rows.track_changes(0)
        if self._disk is not None:
            self._disk_mark = self._disk_taken = self._disk.position()

    def _load_chunks(
        self, which: int, npz: NpzReader, prefix: str, fields: list[str], removed: np.ndarray | None = None
    ) -> None:
        """Empty store `which` (or, for a delta, drop its `removed` keys), then set the rows of
        `fields` (keys first) chunk by chunk."""
        rows = which == 0
        empty = np.zeros(0, dtype=np.int64)
        if rows and self._disk is not None:
            if removed is None:
                self._disk.disk.clear()
            else:
                self._disk.removed(removed)
        if removed is None:
            self._rows.load(
                which,
                empty,
                np.zeros((0, self.dim), np.float32) if rows else None,
                np.zeros((0, self._acc_width), np.float32) if rows else None,
                None,
            )
        else:
            self._rows.apply(which, empty, None, None, None, np.ascontiguousarray(removed, dtype=np.int64))
        if not fields:
            return
        streams = [npz.chunks(prefix + f, SNAPSHOT_CHUNK_ROWS) for f in fields]
        for parts in zip(*streams, strict=True):
            part = dict(zip([f.removeprefix("candidate_") for f in fields], parts, strict=True))
            n = len(part["keys"])
            meta = None
            if "counts" in part:
                meta = np.ascontiguousarray(
                    np.stack([part["counts"], part["last_seen"]], axis=1), dtype=np.uint32
                )
            self._rows.apply(
                which,
                np.ascontiguousarray(part["keys"], dtype=np.int64),
                np.ascontiguousarray(part["weights"], dtype=np.float32).reshape(n, self.dim)
                if rows
                else None,
                np.ascontiguousarray(part["accumulators"], dtype=np.float32).reshape(n, self._acc_width)
                if rows
                else None,
                meta,
                empty,
            )
            if rows and self._disk is not None:  # the rows set are in RAM now, their records (if any) dead
                self._disk.removed(np.ascontiguousarray(part["keys"], dtype=np.int64))
                self._disk.make_room(0, keep_now=False)

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace the contents with a :meth:`state` (keys must be distinct). Counters missing from
        it (a state of an untracked table) start at one pull, seen at the state's step."""
        keys = np.ascontiguousarray(state["keys"], dtype=np.int64)
        weights = np.ascontiguousarray(state["weights"], dtype=np.float32).reshape(len(keys), self.dim)
        accum = np.ascontiguousarray(state["accumulators"], dtype=np.float32)
        if accum.size != len(keys) * self._acc_width:
            raise ValueError(
                f"state accumulators have {accum.size} values for {len(keys)} rows; optimizer "
                f"{self.optimizer!r} keeps {self._acc_width} per row"
            )
        self._step = int(state["step"]) if "step" in state else 0
        self._rows.set_clock(self._step)
        meta = None
        if self.tracked and "counts" in state:
            meta = np.ascontiguousarray(
                np.stack([state["counts"], state["last_seen"]], axis=1), dtype=np.uint32
            )
        if self._disk is not None:
            self._disk.disk.clear()
        self._rows.load(0, keys, weights, accum.reshape(len(keys), self._acc_width), meta)
        if self._disk is not None:
            self._disk.make_room(0, keep_now=False)
        if self.admit_after > 1:
            ckeys = np.ascontiguousarray(state.get("candidate_keys", np.zeros(0)), dtype=np.int64)
            cmeta = np.zeros((len(ckeys), 2), dtype=np.uint32)
            if len(ckeys):
                cmeta = np.ascontiguousarray(
                    np.stack([state["candidate_counts"], state["candidate_last_seen"]], axis=1),
                    dtype=np.uint32,
                )
            self._rows.load(1, ckeys, None, None, cmeta)
        self._restored()
