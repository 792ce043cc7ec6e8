"""The PPO module (RLlib new API stack) around the policy network of `network.py`: same layers, same
weights, plus RLlib's forward and value-function interfaces for training."""

from __future__ import annotations

from typing import Any

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule

from heterps_ray.scheduling.rl.network import build_layers, state_values, type_logits


class TypeScoringModule(TorchRLModule, ValueFunctionAPI):
    """PPO module over the env's Dict observation {action_mask, type_features, context, type_present}:
    logits from `network.type_logits`, values from `network.state_values`. The layers do not depend on
    the observation's number of types, only on the feature counts."""

    def setup(self) -> None:
        spaces: Any = self.observation_space
        config: Any = self.model_config or {}
        build_layers(
            self,
            spaces["type_features"].shape[1],
            spaces["context"].shape[0],
            int(config.get("hidden", 64)),
            int(config.get("set_hidden", 32)),
        )

    def logits(self, obs: dict[str, Any]) -> torch.Tensor:
        return type_logits(self, obs)

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return {Columns.ACTION_DIST_INPUTS: self.logits(batch[Columns.OBS])}

    def compute_values(self, batch: dict[str, Any], embeddings: Any = None) -> torch.Tensor:
        return state_values(self.value, batch[Columns.OBS])
