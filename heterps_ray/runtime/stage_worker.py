"""The StageWorker actor: the layers of one stage after the first (stages 1..S-1) on its device, driven
by the DataWorkers' calls (workers.py): forward on arrival, backward when the gradient comes back, the
loss on the last stage."""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch

from heterps_ray.chaos import FaultPoints
from heterps_ray.models import ModelSpec, loss_fn
from heterps_ray.runtime import trace
from heterps_ray.runtime.pipeline import StageSpec, Wire, from_wire, to_wire
from heterps_ray.runtime.stage import Stash
from heterps_ray.runtime.worker_base import (
    Busy,
    Metrics,
    StageActor,
    WorkerSettings,
    placement,
    stage_compute,
)


class StageWorker(StageActor):
    """Runs layers [start, end) of the model on its device: forward on arrival, backward when the
    gradient comes back; the last stage computes the loss. Saved activations are keyed by
    micro-batch id, so several DataWorkers can share a replica."""

    def __init__(
        self,
        stage: StageSpec,
        replica: int,
        model: ModelSpec,
        settings: WorkerSettings,
        dense_ps: Any = None,
    ):
        torch.set_num_threads(settings.torch_threads)
        self.stage, self.replica, self.settings = stage, replica, settings
        self.compute = stage_compute(stage, model, settings, dense_ps)
        self.device = self.compute.device
        self.is_last = stage.end == model.num_layers
        self._saved: dict[int, Stash] = {}
        # Raised at each recovery: calls sent before it (still queued, maybe behind a dead actor's
        # result) are dropped, so none can step an optimizer after the rollback.
        self._generation = 0
        self._busy = Busy()
        self._counts = {"forward": 0, "backward": 0, "samples": 0, "updates": 0, "peak_pending": 0}
        self._metrics = Metrics("stage", stage.index, replica)
        self.faults = FaultPoints()  # chaos tests: die inside a call of a given phase (chaos.py)

    def describe(self) -> dict[str, Any]:
        return placement(
            role="stage",
            stage=self.stage.index,
            replica=self.replica,
            type=self.settings.type_name,
            device=str(self.device),
            layers=list(self.stage.layers),
        )

    def forward(self, mb_id: int, x: Wire, gen: int = 0) -> Wire:
        """Forward one micro-batch and keep what backward needs (nothing for a stale `gen`)."""
        self.faults.reached("train")
        if gen < self._generation:
            return []
        with self._busy:
            stash = self.compute.forward(from_wire(x, self.device, requires_grad=True))
            self._saved[mb_id] = stash
            self._note_forward(len(stash.inputs[0]))
            return to_wire(stash.outputs)

    @ray.method(num_returns=2)
    def forward_backward(
        self, mb_id: int, x: Wire, label: np.ndarray, scale: float, step: bool, gen: int = 0
    ) -> tuple[Wire, float]:
        """The last stage: forward, loss (times `scale`), backward; returns (input grads, loss)."""
        if gen < self._generation:
            return [], float("nan")
        with self._busy:
            inputs = from_wire(x, self.device, requires_grad=True)
            stash = self.compute.forward(inputs, backward_next=True)
            (logit,) = stash.outputs
            loss = loss_fn(logit, torch.from_numpy(np.asarray(label)).to(self.device))
            if trace.on():
                trace.event("loss", self.compute.where, {"logit": logit, "loss": loss})
            self.compute.backward(stash, loss=loss * scale)
            self._note_forward(len(logit))
            grads = to_wire([t.grad if t.requires_grad else None for t in inputs])
            self._after_backward(step)
            return grads, float(loss.detach())

    def backward(self, mb_id: int, grads: Wire, step: bool, gen: int = 0) -> Wire:
        """Backward one micro-batch with the gradient of its output; returns its input's gradient."""
        if gen < self._generation:
            return []
        with self._busy:
            stash = self._saved.pop(mb_id)
            self.compute.backward(stash, grads)
            self._after_backward(step)
            return to_wire([t.grad if t.requires_grad else None for t in stash.inputs])

    def predict(self, x: Wire) -> Wire:
        """Forward only (evaluation); nothing is kept."""
        self.faults.reached("evaluate")
        self.compute.settle()
        with self._busy, torch.no_grad():
            return to_wire(self.compute.module(from_wire(x, self.device)))

    def _note_forward(self, samples: int) -> None:
        self._counts["forward"] += 1
        self._counts["samples"] += samples
        self._counts["peak_pending"] = max(self._counts["peak_pending"], len(self._saved))
        self._metrics.samples.inc(samples)
        self._metrics.queue.set(len(self._saved))

    def _after_backward(self, step: bool) -> None:
        self._counts["backward"] += 1
        if self.compute.step(step):
            self._counts["updates"] += 1

    def stats(self) -> dict[str, Any]:
        """Cumulative counters; the driver diffs them per progress interval."""
        self._metrics.busy.set(self._busy.fraction)
        out = {
            "stage": self.stage.index,
            "replica": self.replica,
            "busy_s": self._busy.busy_s,
            "pending": len(self._saved),
            **self._counts,
        }
        self._counts["peak_pending"] = len(self._saved)
        if self.compute.dense is not None:
            out["dense_pulls"] = self.compute.dense.pulls
            out["dense_max_lag"] = self.compute.dense.max_lag
        return out

    def train_state(self) -> dict[str, np.ndarray]:
        """At a batch boundary: weights and optimizer state (sync) for a checkpoint."""
        self.faults.reached("checkpoint")
        return self.compute.train_state()

    def load_train_state(self, state: dict[str, np.ndarray]) -> None:
        self.compute.load_train_state(state)

    def rewire(self, generation: int, dense_ps: Any = None) -> None:
        """After a fault elsewhere: drop half-done micro-batches and calls of older generations, and
        use the (new) PS shard."""
        self._generation = generation
        self._saved.clear()
        self.compute.rewire(dense_ps)
