"""The model zoo: CTR-DNN, Wide&Deep, DeepFM, DLRM and AutoInt, each a chain of layers with metadata.

FLOPs are forward operations per sample: a multiply-add counts 2, an elementwise op 1; copies
(concatenation) count 0. Output bytes are those of the whole activation tuple, float32.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from heterps_ray.config import ModelConfig
from heterps_ray.errors import ConfigError
from heterps_ray.models import layers as L
from heterps_ray.models.base import FLOAT_BYTES, LayerSpec, ModelSpec

NUM_DENSE = 13  # Criteo: I1..I13
NUM_SLOTS = 26  # Criteo: C1..C26

# Amdahl parallel fraction per layer kind when a stage is replicated. Dense matmuls scale almost
# perfectly; the embedding layer is memory-bound; the tiny logit layer is dominated by overheads.
PARALLEL_FRACTION = {
    "embedding": 0.90,
    "fc": 0.99,
    "fm": 0.95,
    "interaction": 0.97,
    "attention": 0.99,
    "logit": 0.90,
}


def _linear_flops(n_in: int, n_out: int, relu: bool) -> float:
    return 2.0 * n_in * n_out + n_out + (n_out if relu else 0)


def _linear_params(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


class _Chain:
    """Collects layer specs and their factories in order."""

    def __init__(self) -> None:
        self.specs: list[LayerSpec] = []
        self.factories: list[Callable[[], nn.Module]] = []

    def add(
        self,
        name: str,
        kind: str,
        factory: Callable[[], nn.Module],
        out_floats: int,
        params: int,
        flops: float,
        sparse_rows: int = 0,
    ) -> None:
        self.specs.append(
            LayerSpec(
                name=name,
                kind=kind,
                out_bytes_per_sample=FLOAT_BYTES * out_floats,
                dense_params=params,
                sparse_rows_per_sample=sparse_rows,
                flops_per_sample=float(flops),
                parallel_fraction=PARALLEL_FRACTION[kind],
            )
        )
        self.factories.append(factory)

    def mlp(self, prefix: str, n_in: int, widths: Sequence[int], carried_floats: int = 0) -> int:
        """Fully connected ReLU layers, one layer each, carrying `carried_floats` along; returns the width."""
        for i, width in enumerate(widths, start=1):
            self.add(
                f"{prefix}{i}",
                "fc",
                functools.partial(L.FullyConnected, n_in, width),
                out_floats=width + carried_floats,
                params=_linear_params(n_in, width),
                flops=_linear_flops(n_in, width, relu=True),
            )
            n_in = width
        return n_in

    def logit(self, n_in: int, extras: int = 0) -> None:
        self.add(
            "logit",
            "logit",
            functools.partial(L.Logit, n_in),
            out_floats=1,
            params=_linear_params(n_in, 1),
            flops=_linear_flops(n_in, 1, relu=False) + extras,
        )

    def spec(self, name: str, num_dense: int, num_slots: int, row_dim: int, init_scale: float) -> ModelSpec:
        return ModelSpec(
            name=name,
            num_dense=num_dense,
            num_slots=num_slots,
            embedding_dim=row_dim,
            layers=tuple(self.specs),
            layer_factories=tuple(self.factories),
            embedding_init_scale=init_scale,
        )


def ctr_dnn(
    embedding_dim: int = 9,
    hidden: Sequence[int] = (512, 256, 128, 32),
    num_dense: int = NUM_DENSE,
    num_slots: int = NUM_SLOTS,
    init_scale: float = 0.01,
) -> ModelSpec:
    """CTR-DNN as in PaddleRec: slot embeddings (one key per slot, so sum-pooling is the row itself)
    concatenated with the dense features, an FC ReLU tower, then a linear logit."""
    chain = _Chain()
    width = num_slots * embedding_dim + num_dense
    chain.add("embedding", "embedding", L.ConcatEmbedding, width, 0, 0, sparse_rows=num_slots)
    width = chain.mlp("fc", width, hidden)
    chain.logit(width)
    return chain.spec("ctr_dnn", num_dense, num_slots, embedding_dim, init_scale)


def wide_deep(
    embedding_dim: int = 9,
    hidden: Sequence[int] = (512, 256, 128),
    num_dense: int = NUM_DENSE,
    num_slots: int = NUM_SLOTS,
    init_scale: float = 0.01,
) -> ModelSpec:
    """Wide&Deep: a linear wide part (one weight per key, kept as the last column of the key's row,
    plus a linear map of the dense features) added to the deep tower's logit."""
    chain = _Chain()
    width = num_slots * embedding_dim + num_dense
    chain.add(
        "embedding",
        "embedding",
        functools.partial(L.WideEmbedding, num_dense, keep_vectors=False),
        out_floats=width + 1,
        params=_linear_params(num_dense, 1),
        flops=num_slots + 2 * num_dense + 2,
        sparse_rows=num_slots,
    )
    width = chain.mlp("deep", width, hidden, carried_floats=1)
    chain.logit(width, extras=1)
    return chain.spec("wide_deep", num_dense, num_slots, embedding_dim + 1, init_scale)


def deepfm(
    embedding_dim: int = 10,
    hidden: Sequence[int] = (400, 400, 400),
    num_dense: int = NUM_DENSE,
    num_slots: int = NUM_SLOTS,
    init_scale: float = 0.01,
) -> ModelSpec:
    """DeepFM: an FM (first order + pairwise slot interactions) sharing the slot embeddings with a
    deep tower; the logits add up."""
    chain = _Chain()
    vectors = num_slots * embedding_dim
    chain.add(
        "embedding",
        "embedding",
        functools.partial(L.WideEmbedding, num_dense, keep_vectors=True),
        out_floats=vectors + num_dense + 1,
        params=_linear_params(num_dense, 1),
        flops=num_slots + 2 * num_dense + 2,
        sparse_rows=num_slots,
    )
    width = vectors + num_dense
    chain.add("fm", "fm", L.FactorizationMachine, width + 1, 0, 3 * vectors + 4 * embedding_dim + 1)
    width = chain.mlp("deep", width, hidden, carried_floats=1)
    chain.logit(width, extras=1)
    return chain.spec("deepfm", num_dense, num_slots, embedding_dim + 1, init_scale)


def dlrm(
    embedding_dim: int = 16,
    bottom: Sequence[int] = (64, 32),
    top: Sequence[int] = (256, 128),
    num_dense: int = NUM_DENSE,
    num_slots: int = NUM_SLOTS,
    init_scale: float = 0.01,
) -> ModelSpec:
    """DLRM: a bottom MLP over the dense features (its last width is the embedding dim), pairwise
    dot interaction with the slot embeddings, and a top MLP."""
    chain = _Chain()
    emb_floats = num_slots * embedding_dim
    chain.add("embedding", "embedding", L.PassThrough, num_dense + emb_floats, 0, 0, sparse_rows=num_slots)
    width = chain.mlp("bottom", num_dense, (*bottom, embedding_dim), carried_floats=emb_floats)
    vectors = num_slots + 1
    pairs = vectors * (vectors - 1) // 2
    chain.add(
        "interaction",
        "interaction",
        functools.partial(L.DotInteraction, vectors),
        out_floats=width + pairs,
        params=0,
        flops=2.0 * vectors * vectors * embedding_dim,
    )
    width = chain.mlp("top", width + pairs, top)
    chain.logit(width)
    return chain.spec("dlrm", num_dense, num_slots, embedding_dim, init_scale)


def autoint(
    embedding_dim: int = 16,
    attention_layers: int = 3,
    heads: int = 2,
    head_dim: int = 32,
    hidden: Sequence[int] = (256, 128),
    num_dense: int = NUM_DENSE,
    num_slots: int = NUM_SLOTS,
    init_scale: float = 0.01,
) -> ModelSpec:
    """AutoInt+: multi-head self-attention over the field embeddings (26 slots + one token per
    dense feature) — the compute-heavy block — then an MLP and a logit."""
    chain = _Chain()
    fields = num_slots + num_dense
    chain.add(
        "embedding",
        "embedding",
        functools.partial(L.FieldTokens, num_dense, embedding_dim),
        out_floats=fields * embedding_dim,
        params=num_dense * embedding_dim,
        flops=num_dense * embedding_dim,
        sparse_rows=num_slots,
    )
    dim, width = embedding_dim, heads * head_dim
    for i in range(1, attention_layers + 1):
        projections = 4 * 2.0 * fields * dim * width  # query, key, value, residual
        scores = 2.0 * fields * fields * width + fields * width  # q.k, and the 1/sqrt(d) scaling
        softmax = 3.0 * heads * fields * fields
        mix = 2.0 * fields * fields * width  # weights @ values
        chain.add(
            f"attention{i}",
            "attention",
            functools.partial(L.SelfAttention, dim, heads, head_dim),
            out_floats=fields * width,
            params=4 * dim * width,
            flops=projections + scores + softmax + mix + 2 * fields * width,
        )
        dim = width
    width = chain.mlp("fc", fields * dim, hidden)
    chain.logit(width)
    return chain.spec("autoint", num_dense, num_slots, embedding_dim, init_scale)


MODELS: dict[str, Callable[..., ModelSpec]] = {
    "ctr_dnn": ctr_dnn,
    "wide_deep": wide_deep,
    "deepfm": deepfm,
    "dlrm": dlrm,
    "autoint": autoint,
}

_SEQUENCE_KWARGS = {"hidden", "bottom", "top"}
_FLOAT_KWARGS = {"init_scale"}


def build_model(config: ModelConfig, file: str | None = None) -> ModelSpec:
    """The ModelSpec for a model config; unknown models or builder kwargs are ConfigErrors naming
    the field (`file` is the config file, for the message)."""
    if config.name not in MODELS:
        raise ConfigError(file, "model.name", f"one of {sorted(MODELS)}", config.name)
    builder = MODELS[config.name]
    allowed = list(inspect.signature(builder).parameters)
    kwargs: dict[str, Any] = {}
    for key, value in config.params.items():
        field = f"model.{key}"
        if key not in allowed:
            raise ConfigError(file, field, f"a parameter of {config.name} (one of {allowed})", value)
        if key in _SEQUENCE_KWARGS:
            kwargs[key] = _positive_ints(file, field, value)
        elif key in _FLOAT_KWARGS:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(file, field, "a positive number", value)
            kwargs[key] = float(value)
        else:
            kwargs[key] = _positive_int(file, field, value)
    return builder(**kwargs)


def _positive_int(file: str | None, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(file, field, "a positive integer", value)
    return value


def _positive_ints(file: str | None, field: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(file, field, "a non-empty list of positive integers", value)
    return tuple(_positive_int(file, f"{field}.{i}", v) for i, v in enumerate(value))
