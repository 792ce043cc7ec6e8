"""The policy network in plain torch. Planning with a saved policy needs only this (no RLlib import,
which costs ~1.5 s); `module.TypeScoringModule` builds the same layers for PPO training, so their
weights are interchangeable.

Placeto-style scoring over a set of resource types, with no limit on how many:

* `encode`: a per-type encoder, [type features, context] -> an embedding, the same weights for every type;
* pooling: the mean and the max of those embeddings over the types that exist (a set summary, so the
  order and the number of types do not matter);
* `score`: logit(type) = MLP([its features, context, pooled mean, pooled max]), again shared by all types.

Types carry no identity: a cluster of 2 types or 12, listed in any order, goes through the same
weights; padding (RLlib's fixed training spaces) is masked. A policy saved before the encoder existed
loads with the pooled inputs' weights at zero (`upgrade_state`): it then scores exactly as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# A masked logit; large and finite so softmax and log-probabilities stay NaN-free.
MASKED_LOGIT = -1.0e9
_NO_TYPE = -1.0e4  # what an absent type contributes to a max over types


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs)
    )


def build_layers(module: nn.Module, type_features: int, context: int, hidden: int, set_hidden: int) -> None:
    """Give `module` the policy's layers: `encode`, `score` and `value` (see the module docstring)."""
    module.encode = mlp(type_features + context, set_hidden, set_hidden)
    module.score = mlp(type_features + context + 2 * set_hidden, hidden, 1)
    module.value = mlp(2 * type_features + context, hidden, 1)


def _pool(x: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and max of x [..., T, F] over the present types (present [..., T])."""
    weight = present.unsqueeze(-1)
    count = weight.sum(dim=-2).clamp(min=1.0)
    mean = (x * weight).sum(dim=-2) / count
    peak = x.masked_fill(weight < 0.5, _NO_TYPE).max(dim=-2).values
    return mean, peak


def type_logits(module: Any, obs: dict[str, Any]) -> torch.Tensor:
    """logit(type) = score([type_features[type], context, pooled type embeddings]); masked types get a
    -1e9 logit, so they are never sampled and never chosen greedily."""
    type_features, context, mask = obs["type_features"], obs["context"], obs["action_mask"]
    per_type_context = context.unsqueeze(-2).expand(*type_features.shape[:-1], context.shape[-1])
    own = torch.cat([type_features, per_type_context], dim=-1)
    mean, peak = _pool(module.encode(own), obs["type_present"])
    pooled = torch.cat([mean, peak], dim=-1).unsqueeze(-2).expand(*own.shape[:-1], 2 * mean.shape[-1])
    logits = module.score(torch.cat([own, pooled], dim=-1)).squeeze(-1)
    return logits.masked_fill(mask < 0.5, MASKED_LOGIT)


def state_values(value: nn.Module, obs: dict[str, Any]) -> torch.Tensor:
    """The value head reads the context and the mean and max of the per-type features over the types
    that exist (a set summary, independent of type order and count)."""
    mean, peak = _pool(obs["type_features"], obs["type_present"])
    return value(torch.cat([mean, peak, obs["context"]], dim=-1)).squeeze(-1)


def upgrade_state(state: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict saved before `encode` existed, made loadable into `module`: the new encoder keeps
    `module`'s initial weights and the score's new input columns (the pooled embeddings) start at zero,
    so the upgraded policy scores every type exactly as the old one did."""
    if "encode.0.weight" in state:
        return state
    current = module.state_dict()
    upgraded = dict(state)
    for key, value in current.items():
        if key.startswith("encode."):
            upgraded[key] = value.detach().clone()
    old = state["score.0.weight"]
    wide = torch.zeros_like(current["score.0.weight"])
    wide[:, : old.shape[1]] = old
    upgraded["score.0.weight"] = wide
    return upgraded


class PolicyNetwork(nn.Module):
    """The policy's layers (`encode`, `score`, `value`) without RLlib: what a saved policy loads into."""

    def __init__(self, type_features: int, context: int, hidden: int = 64, set_hidden: int = 32):
        super().__init__()
        build_layers(self, type_features, context, hidden, set_hidden)

    def logits(self, obs: dict[str, Any]) -> torch.Tensor:
        return type_logits(self, obs)
