"""The phases after the last batch: evaluation on the held-out split through the pipeline, the
batch accounting that proves every batch was applied exactly once, and saving the trained model."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import ray

from heterps_ray.runtime.actors import ActorSet
from heterps_ray.runtime.checkpoint import save_checkpoint
from heterps_ray.runtime.evaluation import evaluate_logits
from heterps_ray.runtime.sparse import SPARSE_TABLE

_EVAL_BATCH = 4096  # rows per evaluation micro-batch


def evaluate(actors: ActorSet, eval_files: list[Path]) -> dict[str, float]:
    """AUC and logloss on the eval split, forward through the pipeline (newest weights)."""
    if not eval_files:
        return {}
    ray.get(
        [w.refresh.remote() for r in actors.stage_workers for w in r]
        + [w.refresh.remote() for w in actors.data_workers]
    )
    n = min(actors.num_workers, len(eval_files))
    parts = ray.get(
        [
            actors.data_workers[i].evaluate.remote("eval", _EVAL_BATCH, [str(f) for f in eval_files[i::n]])
            for i in range(n)
        ]
    )
    logits = np.concatenate([p["logits"] for p in parts])
    labels = np.concatenate([p["labels"] for p in parts])
    return {**evaluate_logits(labels, logits), "rows": len(labels)}


def accounting(
    actors: ActorSet, positions: dict[int, int], progress: dict[int, dict[str, int]]
) -> dict[str, Any]:
    """Sync mode: batches applied exactly once on every PS shard, lost and duplicated (from the
    shards' own counts); async mode: the sparse updates each DataWorker sent."""
    return actors.mode.accounting(actors.shards, positions, progress)


def save_model(actors: ActorSet, directory: Path) -> Path:
    """Dense weights (replica 0 of each stage, refreshed) and every shard's sparse rows (each shard
    writes its own file, streamed from its table)."""
    dense: dict[str, np.ndarray] = {}
    for part in ray.get(
        [actors.data_workers[0].dense_state.remote()]
        + [r[0].dense_state.remote() for r in actors.stage_workers]
    ):
        dense.update(part)

    def write_sparse(table: str, paths: list[Path]) -> list[int]:
        reports = ray.get([s.write_rows(str(p), table) for s, p in zip(actors.shards, paths, strict=True)])
        return [int(r["rows"]) for r in reports]

    settings = {k: v for k, v in asdict(actors.table).items() if k != "dim"}
    job = actors.job
    return save_checkpoint(
        directory,
        job.model,
        actors.model,
        job.seed,
        dense,
        {SPARSE_TABLE: actors.num_shards},
        write_sparse,
        settings,
    )
