"""The policy network in plain torch: scores every resource type with one shared MLP and masks the types
that cannot run. Planning with a saved policy needs only this (no RLlib import, which costs ~1.5 s);
`module.TypeScoringModule` wraps the same layers for PPO training, so their weights are interchangeable.

Types are padded to a fixed maximum and carry no identity: the same weights score type 0 and type 4 from
their features alone, so one policy applies to any cluster of 2..MAX_TYPES types in any order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# A masked logit; large and finite so softmax and log-probabilities stay NaN-free.
MASKED_LOGIT = -1.0e9


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs)
    )


def type_logits(score: nn.Module, obs: dict[str, Any]) -> torch.Tensor:
    """logit(type) = score([type_features[type], context]); masked types get a -1e9 logit, so they are
    never sampled and never chosen greedily."""
    type_features, context, mask = obs["type_features"], obs["context"], obs["action_mask"]
    per_type_context = context.unsqueeze(-2).expand(*type_features.shape[:-1], context.shape[-1])
    logits = score(torch.cat([type_features, per_type_context], dim=-1)).squeeze(-1)
    return logits.masked_fill(mask < 0.5, MASKED_LOGIT)


def state_values(value: nn.Module, obs: dict[str, Any]) -> torch.Tensor:
    """The value head reads the context and the mask-weighted mean and max of the per-type features (a
    set summary, independent of type order)."""
    type_features, context = obs["type_features"], obs["context"]
    # Summarise over the types that exist (padding rows have an all-zero mask in the env).
    present = obs["type_present"].unsqueeze(-1)
    count = present.sum(dim=-2).clamp(min=1.0)
    mean = (type_features * present).sum(dim=-2) / count
    peak = type_features.masked_fill(present < 0.5, -1.0e4).max(dim=-2).values
    return value(torch.cat([mean, peak, context], dim=-1)).squeeze(-1)


class PolicyNetwork(nn.Module):
    """The policy's layers (`score`, `value`) without RLlib: what a saved policy loads into."""

    def __init__(self, type_features: int, context: int, hidden: int = 64):
        super().__init__()
        self.score = mlp(type_features + context, hidden, 1)
        self.value = mlp(2 * type_features + context, hidden, 1)

    def logits(self, obs: dict[str, Any]) -> torch.Tensor:
        return type_logits(self.score, obs)
