"""Where a DataWorker's batches go beyond its training thread's phases (worker_base.PhaseClock): the host
CPU each of its threads spends, and, over a few batches, the ops the batches dispatch and the waits for
the device among them (torch.profiler). Every GPU run prints them (benchmarks/bench_gpu.py), so that a gap to
the plain loop says where it is.

* :class:`ThreadCPU`: CPU seconds per thread (psutil), by role: the training thread, the reader, the
  threads converting the data; any other thread under its OS name (torch's intra-op pool, Ray's own).
* :class:`OpCounter`: over `batches` batches after the first `skip`, per batch: the aten ops called from
  Python (each a kernel launch, or a few, on a GPU), the GPU kernels where there are some, the calls that
  wait for the device (``cudaStreamSynchronize`` and its kin), and the ops that would wait on a GPU
  because the host needs their result's size or value (``nonzero``, ``unique``, ``item``): on the CPU,
  the stand-in for the waits a GPU would have. And the training thread's wall time per batch split in
  two: inside those ops (``aten_ms``: the work a GPU takes over) and outside them (``host_ms``: reading
  and converting where the thread reads inline, Python, the C code of the shards: what stays on the
  host). The profiler's own cost per op counts as host time, so ``host_ms`` is an upper bound.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

# ops whose output size or value the host needs: on a GPU each waits for the device
DATA_DEPENDENT_OPS = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), int(), bool() of a tensor
        "aten::nonzero",  # also boolean-mask indexing
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::masked_select",
    }
)
_TRAINING_THREAD = "heterps::training_thread"
# CUDA runtime calls that block the host until the device is done
SYNC_CALLS = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cudaStreamWaitEvent",
    }
)


class ThreadCPU:
    """CPU seconds each thread of this process spent while :meth:`running` blocks ran, summed by role.
    Reading every thread's times costs ~2 ms (psutil, a Ray worker's ~30 threads), so it is `on` only
    where asked for (a DataWorker counting its ops: ``runtime.op_profile_batches``)."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.seconds: dict[str, float] = {}
        self._roles: dict[int, str] = {}  # native thread id -> role

    def name(self, role: str) -> None:
        """The calling thread plays `role` (its CPU is reported under that name), unless it was named
        before (the training thread reading inline stays the training thread)."""
        self._roles.setdefault(threading.get_native_id(), role)

    def running(self) -> _Measured:
        return _Measured(self)

    def _add(self, before: dict[int, float], after: dict[int, float]) -> None:
        for tid, cpu in after.items():
            spent = cpu - before.get(tid, 0.0)
            if spent > 0:
                role = self._roles.get(tid) or _os_name(tid)
                self.seconds[role] = self.seconds.get(role, 0.0) + spent


class _Measured:
    def __init__(self, clock: ThreadCPU):
        self.clock = clock

    def __enter__(self) -> None:
        self._before = _per_thread() if self.clock.on else {}

    def __exit__(self, *exc: object) -> None:
        if self.clock.on:
            self.clock._add(self._before, _per_thread())


def _per_thread() -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def _os_name(tid: int) -> str:
    """The thread's OS name (Linux: its comm), or 'thread' where it cannot be read."""
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip() or "thread"
    except OSError:
        return "thread"


class OpCounter:
    """torch.profiler over `batches` batches after the first `skip` (0 batches: off); :attr:`per_batch`
    once they are done."""

    def __init__(self, batches: int, skip: int = 10):
        self.batches, self.skip = batches, skip
        self.per_batch: dict[str, float] | None = None
        self._seen = 0
        self._profile: Any = None

    def before_batch(self) -> None:
        if not self.batches or self.per_batch is not None:
            return
        if self._seen == self.skip:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.start()
            with torch.profiler.record_function(_TRAINING_THREAD):  # marks which profiler thread it is
                pass
            self._t0 = time.perf_counter()
        self._seen += 1

    def after_batch(self, last: bool = False) -> None:
        """After a batch; `last`: no batch follows (the data ended), so stop over the batches seen."""
        if self._profile is None or (self._seen < self.skip + self.batches and not last):
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self._t0) * 1000.0
        self._profile.stop()
        profiled = max(self._seen - self.skip - (1 if last else 0), 1)  # `last`: the read that found none
        self.per_batch = _count(self._profile.events(), profiled, wall_ms)
        self._profile = None


def _count(events: Any, batches: int, wall_ms: float) -> dict[str, float]:
    training_thread = next((e.thread for e in events if e.name == _TRAINING_THREAD), None)
    ops = kernels = syncs = waits = 0
    aten_us = 0.0
    for event in events:
        name = event.name
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
        elif name in SYNC_CALLS:
            syncs += 1
        elif name.startswith("aten::"):
            parent = event.cpu_parent
            if parent is None or not parent.name.startswith("aten::"):
                ops += 1  # called from Python (or autograd), not from inside another op
                if event.thread == training_thread:
                    aten_us += event.cpu_time_total
            if name in DATA_DEPENDENT_OPS:
                waits += 1
    aten_ms = aten_us / 1000.0 / batches
    return {
        "aten_ops": ops / batches,
        "gpu_kernels": kernels / batches,
        "host_syncs": syncs / batches,
        "data_dependent_ops": waits / batches,
        "wall_ms": wall_ms / batches,
        "aten_ms": aten_ms,
        "host_ms": wall_ms / batches - aten_ms,
    }
