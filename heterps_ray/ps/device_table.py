"""A sparse table's rows in a GPU's memory, in front of the PS shards (DESIGN.md §1, "Table tiers").

A DataWorker whose stage 0 runs on a ``cuda`` type keeps the rows it trains in its GPU's memory: weights
and Adagrad state as tensors on its device, pulled by a gather and updated in place. The PS shards behind
it (hosted in the same process, or actors) stay the home of every row, so checkpoints, recovery, export
and a re-plan that moves the table read them as they always did:

* a row the tier does not hold is fetched from the shards, which create it lazily from (key, seed) and
  count it for admission as a pull does (a key not admitted yet reads the default row, zeros, and its
  gradient is dropped, as on the CPU);
* a row the tier changed goes back to the shards (:meth:`DeviceTable.flush`) on eviction, before each
  checkpoint, before evaluation and at the end, with the batches whose updates it carries (the shards
  count them, so the run's accounting still proves every batch applied once).

One path, two sizes: `capacity` rows at most (the GPU memory budget over the bytes of a row). A table
that fits never evicts (all rows in GPU memory); a bigger one is a cache of the most recently used rows,
the least recently used going back to the shards to make room.

Sync stays exact: one DataWorker trains, so a row the tier holds is the row (the shards' copy is stale
until the next flush, and nothing reads it meanwhile), and a push is the CPU store's arithmetic
(ps/_rows.c): the gradients of repeated keys summed in float64, then Adagrad or row-wise Adagrad in
float32, one rounding per operation. With no data-dependent sizes on the device, a push never waits for
the GPU.

Keys map to slots on the CPU (:class:`KeyIndex`: the compiled row store used as a plain index, its row
numbers are the slots). The data reader looks a chunk's keys up ahead, without the GIL
(:meth:`DeviceTable.locate`); the training thread resolves what was missing, in batch order.

Example::

    table = DeviceTable(TableSpec(dim=16), torch.device("cuda"), capacity=10_000_000)
    slots = table.resolve(keys, table.locate(keys), client, step)    # int64[n], -1: not admitted
    rows = table.gather(slots_on_device)                               # float32[n, 16] on the GPU
    table.apply(slots_on_device, grads)                                # Adagrad on the GPU
    table.flush(client, tags)                                          # changed rows back to the shards
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from heterps_ray.ps._rows import Rows as _Rows
from heterps_ray.ps.table import ADAGRAD_EPS, device_rows_within
from heterps_ray.ps.tier_stats import TierStats

if TYPE_CHECKING:
    from heterps_ray.ps.client import PSClient
    from heterps_ray.ps.spec import TableSpec

_FIRST_ROWS = 1 << 12  # slots allocated at first; doubled as the table grows, up to the capacity
# share of a GPU's free memory left to the stage's activations, gradients and the allocator's slack
DEVICE_RESERVE_SHARE = 0.2
# B/row the index costs on the host: its row (key, a weight, an accumulator) and slots at their sparsest
INDEX_BYTES_PER_ROW = 16 + (4 + 1) / 0.375


def device_table_rows(device: torch.device, spec: TableSpec) -> int:
    """Rows a device holds for a table when its type names no budget: its free memory now, less a
    reserve for the stage's own tensors (DEVICE_RESERVE_SHARE of what is free, at least 1 GiB); on
    the CPU (the test flag maps a cuda type there) a fixed 1 GiB."""
    if device.type != "cuda":
        budget = float(1 << 30)
    else:
        free, _ = torch.cuda.mem_get_info(device)
        budget = free - max(DEVICE_RESERVE_SHARE * free, float(1 << 30))
    return max(1, device_rows_within(budget, spec.dim, spec.optimizer))


class KeyIndex:
    """key -> slot (0, 1, ...), on the compiled row store; freed slots are reused first, so the slots in
    use stay below the most ever held at once. Lookups may come from another thread than inserts and
    removals: a readers-writer lock keeps them apart, and a lookup runs without the GIL."""

    def __init__(self) -> None:
        # dim 1, no counters, no admission: a plain index (ps/_rows.c `rows`)
        self._rows = _Rows(1, 0, 0.0, 0.0, 0.0, False, False, 1, 0, 0, False)
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def version(self) -> int:
        """Removals so far: a slot found at one version is still that key's while it stays the same."""
        return int(self._rows.info()["removals"])

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """(slot of each key, -1 where absent; the version they are good for)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        out = np.empty(len(keys), dtype=np.int64)
        with self._cond:
            while self._writing:
                self._cond.wait()
            self._readers += 1
            version = self.version
        try:
            self._rows.rows(keys, out, False)
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()
        return out, version

    def insert(self, keys: np.ndarray) -> np.ndarray:
        """Slots for distinct keys not held yet."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        out = np.empty(len(keys), dtype=np.int64)
        with self._writer():
            self._rows.rows(keys, out, True)
        return out

    def remove(self, keys: np.ndarray) -> None:
        empty = np.zeros(0, dtype=np.int64)
        with self._writer():
            self._rows.apply(0, empty, None, None, None, np.ascontiguousarray(keys, dtype=np.int64))

    def _writer(self) -> _Writing:
        return _Writing(self)


class _Writing:
    """KeyIndex's writer side of its lock (waits for the lookups in progress)."""

    def __init__(self, index: KeyIndex):
        self.index = index

    def __enter__(self) -> None:
        with self.index._cond:
            while self.index._writing or self.index._readers:
                self.index._cond.wait()
            self.index._writing = True

    def __exit__(self, *exc: object) -> None:
        with self.index._cond:
            self.index._writing = False
            self.index._cond.notify_all()


class DeviceTable:
    """One sparse table's rows on `device` (at most `capacity` of them), in front of PS shards."""

    def __init__(self, spec: TableSpec, device: torch.device, capacity: int):
        if capacity < 1:
            raise ValueError(f"a device table needs a capacity of at least 1 row (got {capacity})")
        self.spec, self.device, self.capacity = spec, device, int(capacity)
        self.dim = spec.dim
        self.rowwise = spec.optimizer == "rowwise_adagrad"
        self.stats = TierStats()
        self._lr = torch.tensor(spec.lr, dtype=torch.float32, device=device)
        self.clear()

    def clear(self) -> None:
        """Hold nothing (at the start, and after the shards were restored: they are the truth again);
        the stats stay."""
        self.index = KeyIndex()
        self._tags: list[tuple[int, int, int]] = []  # batches applied since the last flush
        self.keys = np.zeros(0, dtype=np.int64)  # the key held in each slot (host)
        self._slots = 0
        self._grow(min(self.capacity, _FIRST_ROWS))

    # -- storage ---------------------------------------------------------------------------------

    def _grow(self, slots: int) -> None:
        """Room for `slots` rows (plus the default row, zeros, at the end), keeping what is held."""
        acc_width = 1 if self.rowwise else self.dim
        old = self._slots
        fresh = {
            "weights": torch.zeros(slots + 1, self.dim, dtype=torch.float32, device=self.device),
            "accum": torch.zeros(slots + 1, acc_width, dtype=torch.float32, device=self.device),
            "dirty": torch.zeros(slots + 1, dtype=torch.bool, device=self.device),
            "held": torch.zeros(slots + 1, dtype=torch.bool, device=self.device),
            "last_used": torch.zeros(slots + 1, dtype=torch.int64, device=self.device),
        }
        keys = np.zeros(slots, dtype=np.int64)
        if old:
            for name, tensor in fresh.items():
                tensor[:old] = getattr(self, name)[:old]
            keys[:old] = self.keys[:old]
        self.weights, self.accum = fresh["weights"], fresh["accum"]
        self.dirty, self.held, self.last_used = fresh["dirty"], fresh["held"], fresh["last_used"]
        self.keys = keys
        self._owner = torch.zeros(slots + 1, dtype=torch.int64, device=self.device)
        self._slots = slots

    @property
    def default_slot(self) -> int:
        """The row of the keys without one (not admitted): zeros that never learn."""
        return self._slots

    @property
    def nbytes(self) -> int:
        """Device bytes held: rows, state and bookkeeping of every slot allocated."""
        tensors = (self.weights, self.accum, self.dirty, self.held, self.last_used, self._owner)
        return sum(int(t.numel() * t.element_size()) for t in tensors)

    def __len__(self) -> int:
        return len(self.index)

    # -- reading -----------------------------------------------------------------------------------

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """The slots of `keys` (any shape, flattened; -1 where not held) and the index version they are
        good for. Thread-safe, no GIL held: the data reader calls it ahead of training."""
        return self.index.lookup(keys)

    def resolve(
        self,
        keys: np.ndarray,
        located: tuple[np.ndarray, int] | None,
        backing: PSClient,
        table: str,
        step: int | None,
    ) -> np.ndarray:
        """The slot of each key (flattened), -1 for a key without a row (not admitted): what was
        located ahead where it still holds, then the keys missing looked up again, and those still
        missing fetched from the shards (rows created, admission counted) and taken in, making room
        first. In batch order, on the training thread."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        slots, version = located if located is not None else self.index.lookup(keys)
        if version != self.index.version:  # rows left since the lookup: their slots may be others' now
            slots, _ = self.index.lookup(keys)
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            slots[missing] = self.index.lookup(keys[missing])[0]
            missing = missing[slots[missing] < 0]
        self.stats.hits += len(keys) - len(missing)
        self.stats.misses += len(missing)
        if len(missing):
            wanted, inverse = np.unique(keys[missing], return_inverse=True)
            taken = self._take(wanted, slots[slots >= 0], backing, table, step)
            slots[missing] = taken[inverse]
        return slots

    def _take(
        self, keys: np.ndarray, in_use: np.ndarray, backing: PSClient, table: str, step: int | None
    ) -> np.ndarray:
        """Fetch distinct `keys` from the shards and hold the admitted ones; their slots (-1: not
        admitted). `in_use`: the slots the batch holds already (they stay)."""
        weights, accum, admitted = backing.fetch_rows(table, keys, step)
        out = np.full(len(keys), -1, dtype=np.int64)
        new = np.flatnonzero(admitted)
        if not len(new):
            return out
        self._make_room(len(new), in_use, backing, table)
        placed = self.index.insert(keys[new])
        top = int(placed.max()) + 1
        if top > self._slots:
            self._grow(min(self.capacity, max(top, 2 * self._slots)))
        where = torch.from_numpy(placed).to(self.device)
        self.weights[where] = torch.from_numpy(weights[new]).to(self.device)
        self.accum[where] = torch.from_numpy(accum[new]).to(self.device)
        self.dirty[where] = False
        self.held[where] = True
        self.keys[placed] = keys[new]
        out[new] = placed
        self.stats.fetched += len(new)
        return out

    def _make_room(self, rows: int, in_use: np.ndarray, backing: PSClient, table: str) -> None:
        """Before `rows` new rows come in: evict the least recently used (never the batch's own,
        `in_use`), 1/16 of the capacity beyond what is needed so that evictions stay rare; the ones
        that changed go back to the shards first."""
        held = len(self.index)
        if held + rows <= self.capacity:
            return
        keep = len(np.unique(in_use))
        if keep + rows > self.capacity:
            raise RuntimeError(
                f"the GPU table holds {self.capacity:,} rows and one batch needs {keep + rows:,}: raise "
                "the type's gpu_memory_gb or lower the batch size"
            )
        over = min(held + rows - self.capacity + self.capacity // 16, held - keep)
        score = torch.where(
            self.held[: self._slots], self.last_used[: self._slots], torch.iinfo(torch.int64).max
        )
        if len(in_use):
            score[torch.from_numpy(in_use).to(self.device)] = torch.iinfo(torch.int64).max
        victims = torch.topk(score, over, largest=False, sorted=False).indices.sort().values
        changed = victims[self.dirty[victims]].cpu().numpy()
        if len(changed):
            self._send(backing, table, changed, tags=[])  # their batches are counted at the next flush
        self.index.remove(self.keys[victims.cpu().numpy()])
        self.held[victims] = False
        self.dirty[victims] = False
        self.stats.evicted += over

    def gather(self, slots: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """The rows of `slots` (on this device; -1: the default row), float32[n, dim]. `step` marks
        them used (the cache's recency)."""
        safe = torch.where(slots >= 0, slots, self.default_slot)
        if step is not None:
            self.last_used[safe] = step
        return self.weights[safe]

    # -- writing -----------------------------------------------------------------------------------

    def apply(
        self, slots: torch.Tensor, grads: torch.Tensor, tag: tuple[int, int, int] | None = None
    ) -> None:
        """One optimizer step with `grads` (float32[n, dim], one per slot; -1: dropped), the gradients
        of repeated slots summed in float64 first. Sizes are fixed: nothing waits for the device.
        `tag` (DataWorker, batch, generation): the batch, counted by the shards at the next flush."""
        n = len(slots)
        valid = slots >= 0
        safe = torch.where(valid, slots, self.default_slot)
        g64 = grads.reshape(n, self.dim).to(torch.float64) * valid[:, None]
        # one position per distinct slot stands for it (whichever the scatter keeps: any will do)
        self._owner.scatter_(0, safe, torch.arange(n, device=self.device))
        first = self._owner[safe]
        summed = torch.zeros(n, self.dim, dtype=torch.float64, device=self.device)
        summed.index_add_(0, first, g64)
        g = summed[first].to(torch.float32)
        w, acc = self.weights[safe], self.accum[safe]
        if self.rowwise:
            squares = g.to(torch.float64) * g.to(torch.float64)
            total = squares[:, 0]
            for c in range(1, self.dim):  # in column order, as ps/_rows.c sums them
                total = total + squares[:, c]
            acc = acc + (total / self.dim).to(torch.float32)[:, None]
            mult = torch.div(self._lr, _sqrt(acc) + ADAGRAD_EPS)
            w = w - mult * g
        else:
            acc = acc + g * g
            w = w - (g * self._lr) / (_sqrt(acc) + ADAGRAD_EPS)
        self.weights.index_put_((safe,), w)
        self.accum.index_put_((safe,), acc)
        self.dirty[safe] = True
        if tag is not None:
            self._tags.append(tag)

    def flush(self, backing: PSClient, table: str) -> list[Any]:
        """Every changed row back to the shards, with the batches applied since the last flush (every
        shard counts them). Returns the shards' refs (none when hosted)."""
        changed = torch.nonzero(self.dirty[: self._slots] & self.held[: self._slots]).ravel().cpu().numpy()
        refs = self._send(backing, table, changed, self._tags)
        self._tags = []
        self.dirty[:] = False
        return refs

    def _send(
        self, backing: PSClient, table: str, slots: np.ndarray, tags: list[tuple[int, int, int]]
    ) -> list[Any]:
        where = torch.from_numpy(slots).to(self.device)
        refs = backing.put_rows(
            table, self.keys[slots], self.weights[where].cpu().numpy(), self.accum[where].cpu().numpy(), tags
        )
        self.stats.written_back += len(slots)
        return refs


def _sqrt(values: torch.Tensor) -> torch.Tensor:
    """float32 square roots rounded correctly, as C's sqrtf: through float64, which is exact for them
    (torch's vectorised float32 sqrt on the CPU is within an ulp, not rounded correctly)."""
    return values.to(torch.float64).sqrt().to(torch.float32)
