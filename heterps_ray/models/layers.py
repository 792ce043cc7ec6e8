"""The torch layers the zoo chains together. Each maps an activation tuple to the next one; tensors a
later layer needs (a wide logit, the slot embeddings) ride along in the tuple untouched."""

from __future__ import annotations

import torch
from torch import nn

from heterps_ray.models.base import Activation


class ConcatEmbedding(nn.Module):
    """CTR-DNN input: each slot's (single) embedding, flattened, then the dense features."""

    def forward(self, x: Activation) -> Activation:
        dense, emb = x
        return (torch.cat([emb.flatten(1), dense], dim=1),)


class WideEmbedding(nn.Module):
    """Wide&Deep / DeepFM input. Row = [vector (dim) | first-order weight (1)]; returns the deep
    input (and, with `keep_vectors`, the vectors and dense features) plus the first-order logit."""

    def __init__(self, num_dense: int, keep_vectors: bool):
        super().__init__()
        self.dense_linear = nn.Linear(num_dense, 1)
        self.keep_vectors = keep_vectors

    def forward(self, x: Activation) -> Activation:
        dense, emb = x
        vectors, weights = emb[..., :-1], emb[..., -1]
        first_order = weights.sum(1) + self.dense_linear(dense).squeeze(-1)
        if self.keep_vectors:
            return vectors, dense, first_order
        return torch.cat([vectors.flatten(1), dense], dim=1), first_order


class FactorizationMachine(nn.Module):
    """DeepFM's FM term: first order + pairwise <v_i, v_j> over the slots (the sum-square trick)."""

    def forward(self, x: Activation) -> Activation:
        vectors, dense, first_order = x
        square_of_sum = vectors.sum(1).pow(2)
        sum_of_squares = vectors.pow(2).sum(1)
        fm = first_order + 0.5 * (square_of_sum - sum_of_squares).sum(1)
        return torch.cat([vectors.flatten(1), dense], dim=1), fm


class PassThrough(nn.Module):
    """DLRM's embedding layer: the pulled rows are the embeddings; nothing to compute."""

    def forward(self, x: Activation) -> Activation:
        return x


class FullyConnected(nn.Module):
    """Linear (+ ReLU) on the first tensor (flattened), carrying the other tensors along."""

    def __init__(self, in_features: int, out_features: int, relu: bool = True):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.relu = relu

    def forward(self, x: Activation) -> Activation:
        h = self.linear(x[0].flatten(1))
        return (torch.relu(h) if self.relu else h, *x[1:])


class Logit(nn.Module):
    """The last layer: a linear map to one logit, plus any carried scalar logits (wide, FM)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, 1)

    def forward(self, x: Activation) -> Activation:
        logit = self.linear(x[0].flatten(1)).squeeze(-1)
        for extra in x[1:]:
            logit = logit + extra
        return (logit,)


class DotInteraction(nn.Module):
    """DLRM's interaction: pairwise dots of [bottom-MLP output; slot embeddings], upper triangle,
    concatenated with the bottom-MLP output."""

    def __init__(self, num_vectors: int):
        super().__init__()
        self.rows: torch.Tensor
        self.cols: torch.Tensor
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, x: Activation) -> Activation:
        bottom, emb = x
        z = torch.cat([bottom.unsqueeze(1), emb], dim=1)
        dots = torch.bmm(z, z.transpose(1, 2))
        return (torch.cat([bottom, dots[:, self.rows, self.cols]], dim=1),)


class FieldTokens(nn.Module):
    """AutoInt input: one token per field — the slot embeddings, and a learned vector per dense
    feature scaled by its value."""

    def __init__(self, num_dense: int, dim: int):
        super().__init__()
        self.dense_vectors = nn.Parameter(torch.empty(num_dense, dim))
        nn.init.normal_(self.dense_vectors, std=0.01)

    def forward(self, x: Activation) -> Activation:
        dense, emb = x
        return (torch.cat([emb, dense.unsqueeze(-1) * self.dense_vectors], dim=1),)


class SelfAttention(nn.Module):
    """AutoInt's interacting layer: multi-head self-attention over the fields with a residual
    projection and ReLU."""

    def __init__(self, in_dim: int, heads: int, head_dim: int):
        super().__init__()
        width = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.query = nn.Linear(in_dim, width, bias=False)
        self.key = nn.Linear(in_dim, width, bias=False)
        self.value = nn.Linear(in_dim, width, bias=False)
        self.residual = nn.Linear(in_dim, width, bias=False)

    def forward(self, x: Activation) -> Activation:
        (tokens,) = x
        batch, fields, _ = tokens.shape

        def split(t: torch.Tensor) -> torch.Tensor:  # [B, F, H*d] -> [B, H, F, d]
            return t.view(batch, fields, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.query(tokens)), split(self.key(tokens)), split(self.value(tokens))
        weights = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5, dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(batch, fields, self.heads * self.head_dim)
        return (torch.relu(attended + self.residual(tokens)),)
