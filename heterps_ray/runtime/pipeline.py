"""From a plan to the pipeline the runtime builds: stages checked against the model and cluster,
round-robin routing of micro-batches to replicas, and the wire form of activations.

Activations and gradients travel as lists of numpy arrays (zero-copy in the Ray object store);
a ``None`` entry is a gradient that does not exist (an input the stage's output does not depend on).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from heterps_ray.config import ClusterConfig, JobConfig
from heterps_ray.costmodel.plan import Plan
from heterps_ray.devices import gpu_shortfall
from heterps_ray.errors import ConfigError
from heterps_ray.models import ModelSpec
from heterps_ray.runtime.modes import mode_of

Wire = list[np.ndarray | None]


@dataclass(frozen=True)
class StageSpec:
    """One stage of the running pipeline: layers [start, end) on `type`, with `replicas` actors."""

    index: int
    start: int
    end: int
    type: str
    replicas: int
    layers: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": list(self.layers),
            "type": self.type,
            "replicas": self.replicas,
        }


def resolve_stages(plan: Plan, model: ModelSpec, job: JobConfig, file: str | None = None) -> list[StageSpec]:
    """The plan's stages as layer ranges, checked against the model, cluster and mode (ConfigError).

    Stages must cover the model's layers in order.
    """
    names = [layer.name for layer in model.layers]
    assignment = list(plan.assignment)
    if len(assignment) != len(names):
        raise ConfigError(
            file,
            "assignment",
            f"{len(names)} entries, one per layer of model {model.name!r}",
            len(assignment),
        )
    known = [t.name for t in job.cluster.resource_types]
    mode = mode_of(job.mode)
    stages: list[StageSpec] = []
    start = 0
    for i, stage in enumerate(plan.stages):
        layers = list(stage.layers)
        end = start + len(layers)
        unknown = [name for name in layers if name not in names]
        if unknown:
            raise ConfigError(
                file,
                f"stages.{i}.layers",
                f"layers of model {model.name!r} (it has no layer {unknown[0]!r}; its layers are {names})",
                layers,
            )
        if layers != names[start:end]:
            raise ConfigError(
                file,
                f"stages.{i}.layers",
                f"the next layers of {model.name!r} in order: {names[start:end]}",
                layers,
            )
        if stage.type not in known:
            raise ConfigError(
                file,
                f"stages.{i}.type",
                f"a resource type of cluster {job.cluster.name!r}, one of {known}",
                stage.type,
            )
        if any(a != stage.type for a in assignment[start:end]):
            raise ConfigError(
                file,
                f"stages.{i}.type",
                f"the type of its layers in `assignment` ({assignment[start:end]})",
                stage.type,
            )
        if int(stage.replicas) < 1:
            raise ConfigError(file, f"stages.{i}.replicas", "at least 1", stage.replicas)
        mode.check_replicas(int(stage.replicas), file, f"stages.{i}.replicas")
        stages.append(StageSpec(i, start, end, stage.type, int(stage.replicas), tuple(layers)))
        start = end
    if start != len(names):
        raise ConfigError(
            file, "stages", f"stages covering all {len(names)} layers {names}", f"{start} layers"
        )
    ps_type = plan.ps_type
    if ps_type and ps_type not in known:
        # The runtime places shards on the cluster's PS type; a plan naming another cluster's is stale.
        raise ConfigError(
            file, "ps_type", f"a resource type of cluster {job.cluster.name!r}, one of {known}", ps_type
        )
    return stages


def check_capacity(
    stages: list[StageSpec], ps_shards: int, cluster: ClusterConfig, file: str | None = None
) -> None:
    """Replicas of all stages of a type, plus PS shards on it, must fit its max_instances."""
    demand = type_demand(stages, ps_shards, cluster)
    for name, count in demand.items():
        limit = cluster.type(name).max_instances
        if count > limit:
            raise ConfigError(
                file,
                "stages",
                f"at most max_instances={limit} actors of type {name!r} (stage replicas + PS shards)",
                count,
            )


def check_gpus(
    stages: list[StageSpec], ps_shards: int, cluster: ClusterConfig, have: float, file: str | None = None
) -> None:
    """The GPUs the plan's actors ask for (stage replicas, plus `ps_shards` shard actors on the PS
    type) must fit the `have` GPUs of the Ray cluster: else they would wait for placement until the
    ready timeout."""
    short = gpu_shortfall(type_demand(stages, ps_shards, cluster), cluster, have)
    if short:
        raise ConfigError(file, "stages", f"a plan whose GPUs the Ray cluster has ({short})")


def type_demand(stages: list[StageSpec], ps_shards: int, cluster: ClusterConfig) -> dict[str, int]:
    """Actors per resource type: stage replicas, plus `ps_shards` on the PS type."""
    demand: dict[str, int] = {}
    for stage in stages:
        demand[stage.type] = demand.get(stage.type, 0) + stage.replicas
    if ps_shards:
        demand[cluster.ps_resource] = demand.get(cluster.ps_resource, 0) + ps_shards
    return demand


def route(counter: int, worker: int, replicas: list[int]) -> list[int]:
    """Replica of each stage for a data worker's `counter`-th micro-batch (deterministic round robin)."""
    return [(counter + worker) % k for k in replicas]


def to_wire(tensors: tuple[torch.Tensor | None, ...] | list[torch.Tensor | None]) -> Wire:
    """Tensors -> numpy arrays on the CPU (None stays None)."""
    return [None if t is None else t.detach().cpu().numpy() for t in tensors]


def from_wire(arrays: Wire, device: torch.device, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """Numpy arrays (often read-only views into the object store) -> tensors on `device`.

    Floating inputs become leaves that require grad when `requires_grad`, so their gradient can be
    sent back upstream. The tensors are never written to, so read-only buffers are fine.
    """
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for a in arrays:
            if a is None:
                raise ValueError("an activation entry is missing")
            t = torch.from_numpy(a).to(device)
            if requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            out.append(t)
    return tuple(out)
