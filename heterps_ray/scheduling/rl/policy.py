"""A policy as two small files (weights `policy.pt`, description `policy.json`), loadable without Ray.

The pretrained policy shipped in the package lives in `pretrained/`; `scripts/train_policy.py`
writes it. RLlib checkpoints (RLScheduler's `checkpoint_dir`) are for resuming training; this
format is for shipping: a few tens of kB, plain torch, no pickled classes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PRETRAINED_DIR = Path(__file__).parent / "pretrained"
_WEIGHTS, _META = "policy.pt", "policy.json"


def has_policy(directory: str | Path = PRETRAINED_DIR) -> bool:
    directory = Path(directory)
    return (directory / _WEIGHTS).exists() and (directory / _META).exists()


def save_policy(module: Any, directory: str | Path, metadata: dict[str, Any]) -> Path:
    """Write the module's weights and `metadata` (must include `hidden`) to `directory`."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    torch.save(state, directory / _WEIGHTS)
    (directory / _META).write_text(json.dumps(metadata, indent=1, default=float) + "\n")
    return directory


def policy_metadata(directory: str | Path = PRETRAINED_DIR) -> dict[str, Any]:
    return json.loads((Path(directory) / _META).read_text())


def load_policy(directory: str | Path = PRETRAINED_DIR) -> Any:
    """A TypeScoringModule with the saved weights, built for the env's spaces (no Ray needed)."""
    import torch

    from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES, SchedulingEnv
    from heterps_ray.scheduling.rl.module import TypeScoringModule

    directory = Path(directory)
    meta = policy_metadata(directory)
    # a policy reads the observation by position: it is only valid for the features it was trained on
    for key, names in (("type_features", TYPE_FEATURES), ("context_features", CONTEXT_FEATURES)):
        if key in meta and list(meta[key]) != list(names):
            raise ValueError(
                f"{directory}: the policy was trained on other {key}; retrain it (scripts/train_policy.py)"
            )
    spaces = SchedulingEnv.spaces()
    module = TypeScoringModule(
        observation_space=spaces[0], action_space=spaces[1], model_config={"hidden": int(meta["hidden"])}
    )
    module.load_state_dict(torch.load(directory / _WEIGHTS, weights_only=True))
    module.eval()
    return module
