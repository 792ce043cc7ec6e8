"""The trained model on disk, in non-pickle formats, and loading it back for evaluation.

Layout of ``<output_dir>/model/``::

    model.json                                   model config, layer names, table settings, shards
    dense.npz                                    dense weights, named "<layer>.<param>" (whole-model names)
    sparse/embedding-shard-00000-of-00002.npz    keys int64[n], weights float32[n, dim], accumulators

Every .npz is written with ``np.savez`` of plain arrays and read with ``allow_pickle=False``.

Example::

    ckpt = load_checkpoint("runs/quickstart/model")
    logits = ckpt.predict(Dataset(path).load("eval"))
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from heterps_ray.config import ModelConfig
from heterps_ray.errors import DataError
from heterps_ray.models import LayerChain, ModelSpec, build_model
from heterps_ray.ps.table import SparseTable

MODEL_DIR = "model"


def save_checkpoint(
    directory: str | Path,
    model_config: ModelConfig,
    model: ModelSpec,
    seed: int,
    dense: dict[str, np.ndarray],
    sparse_shards: dict[str, list[dict[str, np.ndarray]]],
    table_settings: dict[str, Any],
) -> Path:
    """Write the model to `directory` (replacing it): dense weights and each table's shard states."""
    directory = Path(directory)
    if directory.exists():
        shutil.rmtree(directory)
    (directory / "sparse").mkdir(parents=True)
    _write_npz(directory / "dense.npz", dense)
    files: dict[str, list[str]] = {}
    rows: dict[str, int] = {}
    for table, shards in sparse_shards.items():
        files[table] = []
        rows[table] = 0
        for i, state in enumerate(shards):
            name = f"{table}-shard-{i:05d}-of-{len(shards):05d}.npz"
            _write_npz(directory / "sparse" / name, state)
            files[table].append(f"sparse/{name}")
            rows[table] += len(state["keys"])
    meta = {
        "model": model_config.model_dump(),
        "layers": [layer.name for layer in model.layers],
        "seed": seed,
        "tables": {t: {**table_settings, "files": files[t], "rows": rows[t]} for t in files},
        "dense_params": int(sum(v.size for v in dense.values())),
    }
    (directory / "model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return directory


def _write_npz(path: Path, arrays: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@dataclass
class Checkpoint:
    """A loaded model: the whole torch model and its sparse table (all shards merged)."""

    spec: ModelSpec
    net: LayerChain
    table: SparseTable

    @torch.no_grad()
    def predict(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """Logits for a Batch (unseen keys use their initial rows)."""
        keys = batch["keys"]
        rows = self.table.pull(keys.ravel(), create=False)
        emb = torch.from_numpy(rows).view(len(keys), self.spec.num_slots, self.spec.embedding_dim)
        dense = torch.from_numpy(np.ascontiguousarray(batch["dense"], dtype=np.float32))
        (logit,) = self.net((dense, emb))
        return logit.numpy()


def load_checkpoint(directory: str | Path, table: str = "embedding") -> Checkpoint:
    """Read a model written by :func:`save_checkpoint`."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "model.json").read_text())
    except OSError as exc:
        raise DataError(
            f"{directory / 'model.json'}: cannot read the model description ({exc.strerror})"
        ) from None
    spec = build_model(ModelConfig(**meta["model"]))
    net = spec.build(0, spec.num_layers, meta["seed"])
    with np.load(directory / "dense.npz", allow_pickle=False) as data:
        dense = {k: data[k] for k in data.files}
    state = net.state_dict()
    names = {f"{spec.layers[int(k.split('.')[1])].name}.{k.split('.', 2)[2]}": k for k in state}
    missing = sorted(set(names) - set(dense))
    if missing:
        raise DataError(f"{directory / 'dense.npz'}: missing weights {missing}")
    net.load_state_dict({names[k]: torch.from_numpy(dense[k]) for k in names}, strict=True)
    settings = meta["tables"][table]
    sparse = SparseTable(
        dim=spec.embedding_dim,
        seed=meta["seed"],
        lr=settings["lr"],
        init_accumulator=settings["init_accumulator"],
        init_scale=settings["init_scale"],
    )
    parts: dict[str, list[np.ndarray]] = {"keys": [], "weights": [], "accumulators": []}
    for name in settings["files"]:
        with np.load(directory / name, allow_pickle=False) as data:
            for k in parts:
                parts[k].append(data[k])
    sparse.load_state({k: np.concatenate(v) for k, v in parts.items()})
    return Checkpoint(spec, net, sparse)
