"""The reference trainer: one process, plain PyTorch — the ground truth the distributed runtime
must reproduce exactly in sync mode.

One training step, in order:

1. pull the sparse rows for ``keys.ravel()`` from the :class:`SparseTable` (rows created lazily);
2. make them a leaf tensor ``emb`` [B, slots, dim] that requires grad;
3. forward the whole model on ``(dense, emb)``; loss = mean BCE with logits;
4. backward; one dense optimizer step (Adam or SGD over the model's parameters);
5. push ``emb.grad`` to the table (Adagrad; repeated keys' gradients summed).

Example::

    trainer = ReferenceTrainer(build_model(job.model), job.optimizer, seed=job.seed, table=job.table)
    history = trainer.fit(Dataset(job.data.path), batch_size=512)
    trainer.evaluate(Dataset(job.data.path).load("eval"))   # {"auc": ..., "logloss": ...}
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import torch

from heterps_ray.config import JobConfig, OptimizerConfig, TableConfig
from heterps_ray.models import LayerChain, ModelSpec, loss_fn
from heterps_ray.ps.atomic import write_bytes_atomic
from heterps_ray.ps.table import SparseTable
from heterps_ray.runtime.evaluation import evaluate_logits

Batch = dict[str, np.ndarray]
_EVAL_CHUNK = 8192  # rows per forward pass when evaluating


class _BatchSource(Protocol):
    def num_rows(self, split: str) -> int: ...

    def iter_batches(self, split: str, batch_size: int, files: Any = None, drop_last: bool = True) -> Any: ...


def sparse_table(
    model: ModelSpec, optimizer: OptimizerConfig, seed: int, table: TableConfig | None = None
) -> SparseTable:
    """The sparse table for `model`, with the job's Adagrad settings and its `table:` section's
    admission and TTL (the per-shard row cap is the runtime's: its shards hold a partition each)."""
    table = table or TableConfig()
    return SparseTable(
        dim=model.embedding_dim,
        seed=seed,
        lr=optimizer.sparse_lr,
        init_accumulator=optimizer.sparse_init_accumulator,
        init_scale=model.embedding_init_scale,
        admit_after=table.admit_after,
        ttl=table.ttl_batches,
    )


def dense_optimizer(
    parameters: Iterable[torch.nn.Parameter], optimizer: OptimizerConfig
) -> torch.optim.Optimizer:
    """The dense optimizer of a job: Adam (torch defaults besides lr) or plain SGD."""
    params = list(parameters)
    # foreach=False: the CPU's default loop, also for a net on a GPU (stage.make_optimizer says why)
    if optimizer.dense == "adam":
        return torch.optim.Adam(params, lr=optimizer.dense_lr, foreach=False)
    return torch.optim.SGD(params, lr=optimizer.dense_lr, foreach=False)


class ReferenceTrainer:
    """Sparse table (Adagrad) + the full model (Adam/SGD) + BCE loss, in one process on the CPU (the
    dense net on `device` instead: what one GPU stage computes, for scripts/gpu_check.py --no-ray)."""

    def __init__(
        self,
        model: ModelSpec,
        optimizer: OptimizerConfig,
        seed: int = 0,
        table: TableConfig | None = None,
        device: torch.device | None = None,
    ):
        self.model = model
        self.device = device or torch.device("cpu")
        self.table = sparse_table(model, optimizer, seed, table)
        self.net: LayerChain = model.build(0, model.num_layers, seed).to(self.device)
        self.optimizer = dense_optimizer(self.net.parameters(), optimizer)
        self.steps = 0

    def train_step(self, batch: Batch) -> float:
        """One step on one batch; returns the batch's mean loss (before the update)."""
        keys = batch["keys"]
        batch_size = len(keys)
        rows = self.table.pull(keys.ravel(), step=self.steps)  # the batch index: the table's clock
        emb = torch.from_numpy(rows).view(batch_size, self.model.num_slots, self.model.embedding_dim)
        emb = emb.to(self.device).requires_grad_(True)  # on the CPU: the same tensor
        dense = torch.from_numpy(np.ascontiguousarray(batch["dense"], dtype=np.float32)).to(self.device)
        label = torch.from_numpy(np.ascontiguousarray(batch["label"], dtype=np.float32)).to(self.device)
        self.net.train()
        (logit,) = self.net((dense, emb))
        loss = loss_fn(logit, label)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        assert emb.grad is not None
        self.table.push(keys.ravel(), emb.grad.view(-1, self.model.embedding_dim).cpu().numpy())
        self.steps += 1
        return float(loss.item())

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Logits for every row of `batch`; unseen keys use their initial rows and are not stored."""
        self.net.eval()
        logits = []
        for start in range(0, len(batch["keys"]), _EVAL_CHUNK):
            keys = batch["keys"][start : start + _EVAL_CHUNK]
            rows = self.table.pull(keys.ravel(), create=False)
            emb = torch.from_numpy(rows).view(len(keys), self.model.num_slots, self.model.embedding_dim)
            dense = torch.from_numpy(np.ascontiguousarray(batch["dense"][start : start + _EVAL_CHUNK]))
            (logit,) = self.net((dense.float().to(self.device), emb.to(self.device)))
            logits.append(logit.cpu().numpy())
        return np.concatenate(logits) if logits else np.zeros(0, dtype=np.float32)

    def evaluate(self, batch: Batch) -> dict[str, float]:
        """AUC and logloss of the model on `batch` (typically a whole held-out split)."""
        return evaluate_logits(batch["label"], self.predict(batch))

    def fit(
        self,
        dataset: _BatchSource,
        batch_size: int,
        epochs: int = 1,
        steps: int | None = None,
        progress: bool = True,
    ) -> dict[str, Any]:
        """Train on the train split in the dataset's deterministic order, `epochs` passes or `steps`
        batches, whichever ends first. Returns {"loss": [...], "steps", "samples", "seconds"}."""
        from tqdm import tqdm

        losses: list[float] = []
        start = time.perf_counter()
        total = epochs * (dataset.num_rows("train") // batch_size)
        total = total if steps is None else min(steps, total)
        bar = tqdm(total=total, disable=not progress, unit="batch", desc=f"reference {self.model.name}")
        try:
            for _ in range(epochs):
                for batch in dataset.iter_batches("train", batch_size, drop_last=True):
                    losses.append(self.train_step(batch))
                    bar.update(1)
                    if len(losses) % 20 == 0:
                        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}")
                    if steps is not None and len(losses) >= steps:
                        break
                if steps is not None and len(losses) >= steps:
                    break
        finally:
            bar.close()
        seconds = time.perf_counter() - start
        return {
            "loss": losses,
            "steps": len(losses),
            "samples": len(losses) * batch_size,
            "seconds": seconds,
            "samples_per_second": len(losses) * batch_size / seconds if seconds > 0 else 0.0,
        }


SUMMARY_FILE = "reference_summary.json"


def run_reference(job: JobConfig, steps: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Train a job's model with the reference trainer on its data (synthesised first when the data
    directory is empty and `data.synth_rows` is set), evaluate on the eval split, and write
    `output_dir/reference_summary.json`. Returns the summary."""
    from heterps_ray.data.dataset import prepare_dataset
    from heterps_ray.models import build_model

    model = build_model(job.model)
    dataset = prepare_dataset(job.data, seed=job.seed)
    trainer = ReferenceTrainer(model, job.optimizer, seed=job.seed, table=job.table)
    history = trainer.fit(
        dataset,
        job.batch_size,
        epochs=job.runtime.epochs,
        steps=steps if steps is not None else job.runtime.train_steps,
        progress=progress,
    )
    eval_batch = dataset.load("eval")
    metrics = trainer.evaluate(eval_batch)
    losses = history["loss"]
    summary = {
        "job": job.name,
        "model": model.name,
        "seed": job.seed,
        "batch_size": job.batch_size,
        "steps": history["steps"],
        "samples": history["samples"],
        "train_seconds": round(history["seconds"], 3),
        "samples_per_second": round(history["samples_per_second"], 1),
        "final_loss": float(np.mean(losses[-50:])) if losses else None,
        "eval_rows": len(eval_batch["label"]),
        "auc": metrics["auc"],
        "logloss": metrics["logloss"],
        "achievable_auc": dataset.meta.get("achievable_auc"),
        "sparse_rows": len(trainer.table),
        "dataset": str(dataset.path),
    }
    job.output_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(job.output_dir / SUMMARY_FILE, (json.dumps(summary, indent=2) + "\n").encode())
    return summary
