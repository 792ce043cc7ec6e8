"""The DataWorker actor (data, stage 0 and orchestration); the StageWorkers (stages 1..S-1) are in
stage_worker.py and what both share in worker_base.py. All are plain classes; the driver turns them
into Ray actors pinned to their resource type.

A DataWorker drives its own micro-batches without the driver: it runs stage 0 locally, then chains
ObjectRefs through the StageWorkers (``forward`` ... last ``forward_backward`` ... ``backward`` in
reverse), holding only refs. At most ``max_in_flight`` micro-batches are in flight; backward calls
are submitted ``max_in_flight - 1`` micro-batches behind their forward calls (a 1F1B order), so every
stage has forward work queued while a gradient travels back. Calls from one DataWorker run in
submission order on every actor, which is what makes the sync mode's accumulate-then-step exact.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import ray
import torch

from heterps_ray.chaos import FaultPoints
from heterps_ray.models import ModelSpec, loss_fn
from heterps_ray.ps.client import PSClient
from heterps_ray.ps.shard import PSShard
from heterps_ray.ps.spec import TableSpec
from heterps_ray.runtime.batch_profile import OpCounter, ThreadCPU
from heterps_ray.runtime.pipeline import StageSpec, route, to_wire
from heterps_ray.runtime.reader import Prefetcher
from heterps_ray.runtime.sparse import SPARSE_TABLE, sparse_link
from heterps_ray.runtime.stage import Stash
from heterps_ray.runtime.stage_worker import StageWorker
from heterps_ray.runtime.worker_base import (
    Busy,
    Metrics,
    PhaseClock,
    StageActor,
    WorkerSettings,
    placement,
    stage_compute,
)

T = TypeVar("T")


def spare_core(torch_threads: int) -> bool:
    """Whether this process may use a core beyond its `torch_threads` (its CPU affinity; all of the
    machine's cores unless something pinned it). Without one, threads beside torch's slow it down:
    on a 2-core machine a 2-thread DataWorker with its reader and optimizer step on threads of their
    own ran at 0.71x of the same loop in one thread (BENCHMARKS.md "The Criteo-shaped epoch")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores > torch_threads

__all__ = ["SPARSE_TABLE", "DataSettings", "DataWorker", "HostedPS", "StageWorker", "WorkerSettings"]


@dataclass(frozen=True)
class DataSettings:
    """A DataWorker's share of the data and how it is cut into batches."""

    path: str
    files: tuple[str, ...]
    batch_size: int
    micro_batches: int
    epochs: int
    max_in_flight: int
    batches_ahead: int = 0  # async: batches started before the earlier ones' updates are applied
    workers: int = 1  # DataWorkers of the plan (the table's clock interleaves their batches)
    readers: int = 1  # threads converting the data's chunks (key hashing, the dense transform)
    table: TableSpec | None = None  # the sparse table (its rows' home: the PS shards)
    # rows the GPU tier holds in this worker's device memory (ps/device_table.py); 0: rows on the shards
    gpu_rows: int = 0
    op_profile_batches: int = 0  # batches whose ops torch.profiler counts (runtime/batch_profile.py)


@dataclass(frozen=True)
class HostedPS:
    """The PS shards a DataWorker hosts in its own process (a plan with one DataWorker and no
    replicated stage): the driver reaches them through ``DataWorker.on_shard`` (runtime/shards.py)."""

    num_shards: int
    tables: dict[str, TableSpec]


@dataclass
class _MicroBatch:
    """One micro-batch in flight: what stage 0 kept for its backward, and the refs it waits on."""

    id: int
    batch: int
    keys: np.ndarray
    dense: np.ndarray
    label: np.ndarray
    rows: slice  # where it sits in its batch
    grad_scale: float  # d(optimised loss)/d(micro-batch mean loss)
    loss_weight: float  # weight of its mean loss in the batch's reported loss
    step: bool  # local weights step after this micro-batch (a sync batch's last; every one in async)
    prepared: Any = None  # what the reader worked out for its keys (their split, or distinct keys): a batch's
    route: list[int] = field(default_factory=list)
    emb: torch.Tensor | None = None
    stash: Stash | None = None
    grad_ref: Any = None
    loss_ref: Any = None
    loss: torch.Tensor | float | None = None


class DataWorker(StageActor):
    """Reads its share of the data, pulls sparse rows, runs stage 0, drives the micro-batches through
    the StageWorkers, runs stage 0's backward and pushes the sparse gradients to the PS.

    When sparse rows are pulled and pushed, and how far batches overlap, is the mode's sparse
    schedule (sparse.py: per batch in sync, per micro-batch in async); the path here is one.
    A reader thread reads, converts and splits the next batches' keys meanwhile (``reader.py``).
    With a :class:`HostedPS` the PS shards live in this process and pulls and pushes are calls.
    """

    def __init__(
        self,
        index: int,
        stage0: StageSpec,
        model: ModelSpec,
        settings: WorkerSettings,
        data: DataSettings,
        downstream: list[list[Any]],
        shards: list[Any] | HostedPS,
        dense_ps: Any = None,
        generation: int = 0,
    ):
        torch.set_num_threads(settings.torch_threads)
        self.index, self.stage0, self.settings, self.data = index, stage0, settings, data
        self._generation = generation  # see StageWorker: tags every call this worker sends
        self.faults = FaultPoints()  # chaos tests: die inside a call of a given phase (chaos.py)
        self.model = model
        self.compute = stage_compute(stage0, model, settings, dense_ps)
        # the reader and the optimizer step on threads of their own only with a core to spare
        self._spare_core = spare_core(settings.torch_threads)
        self.compute.background_step = self._spare_core
        self.device = self.compute.device
        self.downstream = downstream  # replicas of stages 1..S-1
        self.hosted: list[PSShard] = []
        self._busy = Busy()
        self._clock = PhaseClock()
        self._threads = ThreadCPU(on=data.op_profile_batches > 0)  # every thread's CPU while training
        self._ops = OpCounter(data.op_profile_batches)
        self._trained = 0  # batches trained by this process (what the CPU above is spent on)
        self.sparse = sparse_link(
            self._ps_client(shards), index, data.workers, generation, self.device, data.table, data.gpu_rows
        )
        self.schedule = settings.mode.sparse_schedule(self.sparse, self._busy, data.batches_ahead)
        self._batches = self._reader(skip=0)
        self._batch_index = 0
        self._counter = 0  # micro-batches started
        self._window = data.max_in_flight
        self._lag = max(0, data.max_in_flight - 1)
        self._fwd_q: deque[_MicroBatch] = deque()
        self._bwd_q: deque[_MicroBatch] = deque()
        self._done: list[tuple[int, Any]] = []  # (batch, weighted loss) of retired micro-batches
        self._peak_in_flight = 0
        self._samples = 0
        self._metrics = Metrics("data", 0, index)

    def describe(self) -> dict[str, Any]:
        return placement(
            role="data",
            stage=0,
            replica=self.index,
            type=self.settings.type_name,
            device=str(self.device),
            layers=list(self.stage0.layers),
            files=len(self.data.files),
            hosted_shards=len(self.hosted),
        )

    def _ps_client(self, shards: list[Any] | HostedPS) -> PSClient:
        """The client of the PS shards: actors (handles), or hosted in this process (made once)."""
        if not isinstance(shards, HostedPS):
            return PSClient(shards)
        if not self.hosted:
            self.hosted = [PSShard(i, shards.num_shards, shards.tables) for i in range(shards.num_shards)]
        return PSClient(self.hosted, hosted=True)

    def on_shard(self, shard: int, call: Callable[[PSShard], T]) -> T:
        """`call` on hosted PS shard `shard`, for the driver (runtime/shards.HostedShard)."""
        return call(self.hosted[shard])

    # -- training ---------------------------------------------------------------------------------

    def run(self, steps: int) -> dict[str, Any]:
        """Train up to `steps` batches; returns their losses (in batch order) and counters."""
        self.faults.reached("train")
        t0 = time.perf_counter()
        first_batch = self._batch_index
        exhausted = False
        self._threads.name("training")
        with self._threads.running():
            for _ in range(steps):
                self._ops.before_batch()
                with self._clock("read"):  # blocked on the reader thread
                    item = next(self._batches, None)
                if item is None:
                    exhausted = True
                    self._ops.after_batch(last=True)
                    break
                self._train_batch(*item)
                self._ops.after_batch()
            self.drain()
            self.sparse.settle()
            if self.compute.dense is not None:
                self.compute.dense.flush()
        self._trained += self._batch_index - first_batch
        losses = np.zeros(self._batch_index - first_batch)
        for b, loss in self._done:  # a loss computed here is a tensor: read once, not per batch
            losses[b - first_batch] += float(loss)
        self._done.clear()
        samples = (self._batch_index - first_batch) * self.data.batch_size
        self._samples += samples
        self._metrics.busy.set(self._busy.fraction)
        return {
            "worker": self.index,
            "steps": self._batch_index - first_batch,
            "samples": samples,
            "losses": losses.tolist(),
            "exhausted": exhausted,
            "seconds": time.perf_counter() - t0,
            **self.progress(),
        }

    def teardown(self) -> None:
        """Before this process is reconfigured for another run (warm.py): stop the reader thread."""
        self._batches.close()

    def progress(self) -> dict[str, int]:
        """Where this worker is: batches trained (its data position) and sparse updates sent."""
        return {"position": self._batch_index, "updates": self.sparse.updates}

    def table_stats(self) -> dict[str, Any]:
        """Where this worker's sparse rows live and, in GPU memory, the tier's counters."""
        return self.sparse.stats()

    def flush_table(self) -> None:
        """Every sparse row changed in this worker's GPU memory back on the PS shards (before a
        checkpoint and at the end; nothing to do where the rows live on the shards)."""
        self.sparse.flush()

    def rewire(
        self, generation: int, downstream: list[list[Any]], shards: list[Any] | HostedPS, dense_ps: Any = None
    ) -> None:
        """After a fault: forget everything in flight and talk to the (partly new) actors (hosted
        shards stay this worker's own)."""
        self._generation = generation
        self.downstream = downstream
        self.sparse.rewire(generation, self._ps_client(shards))
        self._fwd_q.clear()
        self._bwd_q.clear()
        self._done.clear()
        self.compute.rewire(dense_ps)

    def _reader(self, skip: int) -> Prefetcher:
        """The reader thread over this worker's batches, from batch `skip` on, keys split by shard."""
        from heterps_ray.data.dataset import Dataset

        dataset = Dataset(self.data.path)
        files = [Path(f) for f in self.data.files]

        def batches() -> Iterator[dict[str, np.ndarray]]:
            # the batches before `skip` (a resume's position) are not read: whole epochs, then the rows of
            # the epoch they end in, skipped by count (an epoch is its rows' whole batches)
            per_epoch = dataset.num_rows("train", files) // self.data.batch_size
            if skip > self.data.epochs * per_epoch:
                raise ValueError(f"DataWorker {self.index}: its data has fewer than {skip} batches")
            first, within = divmod(skip, per_epoch) if per_epoch else (0, 0)
            for epoch in range(first, self.data.epochs):
                yield from dataset.iter_batches("train", self.data.batch_size, files=files, drop_last=True,
                                                workers=self.data.readers, skip=within if epoch == first else 0)  # fmt: skip

        def prepare(batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
            self._threads.name("reader")  # the reader thread (or the training thread, reading inline)
            if self.device.type == "cuda":  # pinned: copied to the GPU while the CPU goes on
                batch = {**batch, **{k: torch.from_numpy(batch[k]).pin_memory() for k in ("dense", "label")}}
            return batch, self.sparse.prepare(batch["keys"])

        return Prefetcher(batches, prepare, thread=self._spare_core)

    def _train_batch(self, batch: dict[str, Any], prepared: Any) -> None:
        size = len(batch["label"])
        k = self.data.micro_batches
        mb = size // k
        with self._clock("pull"):
            self.schedule.start_batch(batch["keys"], prepared, self._batch_index)
        for j in range(k):
            part = slice(j * mb, (j + 1) * mb)
            grad_scale, step = self.schedule.micro_batch(mb, size, last=j == k - 1)
            item = _MicroBatch(
                id=self._counter * 1024 + self.index,  # unique across DataWorkers (< 1024 of them)
                batch=self._batch_index,
                keys=batch["keys"][part],
                dense=batch["dense"][part],
                label=batch["label"][part],
                rows=part,
                grad_scale=grad_scale,
                loss_weight=mb / size,
                step=step,
                prepared=prepared if k == 1 else None,
                route=route(self._counter, self.index, [len(r) for r in self.downstream]),
            )
            self._counter += 1
            self._submit(item)
        with self._clock("push"):  # sync: the batch's push, after the micro-batches in flight finish
            self.schedule.end_batch(self, self._batch_index)
        self._batch_index += 1

    # -- the in-flight window --------------------------------------------------------------------

    def _batches_in_flight(self) -> int:
        return len({item.batch for item in self._fwd_q} | {item.batch for item in self._bwd_q})

    def _submit(self, item: _MicroBatch) -> None:
        while len(self._fwd_q) + len(self._bwd_q) >= self._window:
            self._retire_oldest()
        self._forward(item)
        if not self.downstream:  # nothing remote to overlap with: its update lands at once
            self._finish(item)
            return
        self._fwd_q.append(item)
        self._peak_in_flight = max(self._peak_in_flight, len(self._fwd_q) + len(self._bwd_q))
        if len(self._fwd_q) > self._lag:
            self._backward(self._fwd_q.popleft())

    def _retire_oldest(self) -> None:
        if not self._bwd_q:
            self._backward(self._fwd_q.popleft())
        self._finish(self._bwd_q.popleft())

    def retire_to(self, batches: int) -> None:
        """Finish the oldest micro-batches until at most `batches` batches have some in flight."""
        while self._batches_in_flight() > batches:
            self._retire_oldest()

    def drain(self) -> None:
        """Finish every micro-batch in flight (backward calls first, so they overlap)."""
        while self._fwd_q:
            self._backward(self._fwd_q.popleft())
        while self._bwd_q:
            self._finish(self._bwd_q.popleft())

    def _forward(self, item: _MicroBatch) -> None:
        with self._busy, self._clock("compute"):
            with self._clock("pull"):
                rows = self.schedule.rows(item.keys, item.rows, item.prepared, item.batch)
            item.emb = rows.detach().requires_grad_(True)
            dense = _on(self.device, item.dense)
            item.stash = self.compute.forward((dense, item.emb), backward_next=not self.downstream)
            if not self.downstream:  # one-stage pipeline: the loss is computed here
                (logit,) = item.stash.outputs
                loss = loss_fn(logit, _on(self.device, item.label))
                self.compute.backward(item.stash, loss=loss * item.grad_scale)
                item.loss = loss.detach()  # read at the end of the run: no wait for the GPU per batch
                return
            ref: Any = to_wire(item.stash.outputs)
        *middle, last = self.downstream
        for s, replicas in enumerate(middle):
            ref = replicas[item.route[s]].forward.remote(item.id, ref, self._generation)
        item.grad_ref, item.loss_ref = last[item.route[-1]].forward_backward.remote(
            item.id, ref, np.asarray(item.label), item.grad_scale, item.step, self._generation
        )

    def _backward(self, item: _MicroBatch) -> None:
        if self.downstream:
            grad = item.grad_ref
            for s in range(len(self.downstream) - 2, -1, -1):
                grad = self.downstream[s][item.route[s]].backward.remote(
                    item.id, grad, item.step, self._generation
                )
            item.grad_ref = grad
        self._bwd_q.append(item)

    def _finish(self, item: _MicroBatch) -> None:
        assert item.stash is not None
        if self.downstream:
            with self._clock("wait"):  # blocked on gradients coming back
                grads, item.loss = ray.get([item.grad_ref, item.loss_ref])
            with self._busy, self._clock("compute"):
                self.compute.backward(item.stash, grads)
        with self._busy:
            assert item.emb is not None and item.loss is not None
            if item.emb.grad is not None:
                with self._clock("push"):
                    self.schedule.gradient(item.keys, item.rows, item.emb.grad.detach(), item.batch)
            with self._clock("step"):
                self.compute.step(item.step)
        self._done.append((item.batch, item.loss * item.loss_weight))
        item.emb, item.stash = None, None
        self._metrics.samples.inc(len(item.label))

    # -- evaluation and state ---------------------------------------------------------------------

    def evaluate(self, split: str, batch_size: int, files: list[str] | None = None) -> dict[str, np.ndarray]:
        """Forward only over `split` (this worker's `files`, or all): logits and labels."""
        from heterps_ray.data.dataset import Dataset

        self.faults.reached("evaluate")
        dataset = Dataset(self.data.path)
        paths = None if files is None else [Path(f) for f in files]
        self.compute.settle()
        pending: deque[tuple[Any, np.ndarray]] = deque()
        logits: list[np.ndarray] = []
        labels: list[np.ndarray] = []

        def collect() -> None:
            ref, label = pending.popleft()
            out = ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref
            logits.append(np.asarray(out[0]))
            labels.append(label)

        for counter, batch in enumerate(
            dataset.iter_batches(split, batch_size, files=paths, drop_last=False)
        ):
            with self._busy, torch.no_grad():
                emb = self.sparse.lookup(batch["keys"])
                dense = torch.from_numpy(np.ascontiguousarray(batch["dense"])).to(self.device)
                ref: Any = to_wire(self.compute.module((dense, emb)))
            for s, replica in enumerate(route(counter, self.index, [len(r) for r in self.downstream])):
                ref = self.downstream[s][replica].predict.remote(ref)
            pending.append((ref, batch["label"]))
            if len(pending) >= self._window:
                collect()
        while pending:
            collect()
        if not logits:
            return {"logits": np.zeros(0, np.float32), "labels": np.zeros(0, np.float32)}
        return {"logits": np.concatenate(logits), "labels": np.concatenate(labels)}

    def stats(self) -> dict[str, Any]:
        out = {
            "stage": 0,
            "replica": self.index,
            "busy_s": self._busy.busy_s,
            "wait_s": self._clock.seconds.get("wait", 0.0),
            "read_wait_s": self._clock.seconds.get("read", 0.0),
            "phase_s": dict(self._clock.seconds),
            "thread_cpu_s": dict(self._threads.seconds),
            "batches": self._trained,
            "ops_per_batch": self._ops.per_batch,
            "samples": self._samples,
            "peak_pending": self._peak_in_flight,
        }
        self._peak_in_flight = 0
        return out

    def train_state(self) -> dict[str, np.ndarray]:
        """Between runs: weights, optimizer state (sync) and the position in the data."""
        self.faults.reached("checkpoint")
        return {
            **self.compute.train_state(),
            "data/batch_index": np.array(self._batch_index, dtype=np.int64),
            "data/counter": np.array(self._counter, dtype=np.int64),
            "data/samples": np.array(self._samples, dtype=np.int64),
            "data/updates": np.array(self.sparse.updates, dtype=np.int64),
        }

    def load_train_state(self, state: dict[str, np.ndarray]) -> int:
        """Restore a :meth:`train_state` and skip the batches it had trained; returns how many."""
        self.compute.load_train_state(state)
        self.sparse.reset()  # the shards were restored: rows held on the GPU are stale
        skip = int(state["data/batch_index"])
        self._batches.close()
        self._batches = self._reader(skip)
        self._batch_index = skip
        self._counter = int(state["data/counter"])
        self._samples = int(state["data/samples"])
        self.sparse.updates = int(state.get("data/updates", skip))
        return skip


def _on(device: torch.device, values: Any) -> torch.Tensor:
    """A batch's array (numpy, or a pinned tensor the reader made) on `device`; a pinned one is copied
    without waiting."""
    if isinstance(values, torch.Tensor):
        return values.to(device, non_blocking=True)
    return torch.from_numpy(np.ascontiguousarray(values)).to(device)
