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

Keys become rows on the device, in three steps a batch:

* :meth:`DeviceTable.dedupe` (the data reader's part, ahead of training, on a stream of its own on a
  GPU): the batch's raw keys are copied over once (from pinned memory) and made distinct
  (``torch.unique``: the distinct keys, where each key sits among them, how often each occurs);
* :meth:`DeviceTable.resolve` (the training thread, in batch order): the distinct keys are looked up in
  the device's key index (ps/device_index.py); the host waits for the device once, for the keys it does
  not hold, and fetches only those from the shards; their rows come in, evicting the least recently
  used first. The batch's rows are pinned until its push, so no eviction takes a row in flight;
* :meth:`DeviceTable.gather` and :meth:`DeviceTable.apply`: the rows, and one Adagrad step per distinct
  row, entirely on the device.

Sync stays exact: one DataWorker trains, so a row the tier holds is the row (the shards' copy is stale
until the next flush, and nothing reads it meanwhile), and a push is the CPU store's arithmetic
(ps/_rows.c): the gradients of repeated keys summed in float64, then Adagrad or row-wise Adagrad in
float32, one rounding per operation. On the CPU the float64 sums run in the keys' order, as the store's
do (bit for bit, tests/test_device_table.py); a GPU adds them in the order its atomics land, which can
differ from the store's only where a float64 sum of the batch's float32 gradients rounds differently:
the H200 run of 2026-12-04 found the GPU tier's rows equal to the CPU rows' bit for bit
(scripts/gpu_check.py, BENCHMARKS.md "The GPU tier").

Example::

    table = DeviceTable(TableSpec(dim=16), torch.device("cuda"), capacity=10_000_000)
    batch = table.resolve(table.dedupe(keys), client, "embedding", step)
    rows = table.gather(batch)                         # float32[n, 16] on the GPU
    table.apply(batch, grads)                          # Adagrad on the GPU
    table.flush(client, "embedding")                   # changed rows back to the shards
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from heterps_ray.ps.device_index import DeviceIndex
from heterps_ray.ps.row_bytes import device_rows_within
from heterps_ray.ps.table import ADAGRAD_EPS
from heterps_ray.ps.tier_stats import TierStats

if TYPE_CHECKING:
    from heterps_ray.ps.client import PSClient
    from heterps_ray.ps.spec import TableSpec

_FIRST_ROWS = 1 << 12  # slots allocated at first; doubled as the table grows, up to the capacity
DEFAULT_SLOT = 0  # the row of keys without one (not admitted): zeros that never learn
# share of a GPU's free memory left to the stage's activations, gradients and the allocator's slack
DEVICE_RESERVE_SHARE = 0.2


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


@dataclass
class Deduped:
    """A batch's keys on the device, made distinct: ``keys.ravel() == unique[inverse]``, and how often
    each distinct key occurs."""

    shape: tuple[int, ...]
    unique: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    ready: Any = None  # a GPU: the event of the reader's stream after it (the training thread waits on it)


@dataclass
class Resolved:
    """A batch's place in the table: the slot of each distinct key (DEFAULT_SLOT: not admitted) and
    where each key sits among them. Its rows stay pinned until :meth:`DeviceTable.apply` (or
    :meth:`DeviceTable.release`)."""

    shape: tuple[int, ...]
    slots: torch.Tensor
    inverse: torch.Tensor


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
        # a GPU: the reader copies and dedupes on a stream of its own, beside the training thread's
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.clear()

    def clear(self) -> None:
        """Hold nothing (at the start, and after the shards were restored: they are the truth again);
        the stats stay."""
        self.index = DeviceIndex(self.device)
        self._tags: list[tuple[int, int, int]] = []  # batches applied since the last flush
        self._slots = 0  # rows allocated, the default row's included
        self._used = 1  # slots ever handed out (slot 0: the default row)
        self._free = torch.zeros(0, dtype=torch.int64, device=self.device)  # slots given back, reused first
        self._grow(min(self.capacity, _FIRST_ROWS))

    # -- storage ---------------------------------------------------------------------------------

    def _grow(self, rows: int) -> None:
        """Room for `rows` rows (and the default row, zeros, in slot 0), keeping what is held."""
        acc_width = 1 if self.rowwise else self.dim
        old, slots = self._slots, rows + 1
        fresh = {
            "weights": torch.zeros(slots, self.dim, dtype=torch.float32, device=self.device),
            "accum": torch.zeros(slots, acc_width, dtype=torch.float32, device=self.device),
            "dirty": torch.zeros(slots, dtype=torch.bool, device=self.device),
            "held": torch.zeros(slots, dtype=torch.bool, device=self.device),
            "last_used": torch.zeros(slots, dtype=torch.int64, device=self.device),
            "key_of": torch.zeros(slots, dtype=torch.int64, device=self.device),
            "pins": torch.zeros(slots, dtype=torch.int32, device=self.device),  # batches in flight using it
        }
        if old:
            for name, tensor in fresh.items():
                tensor[:old] = getattr(self, name)
        self.weights, self.accum = fresh["weights"], fresh["accum"]
        self.dirty, self.held, self.last_used = fresh["dirty"], fresh["held"], fresh["last_used"]
        self.key_of, self.pins = fresh["key_of"], fresh["pins"]
        self._slots = slots

    @property
    def nbytes(self) -> int:
        """Device bytes held: rows, state and bookkeeping of every slot allocated, and the key index."""
        tensors = (self.weights, self.accum, self.dirty, self.held, self.last_used, self.key_of, self.pins)
        return sum(int(t.numel() * t.element_size()) for t in tensors) + self.index.nbytes

    def __len__(self) -> int:
        return len(self.index)

    # -- reading -----------------------------------------------------------------------------------

    def dedupe(self, keys: np.ndarray | torch.Tensor) -> Deduped:
        """A batch's raw keys (any shape) on the device, distinct (:class:`Deduped`). Depends on the keys
        alone, so the reader runs it ahead of training; on a GPU from pinned memory, on its own stream."""
        host = torch.as_tensor(
            np.ascontiguousarray(keys, dtype=np.int64) if isinstance(keys, np.ndarray) else keys
        )
        shape = tuple(host.shape)
        if self._stream is None:
            unique, inverse, counts = torch.unique(host.ravel(), return_inverse=True, return_counts=True)
            return Deduped(shape, unique, inverse, counts)
        with torch.cuda.stream(self._stream):
            on_device = host.ravel().pin_memory().to(self.device, non_blocking=True)
            unique, inverse, counts = torch.unique(on_device, return_inverse=True, return_counts=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return Deduped(shape, unique, inverse, counts, ready)

    def resolve(self, batch: Deduped, backing: PSClient, table: str, step: int | None) -> Resolved:
        """The slots of a batch's distinct keys: looked up in the key index; the ones it lacks fetched
        from the shards (rows created, admission counted) and taken in, making room first. Marks them
        used at `step` (the cache's recency) and pins them until the batch's push. In batch order, on
        the training thread; the host waits for the device once, for the keys the index lacks."""
        if batch.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(batch.ready)
            for tensor in (batch.unique, batch.inverse, batch.counts):
                tensor.record_stream(torch.cuda.current_stream(self.device))
        slots = self.index.lookup(batch.unique)
        found = slots >= 0
        self.pins.index_add_(0, torch.where(found, slots, DEFAULT_SLOT), found.int())
        missing = torch.nonzero(~found).ravel()  # the one wait for the device
        misses = int(batch.counts[missing].sum()) if len(missing) else 0
        self.stats.misses += misses
        self.stats.hits += int(np.prod(batch.shape)) - misses
        if len(missing):
            slots[missing] = self._take(batch.unique[missing], backing, table, step)
        if step is not None:
            self.last_used[slots] = step
        return Resolved(batch.shape, slots, batch.inverse)

    def _take(self, keys: torch.Tensor, backing: PSClient, table: str, step: int | None) -> torch.Tensor:
        """Fetch distinct `keys` from the shards and hold the admitted ones, pinned; their slots
        (DEFAULT_SLOT: not admitted)."""
        host_keys = keys.cpu().numpy()
        weights, accum, admitted = backing.fetch_rows(table, host_keys, step)
        out = torch.full((len(keys),), DEFAULT_SLOT, dtype=torch.int64, device=self.device)
        new = np.flatnonzero(admitted)
        if not len(new):
            return out
        placed = self._allocate(len(new), backing, table)
        self.index.insert(keys[torch.from_numpy(new).to(self.device)], placed)
        self.weights[placed] = torch.from_numpy(weights[new]).to(self.device)
        self.accum[placed] = torch.from_numpy(accum[new]).to(self.device)
        self.key_of[placed] = torch.from_numpy(host_keys[new]).to(self.device)
        self.dirty[placed] = False
        self.held[placed] = True
        self.pins[placed] = 1
        out[torch.from_numpy(new).to(self.device)] = placed
        self.stats.fetched += len(new)
        return out

    def _allocate(self, rows: int, backing: PSClient, table: str) -> torch.Tensor:
        """Slots for `rows` new rows: freed ones first, then new ones (growing the storage), after
        making room within the capacity."""
        self._make_room(rows, backing, table)
        reused = min(rows, len(self._free))
        slots = self._free[len(self._free) - reused :]
        self._free = self._free[: len(self._free) - reused]
        fresh = rows - reused
        if fresh:
            if self._used + fresh > self._slots:
                self._grow(min(self.capacity, max(self._used + fresh - 1, 2 * (self._slots - 1))))
            slots = torch.cat([slots, torch.arange(self._used, self._used + fresh, device=self.device)])
            self._used += fresh
        return slots

    def _make_room(self, rows: int, backing: PSClient, table: str) -> None:
        """Before `rows` new rows come in: evict the least recently used rows that no batch in flight
        pins, 1/16 of the capacity beyond what is needed so that evictions stay rare; the ones that
        changed go back to the shards first."""
        held = len(self.index)
        if held + rows <= self.capacity:
            return
        score = torch.where(self.held & (self.pins == 0), self.last_used, torch.iinfo(torch.int64).max)
        free = int((score < torch.iinfo(torch.int64).max).sum())
        if held - free + rows > self.capacity:
            raise RuntimeError(
                f"the GPU table holds {self.capacity:,} rows and one batch needs {held - free + rows:,}: raise "
                "the type's gpu_memory_gb or lower the batch size"
            )
        over = min(held + rows - self.capacity + self.capacity // 16, free)
        victims = torch.topk(score, over, largest=False, sorted=False).indices.sort().values
        changed = victims[self.dirty[victims]]
        if len(changed):
            self._send(backing, table, changed, tags=[])  # their batches are counted at the next flush
        self.index.remove(self.key_of[victims])
        self.held[victims] = False
        self.dirty[victims] = False
        self._free = torch.cat([self._free, victims])
        self.stats.evicted += over

    def gather(self, batch: Resolved) -> torch.Tensor:
        """The batch's rows, float32[*shape, dim] on this device."""
        return self.weights.index_select(0, batch.slots[batch.inverse]).reshape(*batch.shape, self.dim)

    # -- writing -----------------------------------------------------------------------------------

    def apply(self, batch: Resolved, grads: torch.Tensor, tag: tuple[int, int, int] | None = None) -> None:
        """One optimizer step with the batch's `grads` (float32[n, dim], one per key), the gradients of
        repeated keys summed in float64 first, one step per distinct row (a key not admitted: dropped).
        Releases the batch's rows. `tag` (DataWorker, batch, generation): the batch, counted by the
        shards at the next flush. Nothing here waits for the device."""
        slots = batch.slots
        summed = torch.zeros(len(slots), self.dim, dtype=torch.float64, device=self.device)
        summed.index_add_(0, batch.inverse, grads.reshape(-1, self.dim).to(torch.float64))
        learns = slots != DEFAULT_SLOT
        g = summed.to(torch.float32) * learns[:, None]  # the default row takes a zero step: it stays zeros
        w, acc = self.weights.index_select(0, slots), self.accum.index_select(0, slots)
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
        self.weights.index_copy_(0, slots, w)
        self.accum.index_copy_(0, slots, acc)
        self.dirty[slots] = True
        self.release(batch)
        if tag is not None:
            self._tags.append(tag)

    def release(self, batch: Resolved) -> None:
        """Unpin a batch's rows (its push applied them, or it was dropped)."""
        learns = batch.slots != DEFAULT_SLOT
        self.pins.index_add_(0, batch.slots, -learns.int())

    def flush(self, backing: PSClient, table: str) -> list[Any]:
        """Every changed row back to the shards, with the batches applied since the last flush (every
        shard counts them). Returns the shards' refs (none when hosted)."""
        changed = torch.nonzero(self.dirty & self.held).ravel()
        refs = self._send(backing, table, changed, self._tags)
        self._tags = []
        self.dirty[:] = False
        return refs

    def _send(
        self, backing: PSClient, table: str, slots: torch.Tensor, tags: list[tuple[int, int, int]]
    ) -> list[Any]:
        refs = backing.put_rows(
            table,
            self.key_of[slots].cpu().numpy(),
            self.weights[slots].cpu().numpy(),
            self.accum[slots].cpu().numpy(),
            tags,
        )
        self.stats.written_back += len(slots)
        return refs


def _sqrt(values: torch.Tensor) -> torch.Tensor:
    """float32 square roots rounded correctly, as C's sqrtf: through float64, which is exact for them
    (torch's vectorised float32 sqrt on the CPU is within an ulp, not rounded correctly)."""
    return values.to(torch.float64).sqrt().to(torch.float32)
