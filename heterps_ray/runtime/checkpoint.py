"""The trained model on disk, in non-pickle formats, and loading it back for evaluation.

Layout of ``<output_dir>/model/``::

    model.json                                   model config, layer names, table settings, shards
    manifest.json                                SHA-256 of every file (verified on load)
    dense.npz                                    dense weights, named "<layer>.<param>" (whole-model names)
    sparse/embedding-shard-00000-of-00002.npz    keys int64[n], weights float32[n, dim], accumulators
                                                 (written by the shard itself, in its table's order)

Every .npz holds plain arrays (``np.savez``, or streamed member by member) and is read with
``allow_pickle=False``; every
file goes through a temporary file and a rename, and the directory is built aside and swapped in.

Example::

    ckpt = load_checkpoint("runs/quickstart/model")
    logits = ckpt.predict(Dataset(path).load("eval"))
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from heterps_ray.config import ModelConfig
from heterps_ray.errors import DataError
from heterps_ray.models import LayerChain, ModelSpec, build_model
from heterps_ray.paths import inside
from heterps_ray.ps.atomic import fsync_dir, read_npz, sha256_of, write_bytes_atomic, write_npz_atomic
from heterps_ray.ps.table import SparseTable

MODEL_DIR = "model"
MANIFEST = "manifest.json"


def save_checkpoint(
    directory: str | Path,
    model_config: ModelConfig,
    model: ModelSpec,
    seed: int,
    dense: dict[str, np.ndarray],
    sparse_shards: dict[str, int],
    write_sparse: Callable[[str, list[Path]], list[int]],
    table_settings: dict[str, Any],
) -> Path:
    """Write the model to `directory`: built in a temporary directory, then swapped in by rename.
    `sparse_shards`: each sparse table's shard count; ``write_sparse(table, paths)`` writes each
    shard's rows of `table` (keys, weights, accumulators) to its path and returns their row counts
    (the shards write their own files, streamed: the table never passes through this process)."""
    directory = Path(directory)
    tmp = _fresh_tmp_dir(directory)
    (tmp / "sparse").mkdir()
    write_npz_atomic(tmp / "dense.npz", dense)
    files: dict[str, list[str]] = {}
    rows: dict[str, int] = {}
    for table, count in sparse_shards.items():
        files[table] = [f"sparse/{table}-shard-{i:05d}-of-{count:05d}.npz" for i in range(count)]
        rows[table] = sum(write_sparse(table, [tmp / name for name in files[table]]))
        for name in files[table]:
            if not (tmp / name).is_file():  # written by a shard on a node whose disk is not this one
                shutil.rmtree(tmp, ignore_errors=True)
                raise DataError(
                    f"{directory / name}: a PS shard wrote its rows where this driver cannot see them "
                    "(output_dir must be on storage every node mounts at the same path)"
                )
    meta = {
        "model": model_config.model_dump(),
        "layers": [layer.name for layer in model.layers],
        "seed": seed,
        "tables": {t: {**table_settings, "files": files[t], "rows": rows[t]} for t in files},
        "dense_params": int(sum(v.size for v in dense.values())),
    }
    write_bytes_atomic(tmp / "model.json", (json.dumps(meta, indent=2) + "\n").encode())
    write_manifest(tmp, {})
    _swap_in(tmp, directory)
    return directory


def write_manifest(directory: Path, info: dict[str, Any], known: dict[str, str] | None = None) -> Path:
    """manifest.json of `directory`: `info` plus the SHA-256 of every file under it (`known`: those of
    files hashed as they were written, by relative path: a big table's snapshot is not read back)."""
    known = known or {}
    files = {}
    for p in sorted(directory.rglob("*")):
        name = p.relative_to(directory).as_posix()
        if p.is_file() and p.name != MANIFEST:
            files[name] = known.get(name) or sha256_of(p)
    text = json.dumps({**info, "files": files}, indent=2) + "\n"
    return write_bytes_atomic(directory / MANIFEST, text.encode())


def verify_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of `directory` once every file it lists is present with its SHA-256, and, for an
    incremental training checkpoint, every earlier link of its chain too; else DataError."""
    directory = Path(directory)
    manifest = _verify_files(directory)
    _verify_chain(directory, manifest)
    return manifest


def _verify_files(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        listed = dict(manifest["files"])
    except OSError as exc:
        raise DataError(f"{path}: cannot read the checkpoint manifest ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a checkpoint manifest (JSON with 'files'): {exc}") from None
    for name, digest in listed.items():
        file = inside(directory, name, source=path, field="files")
        if not file.is_file():
            raise DataError(f"{file}: listed in {path} but missing")
        if sha256_of(file) != digest:
            raise DataError(f"{file}: SHA-256 differs from {path} (the file is truncated or corrupted)")
    _verify_shards(directory, path, manifest)
    return manifest


def _verify_shards(directory: Path, path: Path, manifest: dict[str, Any]) -> None:
    """A training checkpoint's PS shard snapshots, as each shard reported writing them: every one
    present with its SHA-256, as many as the shard count. The driver cannot see a file written to
    another node's own disk, so `files` alone would pass a checkpoint that lacks it."""
    shards = manifest.get("shards")
    if shards is None:
        return  # a model directory, or a checkpoint written before shards reported their snapshots
    if len(shards) != manifest.get("ps_shards"):
        raise DataError(
            f"{path}: {len(shards)} PS shard snapshots listed for ps_shards={manifest.get('ps_shards')}"
        )
    for shard in shards:
        file = inside(directory, str(shard.get("file", "")), source=path, field="shards")
        writer = f"written by node {shard.get('node') or '?'} (host {shard.get('host') or '?'})"
        if not file.is_file():
            raise DataError(
                f"{file}: PS shard snapshot missing, {writer}; the checkpoint is incomplete (output_dir must "
                "be on storage every node mounts at the same path)"
            )
        if sha256_of(file) != shard.get("sha256"):
            raise DataError(
                f"{file}: PS shard snapshot {writer} differs from its SHA-256 (truncated or corrupted)"
            )


def _verify_chain(directory: Path, manifest: dict[str, Any]) -> None:
    """An incremental checkpoint's earlier links (``chain``: the full snapshot first, then the deltas
    it builds on): each present, its manifest with the SHA-256 recorded here, its own files intact."""
    path = directory / MANIFEST
    links = manifest.get("chain") or []
    if not isinstance(links, list):
        raise DataError(f"{path}: 'chain' is not a list of links")
    for i, entry in enumerate(links):
        link = inside(directory.parent, str(entry.get("id", "")), source=path, field=f"chain[{i}]")
        what = f"link {i + 1} of the chain of {directory.name} ({'full' if i == 0 else 'delta'})"
        if not (link / MANIFEST).is_file():
            raise DataError(f"{link}: {what} is missing; the incremental checkpoint cannot be rebuilt")
        if sha256_of(link / MANIFEST) != entry.get("sha256"):
            raise DataError(f"{link / MANIFEST}: {what} differs from its SHA-256 in {path}")
        kind = _verify_files(link).get("kind", "full")
        if kind != ("full" if i == 0 else "delta"):
            raise DataError(f"{link / MANIFEST}: {what} is a {kind} checkpoint")


def chain_of(directory: Path) -> list[Path]:
    """The checkpoint directories to load, in order, to rebuild `directory`: its chain's full
    snapshot, the deltas after it, and `directory` itself (just `directory` for a full checkpoint)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    return [directory.parent / entry["id"] for entry in manifest.get("chain") or []] + [directory]


def chain_links(directory: Path) -> list[dict[str, str]]:
    """The ``chain`` of a delta that builds on `directory`: its own chain and `directory` itself,
    each link as its directory name and the SHA-256 of its manifest."""
    manifest = json.loads((directory / MANIFEST).read_text())
    return [*(manifest.get("chain") or []), {"id": directory.name, "sha256": sha256_of(directory / MANIFEST)}]


def _fresh_tmp_dir(directory: Path) -> Path:
    directory.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))


def _swap_in(tmp: Path, directory: Path) -> None:
    """Put `tmp` in place of `directory`. An existing `directory` is exchanged with `tmp` in one atomic
    rename (Linux renameat2), so a reader sees the old or the new directory, never none; elsewhere the
    old one is moved aside first and removed only after."""
    if directory.exists() and _exchange(tmp, directory):
        fsync_dir(directory.parent)
        shutil.rmtree(tmp)  # now the old directory
        return
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(directory, old)
    os.rename(tmp, directory)
    fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where the OS cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def remove_leftovers(output_dir: str | Path) -> list[Path]:
    """Temporary directories a killed run left behind (a checkpoint or model half written, an old
    model moved aside): removed at the next start; returns what was removed."""
    root = Path(output_dir)
    found = [*(root / CHECKPOINTS_DIR).glob(".step-*.tmp"), *root.glob(f".{MODEL_DIR}.*.tmp")]
    found += root.glob(f".{MODEL_DIR}.old-*")
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


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
    """Read a model written by :func:`save_checkpoint`, verifying its manifest first."""
    directory = Path(directory)
    if (directory / MANIFEST).exists():
        verify_manifest(directory)
    try:
        meta = json.loads((directory / "model.json").read_text())
    except OSError as exc:
        raise DataError(
            f"{directory / 'model.json'}: cannot read the model description ({exc.strerror})"
        ) from None
    except ValueError as exc:
        raise DataError(f"{directory / 'model.json'}: not a model description (JSON): {exc}") from None
    spec = build_model(ModelConfig(**meta["model"]))
    net = spec.build(0, spec.num_layers, meta["seed"])
    dense = read_npz(directory / "dense.npz")
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
        # keys the model never admitted read what training read for them (zeros with admission on)
        optimizer=settings.get("optimizer", "adagrad"),
        admit_after=int(settings.get("admit_after", 1)),
    )
    parts: dict[str, list[np.ndarray]] = {"keys": [], "weights": [], "accumulators": []}
    for i, name in enumerate(settings["files"]):
        field = f"tables.{table}.files[{i}]"
        data = read_npz(inside(directory, name, source=directory / "model.json", field=field))
        for k in parts:
            parts[k].append(data[k])
    sparse.load_state({k: np.concatenate(v) for k, v in parts.items()})
    return Checkpoint(spec, net, sparse)


# -- training checkpoints (resume) ---------------------------------------------------------------

CHECKPOINTS_DIR = "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def begin_training_checkpoint(output_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory beside the final step-XXXXXXXX one, to write the files into."""
    return _fresh_tmp_dir(step_dir(output_dir, step))


def commit_training_checkpoint(
    tmp: Path, output_dir: str | Path, step: int, info: dict[str, Any], keep: int = 2
) -> Path:
    """Write the manifest, rename `tmp` to checkpoints/step-XXXXXXXX and keep the newest `keep`, with
    every earlier link their chains need (``info["chain"]`` of an incremental checkpoint)."""
    final = step_dir(output_dir, step)
    hashed = {str(shard["file"]): str(shard["sha256"]) for shard in info.get("shards") or []}
    write_manifest(tmp, {"step": step, **info}, hashed)
    _swap_in(tmp, final)
    existing = sorted(final.parent.glob("step-*"))
    needed = {p.name for p in existing[-keep:]}
    for kept in existing[-keep:]:
        try:
            needed.update(
                str(link["id"]) for link in json.loads((kept / MANIFEST).read_text()).get("chain") or []
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged checkpoint: resuming skips it, so it protects nothing
    for old in existing:
        if old.name not in needed:
            shutil.rmtree(old)
    return final


def has_training_checkpoint(output_dir: str | Path) -> bool:
    """Whether output_dir/checkpoints holds any step-XXXXXXXX directory (valid or not)."""
    return any((Path(output_dir) / CHECKPOINTS_DIR).glob("step-*"))


def latest_training_checkpoint(output_dir: str | Path) -> tuple[Path, dict[str, Any], list[str]]:
    """(directory, manifest, why newer ones were skipped) of the newest checkpoint that verifies."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    skipped: list[str] = []
    for candidate in sorted(root.glob("step-*"), reverse=True):
        try:
            return candidate, verify_manifest(candidate), skipped
        except DataError as exc:
            skipped.append(str(exc))
    if skipped:
        raise DataError(f"{root}: no valid checkpoint; newest problem: {skipped[0]}")
    raise DataError(
        f"{root}: no checkpoint to resume from (a run writes one every runtime.checkpoint_interval_s and after its last batch)"
    )


def jsonable(value: Any) -> Any:
    """`value` with numpy scalars, paths and tuples as plain JSON types (non-finite floats as null)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value
