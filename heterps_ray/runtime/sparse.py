"""How a DataWorker moves its sparse rows between the PS and its micro-batches: one link to the
sparse table (:class:`SparseRows`) and the two schedules of the modes (modes.py) behind one
interface, so that the DataWorker runs one path whatever its mode.

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

from typing import Any, Protocol

import numpy as np
import ray

from heterps_ray.ps.shard import KeySplit, PSClient

SPARSE_TABLE = "embedding"  # the one sparse table all slots share (slots are mixed into the keys)
_PUSHES_IN_FLIGHT_PER_SHARD = 4  # async: sparse pushes left unanswered per shard (bounds memory)


class SparseRows:
    """A DataWorker's link to the sparse table on the PS shards: pulls, the pushes still in flight, and
    the count of updates sent. Pushes are tagged (worker, batch, generation), so the shards count each
    batch and drop the pushes of calls sent before a recovery."""

    def __init__(self, ps: PSClient, worker: int, workers: int, generation: int):
        self.ps, self.worker, self.workers, self.generation = ps, worker, workers, generation
        self.updates = 0  # sparse pushes sent (one per batch in sync, per micro-batch in async)
        self._refs: list[Any] = []

    def split(self, keys: np.ndarray) -> KeySplit | None:
        return self.ps.split(keys)

    def clock(self, batch: int) -> int:
        """The global batch index of this worker's `batch`, the clock of the table's admission counts
        and TTL: batches of the DataWorkers interleaved, a function of the position in the data only,
        so a replay after a fault sees the same clock."""
        return batch * self.workers + self.worker

    def pull(self, keys: np.ndarray, split: KeySplit | None, batch: int) -> np.ndarray:
        return self.ps.pull(SPARSE_TABLE, keys, split=split, step=self.clock(batch))

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Rows for evaluation: none are created."""
        return self.ps.pull(SPARSE_TABLE, keys, create=False)

    def push(self, keys: np.ndarray, grads: np.ndarray, batch: int, split: KeySplit | None) -> None:
        self._refs += self.ps.push(
            SPARSE_TABLE, keys, grads, (self.worker, batch, self.generation), split=split
        )
        self.updates += 1

    def settle(self, keep: int = 0) -> None:
        """Wait for all but the newest `keep` pushes (bounds memory; surfaces PS errors)."""
        if len(self._refs) > keep:
            cut = len(self._refs) - keep
            ray.get(self._refs[:cut])
            del self._refs[:cut]

    def rewire(self, generation: int, ps: PSClient) -> None:
        """After a fault: forget the pushes in flight, tag later ones `generation`, use `ps`."""
        self._refs.clear()
        self.generation, self.ps = generation, ps


class Window(Protocol):
    """The DataWorker's window of micro-batches in flight, as a schedule ends a batch with it."""

    def drain(self) -> None:
        """Finish every micro-batch in flight."""

    def retire_to(self, batches: int) -> None:
        """Finish the oldest micro-batches until at most `batches` batches have some in flight."""


class SparseSchedule(Protocol):
    """When a DataWorker pulls and pushes sparse rows, how it scales and steps its micro-batches, and
    how far batches overlap: :class:`PerBatch` (sync) or :class:`PerMicroBatch` (async)."""

    def start_batch(self, keys: np.ndarray, split: KeySplit | None, batch: int) -> None: ...

    def micro_batch(self, size: int, batch_size: int, last: bool) -> tuple[float, bool]:
        """(scale of its mean loss's gradient, whether local weights step after it)."""
        ...

    def rows(self, keys: np.ndarray, part: slice, split: KeySplit | None, batch: int) -> np.ndarray: ...

    def gradient(
        self, keys: np.ndarray, part: slice, grad: np.ndarray, split: KeySplit | None, batch: int
    ) -> None: ...

    def end_batch(self, window: Window, keys: np.ndarray, split: KeySplit | None, batch: int) -> None: ...


class PerBatch:
    """Sync: rows pulled once per batch, the batch's gradient pushed once after its last micro-batch."""

    def __init__(self, sparse: SparseRows, busy: Any):
        self.sparse, self.busy = sparse, busy
        self._rows = np.zeros((0,), dtype=np.float32)  # this batch's rows
        self._grad = np.zeros((0,), dtype=np.float32)  # this batch's gradient, filled per micro-batch

    def start_batch(self, keys: np.ndarray, split: KeySplit | None, batch: int) -> None:
        self.sparse.settle()  # ordering already holds; this surfaces PS errors early
        with self.busy:
            self._rows = self.sparse.pull(keys, split, batch)
        self._grad = np.zeros_like(self._rows)

    def micro_batch(self, size: int, batch_size: int, last: bool) -> tuple[float, bool]:
        return size / batch_size, last

    def rows(self, keys: np.ndarray, part: slice, split: KeySplit | None, batch: int) -> np.ndarray:
        return self._rows[part]

    def gradient(
        self, keys: np.ndarray, part: slice, grad: np.ndarray, split: KeySplit | None, batch: int
    ) -> None:
        self._grad[part] = grad

    def end_batch(self, window: Window, keys: np.ndarray, split: KeySplit | None, batch: int) -> None:
        window.drain()
        with self.busy:
            self.sparse.push(keys, self._grad, batch, split)


class PerMicroBatch:
    """Async: each micro-batch pulls its rows and pushes its gradient; `batches_ahead` batches overlap."""

    def __init__(self, sparse: SparseRows, busy: Any, batches_ahead: int):
        self.sparse, self.busy, self.batches_ahead = sparse, busy, batches_ahead

    def start_batch(self, keys: np.ndarray, split: KeySplit | None, batch: int) -> None:
        pass

    def micro_batch(self, size: int, batch_size: int, last: bool) -> tuple[float, bool]:
        return 1.0, True

    def rows(self, keys: np.ndarray, part: slice, split: KeySplit | None, batch: int) -> np.ndarray:
        return self.sparse.pull(keys, split, batch)

    def gradient(
        self, keys: np.ndarray, part: slice, grad: np.ndarray, split: KeySplit | None, batch: int
    ) -> None:
        self.sparse.push(keys, grad, batch, split)
        self.sparse.settle(_PUSHES_IN_FLIGHT_PER_SHARD * len(self.sparse.ps.shards))

    def end_batch(self, window: Window, keys: np.ndarray, split: KeySplit | None, batch: int) -> None:
        window.retire_to(self.batches_ahead)
