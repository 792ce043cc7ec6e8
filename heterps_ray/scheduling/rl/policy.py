"""A policy as small files (weights `policy.pt`, the same weights as `policy.npz`, description
`policy.json`), loadable without Ray.

The pretrained policy shipped in the package lives in `pretrained/`; `scripts/train_policy.py`
writes it. RLlib checkpoints (RLScheduler's `checkpoint_dir`) are for resuming training; this
format is for shipping: a few tens of kB, plain tensors, no pickled classes.

Zero-shot planning reads `policy.npz` into `NumpyPolicy`, the network's forward pass in numpy: importing
torch costs about 2 s of CPU, more than planning a 120-layer problem. `load_policy` gives the torch
`PolicyNetwork` (fine-tuning, tests); a test checks that both give the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from heterps_ray.errors import ConfigError, DataError

PRETRAINED_DIR = Path(__file__).parent / "pretrained"
_WEIGHTS, _META, _ARRAYS = "policy.pt", "policy.json", "policy.npz"
_PT_HASH = "__policy_pt_sha256__"  # in policy.npz: the SHA-256 of the policy.pt it mirrors


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    # the numpy twin names the policy.pt it was made from: a policy.pt replaced alone (e.g. copied
    # by experiments.policy_search.ship_policy) is then noticed, and planning falls back to it
    arrays = {k: v.numpy() for k, v in state.items()} | {_PT_HASH: np.array(_sha256(directory / _WEIGHTS))}
    np.savez(directory / _ARRAYS, **arrays)
    (directory / _META).write_text(json.dumps(metadata, indent=1, default=float) + "\n")
    return directory


def policy_metadata(directory: str | Path = PRETRAINED_DIR) -> dict[str, Any]:
    return json.loads((Path(directory) / _META).read_text())


def _checked_metadata(directory: Path) -> dict[str, Any]:
    from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES

    meta = policy_metadata(directory)
    # a policy reads the observation by position: it loads where this version observes every feature it
    # was trained on (features added since get zero weights: `widen_state`)
    for key, names in (("type_features", TYPE_FEATURES), ("context_features", CONTEXT_FEATURES)):
        missing = [name for name in meta.get(key, names) if name not in names]
        if missing:
            raise ConfigError(
                str(directory / _META),
                key,
                f"features this version observes ({list(names)}); retrain the policy (scripts/train_policy.py)",
                missing,
            )
    return meta


def widen_state(state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """A saved state dict (numpy arrays) made to read this version's observation: the first layer of
    `encode` ([type features, context]), `score` ([type features, context, pooled]) and `value` ([mean and
    max type features, context]) get a zero column for every feature the policy was not trained on, so
    it scores every type exactly as it did; fine-tuning then learns their weights."""
    from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES

    saved_types = list(meta.get("type_features", TYPE_FEATURES))
    saved_context = list(meta.get("context_features", CONTEXT_FEATURES))
    if saved_types == list(TYPE_FEATURES) and saved_context == list(CONTEXT_FEATURES):
        return state
    types = [TYPE_FEATURES.index(name) for name in saved_types]
    context = [CONTEXT_FEATURES.index(name) for name in saved_context]
    nt, nc = len(TYPE_FEATURES), len(CONTEXT_FEATURES)
    features = types + [nt + c for c in context]
    # first-layer inputs: where each saved feature column goes, and the width of those features now;
    # columns past them (score's pooled embeddings) follow unchanged
    layouts = {
        "encode.0.weight": (features, nt + nc),
        "score.0.weight": (features, nt + nc),
        "value.0.weight": (types + [nt + t for t in types] + [2 * nt + c for c in context], 2 * nt + nc),
    }
    out = dict(state)
    for key, (columns, width) in layouts.items():
        if key not in state:
            continue
        old = np.asarray(state[key])
        rest = old.shape[1] - len(columns)
        wide = np.zeros((old.shape[0], width + rest), dtype=old.dtype)
        wide[:, columns + list(range(width, width + rest))] = old
        out[key] = wide
    return out


def load_policy(directory: str | Path = PRETRAINED_DIR) -> Any:
    """A PolicyNetwork with the saved weights, built for the env's spaces (no Ray, no RLlib)."""
    import torch

    from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES
    from heterps_ray.scheduling.rl.network import PolicyNetwork, upgrade_state

    directory = Path(directory)
    meta = _checked_metadata(directory)
    module = PolicyNetwork(
        len(TYPE_FEATURES),
        len(CONTEXT_FEATURES),
        int(meta["hidden"]),
        int(meta.get("set_hidden", meta.get("config", {}).get("set_hidden", 32))),
    )
    try:
        state = torch.load(directory / _WEIGHTS, weights_only=True)
        state = upgrade_state(state, module)  # a policy saved before the set encoder too
        wide = widen_state(
            {k: v.detach().numpy() for k, v in state.items()}, meta
        )  # or before newer features
        module.load_state_dict({k: torch.as_tensor(v) for k, v in wide.items()})
    except Exception as exc:  # noqa: BLE001 - any failure to read the user's file is a DataError naming it
        # weights_only refuses pickled objects (UnpicklingError); a truncated or foreign file fails otherwise
        raise DataError(
            f"{directory / _WEIGHTS}: not a policy's weights (a plain tensor dict): {exc}"
        ) from None
    module.eval()
    return module


def load_planning_policy(directory: str | Path = PRETRAINED_DIR) -> Any:
    """What zero-shot planning rolls out: the NumpyPolicy of `policy.npz` when the directory has one
    (no torch import), else the torch PolicyNetwork of `policy.pt`."""
    directory = Path(directory)
    if not (directory / _ARRAYS).exists():
        return load_policy(directory)
    meta = _checked_metadata(directory)
    try:
        with np.load(directory / _ARRAYS, allow_pickle=False) as arrays:
            state = {k: arrays[k] for k in arrays.files}
    except Exception as exc:  # noqa: BLE001 - any failure to read the user's file is a DataError naming it
        raise DataError(
            f"{directory / _ARRAYS}: not a policy's weights (arrays by layer name): {exc}"
        ) from None
    if _PT_HASH not in state or str(state.pop(_PT_HASH)) != _sha256(directory / _WEIGHTS):
        return load_policy(directory)  # policy.pt was replaced after its twin was written: plan with it
    return NumpyPolicy({k: v.astype(np.float64) for k, v in widen_state(state, meta).items()})


_MASKED_LOGIT = -1.0e9  # as network.MASKED_LOGIT (that module imports torch)
_NO_TYPE = -1.0e4


class NumpyPolicy:
    """network.PolicyNetwork's forward pass (`logits`) in numpy, from its state dict's arrays."""

    def __init__(self, state: dict[str, np.ndarray]):
        if "encode.0.weight" not in state:
            raise DataError("a policy without the set encoder (encode.*): load it with load_policy")
        self.state = state

    def _mlp(self, name: str, x: np.ndarray) -> np.ndarray:
        s = self.state
        x = np.tanh(x @ s[f"{name}.0.weight"].T + s[f"{name}.0.bias"])
        x = np.tanh(x @ s[f"{name}.2.weight"].T + s[f"{name}.2.bias"])
        return x @ s[f"{name}.4.weight"].T + s[f"{name}.4.bias"]

    def logits(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """[batch, types] logits of a batch of observations (masked types: -1e9)."""
        features, context, mask = obs["type_features"], obs["context"], obs["action_mask"]
        own = np.concatenate(
            [features, np.broadcast_to(context[..., None, :], (*features.shape[:-1], context.shape[-1]))],
            axis=-1,
        )
        encoded = self._mlp("encode", own)
        present = obs["type_present"][..., None]
        mean = (encoded * present).sum(axis=-2) / np.maximum(present.sum(axis=-2), 1.0)
        peak = np.where(present > 0.5, encoded, _NO_TYPE).max(axis=-2)
        pooled = np.concatenate([mean, peak], axis=-1)[..., None, :]
        pooled = np.broadcast_to(pooled, (*own.shape[:-1], pooled.shape[-1]))
        logits = self._mlp("score", np.concatenate([own, pooled], axis=-1))[..., 0]
        return np.where(mask < 0.5, _MASKED_LOGIT, logits)
