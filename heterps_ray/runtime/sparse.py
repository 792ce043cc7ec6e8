"""How a DataWorker moves its sparse rows between the table and its micro-batches: one link to the
sparse table, chosen once when the worker starts (:func:`sparse_link`), and the two schedules of the
modes (modes.py) behind one interface, so that the DataWorker runs one path whatever its mode and
wherever its rows live.

The links (rows and gradients cross them as tensors on the worker's device):

* :class:`SparseRows` — the rows live on the PS shards (actors, or hosted in this process): a batch's
  rows are pulled to the CPU, copied to the device, and its gradient copied back and pushed.
* :class:`DeviceRows` — the rows live in this worker's GPU memory (ps/device_table.py), in front of the
  shards: a pull is a gather on the device and a push is Adagrad there; only rows the GPU does not hold
  are fetched from the shards, and changed rows go back to them before checkpoints, evaluation and the
  end (:meth:`DeviceRows.flush`). What reaches the device per batch is its raw keys, once: they are made
  distinct and mapped to rows there (the reader dedupes them ahead).

The schedules:

* :class:`PerBatch` (sync): a batch's rows are pulled once before its first micro-batch and its
  gradient is pushed once after its last micro-batch went backward, so Adagrad sees the reference
  trainer's per-batch gradient; the next batch starts after that push (batches never overlap). Each
  micro-batch loss is scaled by mb/B, so the micro-batch gradients sum to the batch's gradient and the
  dense weights step once, after the batch's last micro-batch.
* :class:`PerMicroBatch` (async): each micro-batch pulls its rows when it starts and pushes its
  gradient when it is done, one update each; up to ``runtime.batches_ahead`` batches stay in flight
  after their last micro-batch was submitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import ray
import torch

from heterps_ray.ps.client import KeySplit, PSClient
from heterps_ray.ps.device_table import Deduped, DeviceTable, Resolved, device_table_rows
from heterps_ray.ps.spec import TableSpec
from heterps_ray.runtime import trace

SPARSE_TABLE = "embedding"  # the one sparse table all slots share (slots are mixed into the keys)
_PUSHES_IN_FLIGHT_PER_SHARD = 4  # async: sparse pushes left unanswered per shard (bounds memory)


@dataclass
class Pulled:
    """Rows a link handed out, float32[*keys.shape, dim] on the worker's device, and what the push of
    their gradient needs: the keys and their split (on the shards), or their place in GPU memory."""

    rows: torch.Tensor
    keys: np.ndarray
    split: KeySplit | None = None
    resolved: Resolved | None = None


class SparseLink(Protocol):
    """A DataWorker's link to its sparse table: :class:`SparseRows` or :class:`DeviceRows`."""

    ps: PSClient  # the shards, wherever the rows live
    updates: int  # sparse updates made (one per batch in sync, per micro-batch in async)

    def prepare(self, keys: np.ndarray) -> Any:
        """What the reader thread works out ahead for a batch's `keys` (its split, or its distinct keys
        on the device)."""

    def pull(self, keys: np.ndarray, prepared: Any, batch: int) -> Pulled: ...

    def push(self, pulled: Pulled, grads: torch.Tensor, batch: int) -> None: ...

    def lookup(self, keys: np.ndarray) -> torch.Tensor:
        """Rows for evaluation, on the device: none are created."""

    def settle(self, keep: int = 0) -> None:
        """Wait for all but the newest `keep` calls to the shards (bounds memory; surfaces PS errors)."""

    def flush(self) -> None:
        """Every row changed here is on the shards (before a checkpoint, evaluation, the end)."""

    def rewire(self, generation: int, ps: PSClient) -> None:
        """After a fault: forget what is in flight, tag later calls `generation`, use `ps`."""

    def reset(self) -> None:
        """The shards were restored: drop any row held here."""

    def stats(self) -> dict[str, Any]:
        """Where the rows live and, in GPU memory, the tier's counters (hit rate)."""


def sparse_link(
    ps: PSClient,
    worker: int,
    workers: int,
    generation: int,
    device: torch.device,
    spec: TableSpec | None,
    gpu_rows: int,
) -> SparseLink:
    """The link of a DataWorker: its rows in `device`'s memory when `gpu_rows` is not 0 (the rows the
    plan gives the GPU tier, ps/device_table.py; -1: as many as the device's free memory holds), else on
    the shards."""
    if not gpu_rows:
        return SparseRows(ps, worker, workers, generation, device)
    if spec is None:
        raise ValueError("a DataWorker with its rows in GPU memory needs its table's spec")
    if gpu_rows < 0:
        gpu_rows = device_table_rows(device, spec)
    return DeviceRows(ps, worker, workers, generation, DeviceTable(spec, device, gpu_rows))


class _Tagged:
    """What both links share: the shards' client, the worker's tags, the clock, calls in flight."""

    def __init__(self, ps: PSClient, worker: int, workers: int, generation: int):
        self.ps, self.worker, self.workers, self.generation = ps, worker, workers, generation
        self.updates = 0
        self._refs: list[Any] = []

    def clock(self, batch: int) -> int:
        """The global batch index of this worker's `batch`, the clock of the table's admission counts
        and TTL: batches of the DataWorkers interleaved, a function of the position in the data only,
        so a replay after a fault sees the same clock."""
        return batch * self.workers + self.worker

    def settle(self, keep: int = 0) -> None:
        if len(self._refs) > keep:
            cut = len(self._refs) - keep
            ray.get(self._refs[:cut])
            del self._refs[:cut]

    def rewire(self, generation: int, ps: PSClient) -> None:
        self._refs.clear()
        self.generation, self.ps = generation, ps
        self.reset()

    def reset(self) -> None:
        pass


class SparseRows(_Tagged):
    """The rows on the PS shards: pulls to the CPU and the device, pushes back. Pushes are tagged
    (worker, batch, generation), so the shards count each batch and drop the pushes of calls sent
    before a recovery."""

    def __init__(self, ps: PSClient, worker: int, workers: int, generation: int, device: torch.device):
        super().__init__(ps, worker, workers, generation)
        self.device = device

    def prepare(self, keys: np.ndarray) -> KeySplit | None:
        return self.ps.split(keys)

    def pull(self, keys: np.ndarray, prepared: KeySplit | None, batch: int) -> Pulled:
        rows = self.ps.pull(SPARSE_TABLE, keys, split=prepared, step=self.clock(batch))
        if trace.on():
            trace.event("pull", f"data worker {self.worker}", {"keys": keys, "rows": rows})
        return Pulled(torch.from_numpy(rows).to(self.device), keys, split=prepared)

    def push(self, pulled: Pulled, grads: torch.Tensor, batch: int) -> None:
        if trace.on():
            trace.event("push", f"data worker {self.worker}", {"keys": pulled.keys, "grads": grads})
        self._refs += self.ps.push(
            SPARSE_TABLE,
            pulled.keys,
            grads.detach().cpu().numpy(),
            (self.worker, batch, self.generation),
            split=pulled.split,
        )
        self.updates += 1

    def lookup(self, keys: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.ps.pull(SPARSE_TABLE, keys, create=False)).to(self.device)

    def flush(self) -> None:
        self.settle()

    def stats(self) -> dict[str, Any]:
        return {"place": "ps"}


class DeviceRows(_Tagged):
    """The rows in this worker's GPU memory (:class:`~heterps_ray.ps.device_table.DeviceTable`), the
    shards behind them: the reader dedupes a batch's keys on the device ahead, a pull maps them to rows
    (fetching what the GPU lacks) and gathers, a push updates on the device and counts the batch for
    the next flush."""

    def __init__(self, ps: PSClient, worker: int, workers: int, generation: int, table: DeviceTable):
        super().__init__(ps, worker, workers, generation)
        self.table = table
        self.device = table.device

    def prepare(self, keys: np.ndarray) -> Deduped:
        return self.table.dedupe(keys)

    def pull(self, keys: np.ndarray, prepared: Deduped | None, batch: int) -> Pulled:
        deduped = prepared if prepared is not None else self.table.dedupe(keys)
        resolved = self.table.resolve(deduped, self.ps, SPARSE_TABLE, self.clock(batch))
        return Pulled(self.table.gather(resolved), keys, resolved=resolved)

    def push(self, pulled: Pulled, grads: torch.Tensor, batch: int) -> None:
        assert pulled.resolved is not None
        self.table.apply(pulled.resolved, grads.detach(), (self.worker, batch, self.generation))
        self.updates += 1

    def lookup(self, keys: np.ndarray) -> torch.Tensor:
        self.flush()
        return torch.from_numpy(self.ps.pull(SPARSE_TABLE, keys, create=False)).to(self.device)

    def flush(self) -> None:
        self._refs += self.table.flush(self.ps, SPARSE_TABLE)
        self.settle()

    def reset(self) -> None:
        self.table.clear()

    def stats(self) -> dict[str, Any]:
        stats = self.table.stats
        return {
            "place": "gpu" if len(self.table) < self.table.capacity and not stats.evicted else "gpu_cache",
            "capacity_rows": self.table.capacity,
            "rows_held": len(self.table),
            "device_bytes": self.table.nbytes,
            "hit_rate": stats.hit_rate,
            "hits": stats.hits,
            "misses": stats.misses,
            "fetched": stats.fetched,
            "written_back": stats.written_back,
            "evicted": stats.evicted,
        }


class Window(Protocol):
    """The DataWorker's window of micro-batches in flight, as a schedule ends a batch with it."""

    def drain(self) -> None:
        """Finish every micro-batch in flight."""

    def retire_to(self, batches: int) -> None:
        """Finish the oldest micro-batches until at most `batches` batches have some in flight."""


class SparseSchedule(Protocol):
    """When a DataWorker pulls and pushes sparse rows, how it scales and steps its micro-batches, and
    how far batches overlap: :class:`PerBatch` (sync) or :class:`PerMicroBatch` (async)."""

    def start_batch(self, keys: np.ndarray, prepared: Any, batch: int) -> None: ...

    def micro_batch(self, size: int, batch_size: int, last: bool) -> tuple[float, bool]:
        """(scale of its mean loss's gradient, whether local weights step after it)."""
        ...

    def rows(self, keys: np.ndarray, part: slice, prepared: Any, batch: int) -> torch.Tensor: ...

    def gradient(self, keys: np.ndarray, part: slice, grad: torch.Tensor, batch: int) -> None: ...

    def end_batch(self, window: Window, batch: int) -> None: ...


class PerBatch:
    """Sync: rows pulled once per batch, the batch's gradient pushed once after its last micro-batch."""

    def __init__(self, sparse: SparseLink, busy: Any):
        self.sparse, self.busy = sparse, busy
        self._pulled: Pulled | None = None  # this batch's rows
        self._grad = torch.zeros(0)  # this batch's gradient, filled per micro-batch

    def start_batch(self, keys: np.ndarray, prepared: Any, batch: int) -> None:
        self.sparse.settle()  # ordering already holds; this surfaces PS errors early
        with self.busy:
            self._pulled = self.sparse.pull(keys, prepared, batch)
        self._grad = torch.zeros_like(self._pulled.rows)

    def micro_batch(self, size: int, batch_size: int, last: bool) -> tuple[float, bool]:
        return size / batch_size, last

    def rows(self, keys: np.ndarray, part: slice, prepared: Any, batch: int) -> torch.Tensor:
        assert self._pulled is not None
        return self._pulled.rows[part]

    def gradient(self, keys: np.ndarray, part: slice, grad: torch.Tensor, batch: int) -> None:
        self._grad[part] = grad

    def end_batch(self, window: Window, batch: int) -> None:
        window.drain()
        assert self._pulled is not None
        with self.busy:
            self.sparse.push(self._pulled, self._grad, batch)
        self._pulled = None


class PerMicroBatch:
    """Async: each micro-batch pulls its rows and pushes its gradient; `batches_ahead` batches overlap."""

    def __init__(self, sparse: SparseLink, busy: Any, batches_ahead: int):
        self.sparse, self.busy, self.batches_ahead = sparse, busy, batches_ahead
        self._in_flight = _PUSHES_IN_FLIGHT_PER_SHARD * len(sparse.ps.shards)
        self._pulled: dict[tuple[int, int], Pulled] = {}  # (batch, first row) -> its micro-batch's rows

    def start_batch(self, keys: np.ndarray, prepared: Any, batch: int) -> None:
        pass

    def micro_batch(self, size: int, batch_size: int, last: bool) -> tuple[float, bool]:
        return 1.0, True

    def rows(self, keys: np.ndarray, part: slice, prepared: Any, batch: int) -> torch.Tensor:
        pulled = self.sparse.pull(keys, prepared, batch)
        self._pulled[(batch, part.start or 0)] = pulled
        return pulled.rows

    def gradient(self, keys: np.ndarray, part: slice, grad: torch.Tensor, batch: int) -> None:
        self.sparse.push(self._pulled.pop((batch, part.start or 0)), grad, batch)
        self.sparse.settle(self._in_flight)

    def end_batch(self, window: Window, batch: int) -> None:
        window.retire_to(self.batches_ahead)
