"""The policy network: scores every resource type with one shared MLP and masks the types that cannot run.

Types are padded to a fixed maximum and carry no identity: the same weights score type 0 and type 4 from
their features alone, so one policy applies to any cluster of 2..MAX_TYPES types in any order.
"""

from __future__ import annotations

from typing import Any

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule
from torch import nn

# A masked logit; large and finite so softmax and log-probabilities stay NaN-free.
_MASKED_LOGIT = -1.0e9


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs)
    )


class TypeScoringModule(TorchRLModule, ValueFunctionAPI):
    """PPO module over the env's Dict observation {action_mask, type_features, context}.

    logit(type) = mlp([type_features[type], context]); masked types get a -1e9 logit, so they are never
    sampled and never chosen greedily. The value head reads the context and the mask-weighted mean and
    max of the per-type features (a set summary, independent of type order).
    """

    def setup(self) -> None:
        spaces: Any = self.observation_space
        type_features = spaces["type_features"].shape[1]
        context = spaces["context"].shape[0]
        config: Any = self.model_config or {}
        hidden = int(config.get("hidden", 64))
        self.score = _mlp(type_features + context, hidden, 1)
        self.value = _mlp(2 * type_features + context, hidden, 1)

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        obs = batch[Columns.OBS]
        type_features, context, mask = obs["type_features"], obs["context"], obs["action_mask"]
        per_type_context = context.unsqueeze(-2).expand(*type_features.shape[:-1], context.shape[-1])
        logits = self.score(torch.cat([type_features, per_type_context], dim=-1)).squeeze(-1)
        logits = logits.masked_fill(mask < 0.5, _MASKED_LOGIT)
        return {Columns.ACTION_DIST_INPUTS: logits}

    def compute_values(self, batch: dict[str, Any], embeddings: Any = None) -> torch.Tensor:
        obs = batch[Columns.OBS]
        type_features, context = obs["type_features"], obs["context"]
        # Summarise over the types that exist (padding rows have an all-zero mask in the env).
        present = obs["type_present"].unsqueeze(-1)
        count = present.sum(dim=-2).clamp(min=1.0)
        mean = (type_features * present).sum(dim=-2) / count
        peak = type_features.masked_fill(present < 0.5, -1.0e4).max(dim=-2).values
        return self.value(torch.cat([mean, peak, context], dim=-1)).squeeze(-1)
