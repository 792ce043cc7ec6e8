"""What a DataWorker (stage 0) and a StageWorker (stages 1..S-1) both do with their layers: build the
stage module on its device, run forward and backward (from gradients on the wire), step the dense
weights, and save or load their state.

Where the dense weights live (the run's mode decides, ``modes.Mode.dense_home``):

* ``local`` — the stage has one replica in all: its weights and optimizer (Adam/SGD, as the reference
  trainer's) stay in the worker. Sync mode always; async mode too, since no one shares them.
* ``ps`` — async mode, a stage with several replicas: the weights live on a PS shard; every backward
  pushes its gradients there and a replica pulls fresh weights when it is more than
  ``runtime.max_staleness`` versions behind (Paddle's a_sync with bounded staleness).

Stepping in the background (local weights): the optimizer step runs on a thread of its own, so the
worker returns its gradient upstream (or pushes its sparse rows) while the step runs; whatever reads
or uses the weights next (a forward, a backward, the state) waits for it first (:meth:`settle`).
torch releases the GIL in its kernels, so the two overlap on a machine with a core to spare. A
DataWorker whose torch threads take every core it has steps in its own thread instead
(``background_step = False``): there the step's parallel regions and the worker's would share the
cores, each waiting at its barriers for threads the other pre-empted.

Weight stashing (async, local weights): a stage may run forwards of later micro-batches before the
backward of an earlier one steps the optimizer. Each forward then runs on a snapshot of the weights
(PipeDream's weight stashing), so its backward is the gradient of the computation it really did, and
the optimizer's in-place step cannot invalidate a saved autograd graph.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import ray
import torch
from torch.func import functional_call

from heterps_ray.config import OptimizerConfig
from heterps_ray.devices import autocast, claim_device, set_precision
from heterps_ray.models import ModelSpec
from heterps_ray.runtime import trace
from heterps_ray.runtime.modes import Mode
from heterps_ray.runtime.pipeline import StageSpec, Wire


def dense_table_name(stage_index: int) -> str:
    return f"stage{stage_index}"


def canonical_names(module: torch.nn.Module, model: ModelSpec) -> dict[str, str]:
    """Parameter name in a stage module ("layers.0.linear.weight") -> name in the whole model
    ("fc1.linear.weight"), so dense weights saved from any split of stages line up."""
    first = getattr(module, "first", 0)
    out = {}
    for name, _ in module.named_parameters():
        _, index, rest = name.split(".", 2)
        out[name] = f"{model.layers[first + int(index)].name}.{rest}"
    return out


def make_optimizer(
    params: list[torch.nn.Parameter], config: OptimizerConfig, device: torch.device | None = None
) -> torch.optim.Optimizer | None:
    """The dense optimizer of the reference trainer (Adam or SGD at dense_lr); None without params.

    On the CPU the single-tensor loop (foreach=False, the CPU's default), which the reference trainer
    runs: a sync stage steps bit for bit as it does. On a GPU the fused kernel: one launch for all the
    stage's parameters instead of several per parameter (the loop cost ~0.5 ms a batch on an H200, a
    fifth of a CTR-DNN step). It rounds a little differently, as the GPU's matrix products already do
    (scripts/gpu_check.py compares a GPU stage with the CPU reference within 1e-4)."""
    if not params:
        return None
    on_gpu = device is not None and device.type == "cuda"
    if config.dense == "adam":
        if on_gpu:
            return torch.optim.Adam(params, lr=config.dense_lr, fused=True)
        return torch.optim.Adam(params, lr=config.dense_lr, foreach=False)
    if on_gpu:
        return torch.optim.SGD(params, lr=config.dense_lr, fused=True)
    return torch.optim.SGD(params, lr=config.dense_lr, foreach=False)


class DenseReplica:
    """A replica of a stage whose dense weights live on a PS shard (async, several replicas).

    Each backward pushes its gradient; the shard applies it and, when this replica's weights are then
    more than `max_staleness` versions behind, returns the fresh weights with the same call. They are
    loaded before the replica's next forward, so a forward runs on weights missing at most
    `max_staleness` updates plus those other replicas made meanwhile (0: its own updates always).
    Weights are replaced through ``.data``, so micro-batches in flight finish their backward on the
    weights they started with."""

    def __init__(
        self, ps: Any, name: str, module: torch.nn.Module, names: dict[str, str], max_staleness: int
    ):
        self.ps, self.name, self.module, self.names = ps, name, module, names
        self.max_staleness = max_staleness
        self.version = 0  # version of the weights held locally
        self.latest = 0  # newest version known to exist on the PS
        self.pulls = 0
        self.max_lag = 0  # most versions behind the newest known one when computing
        self._pending: Any = None  # the last push: (version, fresh weights or None)

    def update(self) -> None:
        """Push this backward's gradient (and take the fresh weights it may return, see :meth:`settle`)."""
        self.settle()
        grads = {}
        for local, p in self.module.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[self.names[local]] = g.detach().cpu().numpy()
        self._pending = self.ps.push_dense.remote(self.name, grads, self.version, self.max_staleness)
        self.module.zero_grad(set_to_none=True)

    def settle(self) -> None:
        """Wait for the last push; load the weights it returned (before a forward)."""
        if self._pending is None:
            return
        version, params = ray.get(self._pending)
        self._pending = None
        self.latest = max(self.latest, version)
        if params is not None:
            self._load(version, params)
        self.max_lag = max(self.max_lag, self.latest - self.version)

    def pull(self) -> None:
        version, params = ray.get(self.ps.pull_dense.remote(self.name))
        self._load(version, params)

    def _load(self, version: int, params: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for local, p in self.module.named_parameters():
                p.data.copy_(torch.from_numpy(np.array(params[self.names[local]])).to(p.device))
        self.version = version
        self.latest = max(self.latest, version)
        self.pulls += 1

    def flush(self) -> None:
        self.settle()

    def reset(self, ps: Any) -> None:
        """After a recovery: talk to `ps` (maybe a new shard), forget pending pushes, pull afresh."""
        self.ps, self._pending = ps, None
        self.pull()
        self.latest = self.version


class Stash:
    """What one forward kept for its backward: the inputs, the outputs and, with weight stashing,
    the weight snapshot it ran on."""

    __slots__ = ("inputs", "outputs", "weights")

    def __init__(
        self,
        inputs: tuple[torch.Tensor, ...],
        outputs: tuple[torch.Tensor, ...],
        weights: dict[str, torch.Tensor] | None,
    ):
        self.inputs, self.outputs, self.weights = inputs, outputs, weights


class StageCompute:
    """The layers [start, end) of a model on a device, with their dense weights (local or on a PS)."""

    def __init__(
        self,
        stage: StageSpec,
        model: ModelSpec,
        seed: int,
        mode: Mode,
        optimizer: OptimizerConfig,
        device: str,
        max_staleness: int = 0,
        dense_ps: Any = None,
        precision: str = "fp32",
    ):
        # a cuda type's stage runs on a GPU or fails here, naming its type and node (DeviceError)
        self.device = claim_device(stage.type, device)
        self.precision = precision
        set_precision(self.device, precision)
        self.module = model.build(stage.start, stage.end, seed).to(self.device)
        self.names = canonical_names(self.module, model)
        self.where = f"stage {stage.index}"  # this stage's name in a trace (runtime/trace.py)
        self.home = mode.dense_home(stage.replicas)
        self.optimizer: torch.optim.Optimizer | None = None
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optimizer-step")
        self.background_step = True  # the local step on the thread above (else in the caller's)
        self._step: Future[None] | None = None  # the optimizer step still running
        self.dense: DenseReplica | None = None
        has_params = any(True for _ in self.module.parameters())
        # async with local weights: forwards may run ahead of the step, so each keeps its weights
        self.stash_weights = mode.stashes_weights and has_params and self.home == "local"
        if self.home == "local":
            self.optimizer = make_optimizer(list(self.module.parameters()), optimizer, self.device)
        elif has_params:
            self.dense = DenseReplica(
                dense_ps, dense_table_name(stage.index), self.module, self.names, max_staleness
            )
            self.dense.pull()

    def settle(self) -> None:
        """Wait for the optimizer step running in the background, and for fresh PS weights."""
        if self._step is not None:
            step, self._step = self._step, None
            step.result()  # raises what the step raised
        if self.dense is not None:
            self.dense.settle()

    def forward(self, inputs: tuple[torch.Tensor, ...], backward_next: bool = False) -> Stash:
        """Forward with autograd; the stash holds what the backward needs. `backward_next`: the
        backward follows at once (no other forward can come between, so no weight snapshot)."""
        self.settle()
        if trace.on():
            trace.event("forward", self.where, inputs, dict(self.module.named_parameters()))
        with self.autocast():
            if not self.stash_weights or backward_next:
                return Stash(inputs, self.module(inputs), None)
            weights = {k: p.detach().clone().requires_grad_(True) for k, p in self.module.named_parameters()}
            return Stash(inputs, functional_call(self.module, weights, (inputs,)), weights)

    def autocast(self) -> Any:
        """The forward's autocast (bf16 on a GPU under ``runtime.gpu_precision: bf16``, else none)."""
        return autocast(self.device, self.precision)

    def backward(self, stash: Stash, grads: Wire | None = None, loss: torch.Tensor | None = None) -> None:
        """Backward of one forward, from `loss` or from the gradients of its outputs (None entries:
        outputs nothing downstream depends on)."""
        self.settle()
        if loss is not None:
            loss.backward()
        else:
            assert grads is not None
            roots, seeds = [], []
            for o, g in zip(stash.outputs, grads, strict=True):
                if g is not None and o.requires_grad:
                    roots.append(o)
                    seeds.append(torch.from_numpy(np.asarray(g)).to(self.device))
            if roots:
                if trace.on():
                    trace.event("backward", self.where, seeds)
                torch.autograd.backward(roots, seeds)
        if stash.weights is not None:  # the stashed snapshot's gradient is the parameters' gradient
            for k, p in self.module.named_parameters():
                weight_grad = stash.weights[k].grad
                if weight_grad is not None:
                    p.grad = weight_grad if p.grad is None else p.grad + weight_grad

    def step(self, step: bool) -> bool:
        """After a backward: the optimizer steps when `step` (local weights), or the gradient goes to
        the PS (every backward, weights on a PS). True when an update was made. A local step runs
        in the background (see the module docstring)."""
        if self.optimizer is not None and step:
            self.settle()
            if trace.on():
                trace.event("step", self.where, {k: p.grad for k, p in self.module.named_parameters()})
            if self.background_step:
                self._step = self._stepper.submit(self._apply_step, self.optimizer)
            else:
                self._apply_step(self.optimizer)
            return True
        if self.dense is not None:
            self.dense.update()
            return True
        return False

    @staticmethod
    def _apply_step(optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def refresh(self) -> int:
        """Weights on a PS: wait for the last push and load the newest weights (before evaluation)."""
        self.settle()
        if self.dense is not None:
            self.dense.flush()
            self.dense.pull()
            return self.dense.version
        return 0

    def rewire(self, dense_ps: Any) -> None:
        """After a fault: forget gradients of half-done micro-batches; use the (new) PS shard."""
        if self._step is not None:  # a step of the abandoned work: let it end, then drop its effect
            self._step.exception()
            self._step = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        if self.dense is not None:
            self.dense.reset(dense_ps)

    def dense_state(self) -> dict[str, np.ndarray]:
        """The stage's dense weights under their whole-model names."""
        self.settle()
        return {self.names[k]: v.detach().cpu().numpy() for k, v in self.module.named_parameters()}

    def train_state(self) -> dict[str, np.ndarray]:
        """Dense weights and optimizer state (e.g. Adam moments and step) as flat named numpy arrays."""
        self.settle()
        out = {f"param/{self.names[k]}": v.detach().cpu().numpy() for k, v in self.module.named_parameters()}
        if self.optimizer is not None:
            state = self.optimizer.state_dict()["state"]
            for i, (local, _) in enumerate(self.module.named_parameters()):
                for key, value in state.get(i, {}).items():
                    out[f"optim/{self.names[local]}/{key}"] = torch.as_tensor(value).detach().cpu().numpy()
        return out

    def load_train_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`train_state` returned (dense state goes by layer name)."""
        self.settle()
        with torch.no_grad():
            for local, p in self.module.named_parameters():
                p.copy_(torch.from_numpy(np.asarray(state[f"param/{self.names[local]}"])).to(p.device))
        if self.optimizer is not None:
            saved = self.optimizer.state_dict()
            per_param: dict[int, dict[str, torch.Tensor]] = {}
            for i, (local, _) in enumerate(self.module.named_parameters()):
                prefix = f"optim/{self.names[local]}/"
                entries = {
                    k[len(prefix) :]: torch.from_numpy(np.array(v))
                    for k, v in state.items()
                    if k.startswith(prefix)
                }
                if entries:
                    per_param[i] = entries
            self.optimizer.load_state_dict({"state": per_param, "param_groups": saved["param_groups"]})
