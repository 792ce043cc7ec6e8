"""Models as chains of layers: per-layer metadata for the cost model, and any contiguous slice of
layers buildable as a torch module, so the runtime can place any stage anywhere.

The activation passed from layer to layer is a tuple of tensors. Layer 0 is the embedding layer;
its input is ``(dense float32[B, num_dense], emb float32[B, num_slots, embedding_dim])`` where
``emb`` holds the rows pulled from the sparse table (they are not torch parameters). The last layer
returns ``(logit float32[B],)``.

Example::

    spec = build_model(ModelConfig(name="ctr_dnn"))
    stage = spec.build(1, 3, seed=0)              # layers 1 and 2 only
    (logit,) = spec.build(0, None, seed=0)((dense, emb))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

FLOAT_BYTES = 4  # activations are float32
KEY_BYTES = 8  # sparse keys are int64

Activation = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class LayerSpec:
    """What the cost model needs to know about one layer (per sample, forward pass)."""

    name: str
    kind: str
    out_bytes_per_sample: int
    """bytes of the output activation tuple per sample (float32)"""
    dense_params: int
    """number of dense (torch) parameters"""
    sparse_rows_per_sample: int
    """sparse-table rows pulled per sample (the embedding layer: one per slot)"""
    flops_per_sample: float
    """forward floating-point operations per sample (a multiply-add counts 2)"""
    parallel_fraction: float
    """Amdahl parallel fraction of the layer when its stage is replicated"""


class LayerChain(nn.Module):
    """Layers ``first .. first+len-1`` of a model; forward maps an activation tuple to the next."""

    def __init__(self, layers: list[nn.Module], first: int):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first

    def forward(self, x: Activation) -> Activation:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass(frozen=True)
class ModelSpec:
    """A model of the zoo: its layers' metadata and how to build any slice of them.

    ``embedding_dim`` is the width of one sparse-table row (models with a wide / first-order term
    keep it as one extra column of the same row, so one table serves the whole model).
    """

    name: str
    num_dense: int
    num_slots: int
    embedding_dim: int
    layers: tuple[LayerSpec, ...]
    layer_factories: tuple[Callable[[], nn.Module], ...] = field(repr=False, compare=False)
    embedding_init_scale: float = 0.01
    """sparse rows start uniform in (-scale, scale)"""

    def __post_init__(self) -> None:
        if len(self.layers) != len(self.layer_factories):
            raise ValueError("one factory per layer is needed")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def input_bytes_per_sample(self) -> int:
        """Bytes of one sample of a Batch: label, dense features and one int64 key per slot."""
        return FLOAT_BYTES * (1 + self.num_dense) + KEY_BYTES * self.num_slots

    @property
    def dense_params(self) -> int:
        return sum(layer.dense_params for layer in self.layers)

    def build(self, start: int = 0, end: int | None = None, seed: int = 0) -> LayerChain:
        """Build layers[start:end] on the CPU; layer i's initial weights depend only on (seed, i)."""
        end = self.num_layers if end is None else end
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"need 0 <= start < end <= {self.num_layers} (got start={start}, end={end})")
        modules = []
        for index in range(start, end):
            with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
                torch.manual_seed(layer_seed(seed, index))
                modules.append(self.layer_factories[index]())
        return LayerChain(modules, first=start)


def layer_seed(seed: int, index: int) -> int:
    """The torch seed of layer `index` of a model built with `seed` (a well-mixed function of both)."""
    state = np.random.SeedSequence([seed & (2**64 - 1), index]).generate_state(1, np.uint64)[0]
    return int(state) & (2**63 - 1)


def loss_fn(logit: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of `logit` against 0/1 `label`."""
    return nn.functional.binary_cross_entropy_with_logits(logit, label)
