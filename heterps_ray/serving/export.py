"""`heterps export`: a trained model in formats a serving stack loads without this package.

Layout of the export directory::

    manifest.json        model, feature hashing, embedding dim, versions, SHA-256 of every file
    dense.torchscript    the dense network (TorchScript): (dense float32[B, 13], emb float32[B, 26, dim])
                         -> logit float32[B]; load with ``torch.jit.load`` (plain torch or LibTorch)
    embeddings.parquet   the trained rows: key int64, vector fixed_size_list<float32>[dim]

A serving stack hashes each row's categorical values to keys as the manifest's ``feature_hashing``
says, looks the keys up in ``embeddings.parquet`` (a key it does not find gets its initial row, as
``unseen_keys`` says; the run's own evaluation does the same), and feeds the dense net. Example::

    manifest = export_model("runs/quickstart", "runs/quickstart-export")
    net = torch.jit.load("runs/quickstart-export/dense.torchscript")
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import heterps_ray
from heterps_ray.data.criteo import DENSE_COLUMNS, SPARSE_COLUMNS
from heterps_ray.errors import DataError
from heterps_ray.models import LayerChain
from heterps_ray.ps.table import SparseTable
from heterps_ray.runtime.checkpoint import MODEL_DIR, Checkpoint, load_checkpoint, write_manifest

FORMAT = "heterps_ray.export/1"
MANIFEST = "manifest.json"
DENSE_FILE = "dense.torchscript"
EMBEDDINGS_FILE = "embeddings.parquet"
_ROWS_PER_GROUP = 1 << 16  # Parquet row group of embeddings.parquet

FEATURE_HASHING = {
    "dense": {
        "columns": list(DENSE_COLUMNS),
        "transform": "log1p(max(x, 0)); missing -> 0",
    },
    "sparse": {
        "columns": list(SPARSE_COLUMNS),
        "key": "splitmix64(siphash24(utf8(v), key=b'heterps_ray_keys') XOR splitmix64(slot)) as int64, "
        "slot = column index (C1 -> 0 .. C26 -> 25), a missing value is the empty string; "
        "siphash24 as pandas.util.hash_array(hash_key='heterps_ray_keys'), splitmix64 is Vigna's finaliser",
        "implementation": "heterps_ray.data.criteo.table_to_batch",
    },
}


def model_dir(output_dir: str | Path) -> Path:
    """The model directory of a run: ``OUTPUT_DIR/model/``, or OUTPUT_DIR itself when it is one."""
    path = Path(output_dir)
    for candidate in (path / MODEL_DIR, path):
        if (candidate / "model.json").is_file():
            return candidate
    raise DataError(
        f"{path}: no trained model (expected {path / MODEL_DIR / 'model.json'}; "
        "`heterps train` or `heterps run` writes it)"
    )


class DenseNet(torch.nn.Module):
    """The dense part of a model with plain tensor inputs: (dense [B, num_dense], emb [B, slots, dim])
    -> logit [B]. This is what is exported; the run's LayerChain takes and returns tuples."""

    def __init__(self, net: LayerChain):
        super().__init__()
        self.net = net

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.net((dense, emb))[0]


def export_model(output_dir: str | Path, output: str | Path) -> dict[str, Any]:
    """Export the model of the run in ``output_dir`` to ``output``; returns the manifest."""
    source = model_dir(output_dir)
    ckpt = load_checkpoint(source)
    out = Path(output)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).is_file())):
        raise DataError(f"{out}: exists and is not an export directory; choose another --output")
    out.mkdir(parents=True, exist_ok=True)
    _save_dense(ckpt, out / DENSE_FILE)
    rows = _save_embeddings(ckpt, out / EMBEDDINGS_FILE)
    spec, table = ckpt.spec, ckpt.table
    info = {
        "format": FORMAT,
        "heterps_ray_version": heterps_ray.__version__,
        "torch_version": torch.__version__,
        "source": str(source.resolve()),
        "model": json.loads((source / "model.json").read_text())["model"],
        "layers": [layer.name for layer in spec.layers],
        "num_dense": spec.num_dense,
        "num_slots": spec.num_slots,
        "embedding_dim": spec.embedding_dim,
        "dense": {
            "file": DENSE_FILE,
            "format": "torchscript",
            "inputs": {
                "dense": f"float32[batch, {spec.num_dense}]",
                "emb": f"float32[batch, {spec.num_slots}, {spec.embedding_dim}] (rows of the row's keys, slot order)",
            },
            "output": "logit float32[batch]; probability = sigmoid(logit)",
        },
        "embeddings": {
            "file": EMBEDDINGS_FILE,
            "rows": rows,
            "columns": {"key": "int64", "vector": f"fixed_size_list<float32>[{spec.embedding_dim}]"},
            "note": "one table for all slots: the slot is mixed into the key",
        },
        "feature_hashing": FEATURE_HASHING,
        "unseen_keys": _unseen_rule(table),
    }
    write_manifest(out, info)
    return {**info, "files": json.loads((out / MANIFEST).read_text())["files"]}


def _unseen_rule(table: SparseTable) -> dict[str, Any]:
    """What a key without a row reads: what training gave it (SparseTable's default row)."""
    if table.admit_after > 1:
        return {
            "rule": "zeros: training gives a key a row at its admit_after-th batch and zeros until then",
            "admit_after": table.admit_after,
        }
    return {
        "rule": "uniform(-init_scale, init_scale) from the key and the seed",
        "seed": table.seed,
        "init_scale": table.init_scale,
        "implementation": "heterps_ray.ps.table.initial_rows",
    }


def load_dense(path: str | Path) -> torch.jit.ScriptModule:
    """The exported dense network (plain ``torch.jit.load``, on the CPU)."""
    return torch.jit.load(str(path), map_location="cpu")


def _save_dense(ckpt: Checkpoint, path: Path) -> None:
    spec = ckpt.spec
    module = DenseNet(ckpt.net).eval().requires_grad_(False)  # inference only: no autograd graph
    rng = np.random.default_rng(0)

    def example(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        dense = torch.from_numpy(rng.random((n, spec.num_dense), dtype=np.float32))
        emb = torch.from_numpy(rng.normal(0, 0.1, (n, spec.num_slots, spec.embedding_dim)).astype(np.float32))
        return dense, emb

    with warnings.catch_warnings(), torch.no_grad():
        # torch.jit is deprecated in favour of torch.export, but TorchScript is what serving stacks
        # (LibTorch, Triton's PyTorch backend) load today; the trace is checked on another batch size.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(module, example(8), check_inputs=[example(3)])
        tmp = path.with_name(f".{path.name}.tmp")
        torch.jit.save(traced, str(tmp))
    tmp.replace(path)


def _save_embeddings(ckpt: Checkpoint, path: Path) -> int:
    state = ckpt.table.state()
    dim = ckpt.spec.embedding_dim
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(state["weights"].reshape(-1), pa.float32()), dim)
    table = pa.table({"key": pa.array(state["keys"], pa.int64()), "vector": vectors})
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, row_group_size=_ROWS_PER_GROUP)
    tmp.replace(path)
    return table.num_rows
