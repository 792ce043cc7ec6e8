"""A policy as two small files (weights `policy.pt`, description `policy.json`), loadable without Ray.

The pretrained policy shipped in the package lives in `pretrained/`; `scripts/train_policy.py`
writes it. RLlib checkpoints (RLScheduler's `checkpoint_dir`) are for resuming training; this
format is for shipping: a few tens of kB, plain torch, no pickled classes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from heterps_ray.errors import ConfigError, DataError

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
    """A PolicyNetwork with the saved weights, built for the env's spaces (no Ray, no RLlib)."""
    import torch

    from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES, SchedulingEnv
    from heterps_ray.scheduling.rl.network import PolicyNetwork

    directory = Path(directory)
    meta = policy_metadata(directory)
    # a policy reads the observation by position: it is only valid for the features it was trained on
    for key, names in (("type_features", TYPE_FEATURES), ("context_features", CONTEXT_FEATURES)):
        if key in meta and list(meta[key]) != list(names):
            raise ConfigError(
                str(directory / _META),
                key,
                f"the features this version observes ({list(names)}); retrain the policy "
                "(scripts/train_policy.py)",
                list(meta[key]),
            )
    observation: Any = SchedulingEnv.spaces()[0]
    module = PolicyNetwork(
        observation["type_features"].shape[1], observation["context"].shape[0], int(meta["hidden"])
    )
    try:
        state = torch.load(directory / _WEIGHTS, weights_only=True)
        module.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - any failure to read the user's file is a DataError naming it
        # weights_only refuses pickled objects (UnpicklingError); a truncated or foreign file fails otherwise
        raise DataError(
            f"{directory / _WEIGHTS}: not a policy's weights (a plain tensor dict): {exc}"
        ) from None
    module.eval()
    return module
