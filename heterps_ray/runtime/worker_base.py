"""What every actor of the pipeline shares: its settings (:class:`WorkerSettings`), the stage compute
built from them, its placement report, its Ray metrics, its busy-time clock and the calls every
worker answers alike (:class:`StageActor`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from heterps_ray.chaos import FaultPoints
from heterps_ray.config import OptimizerConfig
from heterps_ray.models import ModelSpec
from heterps_ray.profiling_host import ProfilingHost
from heterps_ray.reusable import Reusable, actor_placement
from heterps_ray.runtime.modes import Mode
from heterps_ray.runtime.pipeline import StageSpec
from heterps_ray.runtime.stage import StageCompute


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker of a run needs to know besides its stage."""

    seed: int
    mode: Mode  # the run's mode (modes.py): sync or async
    optimizer: OptimizerConfig
    device: str  # the resource type's device kind: "cpu" | "cuda"
    torch_threads: int
    type_name: str
    max_staleness: int = 0
    gpu_precision: str = "fp32"  # runtime.gpu_precision: fp32 | tf32 | bf16 (heterps_ray.devices)


def stage_compute(
    stage: StageSpec, model: ModelSpec, settings: WorkerSettings, dense_ps: Any
) -> StageCompute:
    """The stage's layers on the worker's device, with its dense weights where the mode keeps them."""
    return StageCompute(
        stage,
        model,
        settings.seed,
        settings.mode,
        settings.optimizer,
        settings.device,
        settings.max_staleness,
        dense_ps,
        settings.gpu_precision,
    )


def placement(**fields: Any) -> dict[str, Any]:
    return {**actor_placement(**fields), "torch_threads": torch.get_num_threads()}


class Metrics:
    """Ray metrics of one actor (exported by Ray's metrics agent; harmless when none runs)."""

    def __init__(self, role: str, stage: int, replica: int):
        from ray.util import metrics

        self.tags = {"role": role, "stage": str(stage), "replica": str(replica)}
        keys = tuple(self.tags)
        self.samples = metrics.Counter("heterps_samples", "samples processed", tag_keys=keys)
        self.busy = metrics.Gauge("heterps_busy_fraction", "fraction of wall time computing", tag_keys=keys)
        self.queue = metrics.Gauge("heterps_queue_depth", "micro-batches waiting for backward", tag_keys=keys)
        for m in (self.samples, self.busy, self.queue):
            m.set_default_tags(self.tags)


class Busy:
    """Accumulates time spent computing (busy) versus wall time since start."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.busy_s = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.busy_s += time.perf_counter() - self._t0

    @property
    def fraction(self) -> float:
        return self.busy_s / max(time.perf_counter() - self.started, 1e-9)


class PhaseClock:
    """Wall seconds a worker's training thread spent in each phase of its batches (``with clock("pull"):``),
    each exclusive of the phases nested in it: where a batch's time goes (on a GPU, what the thread waits
    for or launches; kernels run behind it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._nested: list[float] = []  # per open phase: the seconds of the phases inside it

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            inner = self._nested.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + took - inner
            if self._nested:
                self._nested[-1] += took


class StageActor(Reusable, ProfilingHost):
    """What every worker answers about its stage, whichever it is: chaos faults armed, the newest
    weights loaded (async weights on a PS, before evaluation), the dense weights saved; blank (before
    its first run, heterps_ray.reusable), the profiler's measurements (ProfilingHost)."""

    compute: StageCompute
    faults: FaultPoints

    def arm_fault(self, point: str, how: str = "sigkill", flag: str = "") -> None:
        """Chaos testing: die inside the next call of phase `point` (heterps_ray.chaos.FaultPoints)."""
        self.faults.arm(point, how, flag)

    def refresh(self) -> int:
        """Wait for the last dense push and load the newest weights (weights on a PS; before evaluation)."""
        return self.compute.refresh()

    def dense_state(self) -> dict[str, np.ndarray]:
        """The stage's dense weights under their whole-model names."""
        self.faults.reached("save")
        return self.compute.dense_state()
