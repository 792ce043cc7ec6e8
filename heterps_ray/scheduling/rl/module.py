"""The PPO module (RLlib new API stack) around the policy network of `network.py`: same layers, same
weights, plus RLlib's forward and value-function interfaces for training."""

from __future__ import annotations

from typing import Any

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule

from heterps_ray.scheduling.rl.network import mlp, state_values, type_logits


class TypeScoringModule(TorchRLModule, ValueFunctionAPI):
    """PPO module over the env's Dict observation {action_mask, type_features, context, type_present}:
    logits from `network.type_logits`, values from `network.state_values`."""

    def setup(self) -> None:
        spaces: Any = self.observation_space
        type_features = spaces["type_features"].shape[1]
        context = spaces["context"].shape[0]
        config: Any = self.model_config or {}
        hidden = int(config.get("hidden", 64))
        self.score = mlp(type_features + context, hidden, 1)
        self.value = mlp(2 * type_features + context, hidden, 1)

    def logits(self, obs: dict[str, Any]) -> torch.Tensor:
        return type_logits(self.score, obs)

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return {Columns.ACTION_DIST_INPUTS: self.logits(batch[Columns.OBS])}

    def compute_values(self, batch: dict[str, Any], embeddings: Any = None) -> torch.Tensor:
        return state_values(self.value, batch[Columns.OBS])
