"""The reference trainer: one process, plain PyTorch — the ground truth the distributed runtime
must reproduce exactly in sync mode.

One training step, in order:

1. pull the sparse rows for ``keys.ravel()`` from the :class:`SparseTable` (rows created lazily);
2. per micro-batch (``micro_batches`` equal slices of the batch, 1 by default; a sync job's
   ``runtime.micro_batches``, as its DataWorker cuts them): make its rows a leaf tensor ``emb``
   [b, slots, dim] that requires grad, forward the whole model on ``(dense, emb)``, loss = mean
   BCE with logits, backward of loss x b/B (the dense gradients add up over the micro-batches);
3. one dense optimizer step (Adam or SGD over the model's parameters);
4. push the micro-batches' ``emb.grad`` to the table (Adagrad; repeated keys' gradients summed).

The micro-batches sum to the batch's gradient, yet not bit for bit: a matrix product over b rows
rounds differently from one over B. Mostly that stays at 1e-7, but a model can amplify it (AutoInt
with admission on: BENCHMARKS.md "Admission"), so the ground truth of a micro-batched sync run is
the reference cut into the same micro-batches.

Example::

    trainer = ReferenceTrainer.for_job(job)   # the job's model, optimizers, table: and micro-batches
    history = trainer.fit(Dataset(job.data.path), batch_size=512)
    trainer.evaluate(Dataset(job.data.path).load("eval"))   # {"auc": ..., "logloss": ...}
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from heterps_ray.config import JobConfig, OptimizerConfig, TableConfig
from heterps_ray.models import LayerChain, ModelSpec, build_model, loss_fn
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
    # foreach=False: the CPU's default loop, which a sync stage on the CPU steps bit for bit
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
        micro_batches: int = 1,
    ):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1 (got {micro_batches})")
        self.model = model
        self.micro_batches = micro_batches
        self.device = device or torch.device("cpu")
        self.table = sparse_table(model, optimizer, seed, table)
        self.net: LayerChain = model.build(0, model.num_layers, seed).to(self.device)
        self.optimizer = dense_optimizer(self.net.parameters(), optimizer)
        self.steps = 0

    @classmethod
    def for_job(cls, job: JobConfig) -> ReferenceTrainer:
        """The ground truth of `job`'s sync run: its model, optimizers, seed, ``table:`` section, and
        its ``runtime.micro_batches`` when the job is sync (an async run's micro-batches each pull and
        push, which no single process reproduces)."""
        micro_batches = job.runtime.micro_batches if job.mode == "sync" else 1
        return cls(build_model(job.model), job.optimizer, job.seed, job.table, micro_batches=micro_batches)

    def train_step(self, batch: Batch) -> float:
        """One step on one batch; returns the batch's mean loss (before the update)."""
        keys = batch["keys"]
        batch_size, k = len(keys), self.micro_batches
        if batch_size % k:
            raise ValueError(f"micro_batches ({k}) must divide the batch's {batch_size} rows")
        rows = self.table.pull(keys.ravel(), step=self.steps)  # the batch index: the table's clock
        rows = rows.reshape(batch_size, self.model.num_slots, self.model.embedding_dim)
        dense = np.ascontiguousarray(batch["dense"], dtype=np.float32)
        label = np.ascontiguousarray(batch["label"], dtype=np.float32)
        grads = np.empty_like(rows)
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        mb, loss_sum = batch_size // k, 0.0
        for j in range(k):
            part = slice(j * mb, (j + 1) * mb)
            # on the CPU: the rows' own memory (.to is a no-op)
            emb = torch.from_numpy(rows[part]).to(self.device).requires_grad_(True)
            (logit,) = self.net((torch.from_numpy(dense[part]).to(self.device), emb))
            loss = loss_fn(logit, torch.from_numpy(label[part]).to(self.device))
            (loss * (mb / batch_size)).backward()  # as the DataWorker scales a micro-batch (sparse.PerBatch)
            assert emb.grad is not None
            grads[part] = emb.grad.cpu().numpy()
            loss_sum += float(loss.item()) * (mb / batch_size)
        self.optimizer.step()
        self.table.push(keys.ravel(), grads.reshape(-1, self.model.embedding_dim))
        self.steps += 1
        return loss_sum

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
WARMUP_STEPS = 20  # batches before a rate is timed: the first calls and the first read chunk's conversion


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch on `threads` intra-op threads inside the block (None: as it is), the caller's count after:
    code called in-process (a command through main(), a benchmark's loop) leaves the process's threads
    as it found them. The count changes how some products round (AutoInt: 1 thread against 2)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_rate(job: JobConfig, steps: int, threads: int = 2) -> float:
    """samples/s of the reference trainer (the job's model and optimizers, `threads` torch threads) on
    the job's training data, over `steps` batches after WARMUP_STEPS: the plain one-process loop the
    benchmarks compare with (benchmarks/bench_floors.py). The data is synthesised first where the
    job's directory has none."""
    from heterps_ray.data.dataset import prepare_dataset

    with torch_threads(threads):
        trainer = ReferenceTrainer(build_model(job.model), job.optimizer, seed=job.seed)
        batches = prepare_dataset(job.data, seed=job.seed).iter_batches("train", job.batch_size)
        for _ in range(WARMUP_STEPS):
            trainer.train_step(next(batches))
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(next(batches))
        return steps * job.batch_size / (time.perf_counter() - started)


def run_reference(job: JobConfig, steps: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Train a job's model with the reference trainer on its data (synthesised first when the data
    directory is empty and `data.synth_rows` is set), evaluate on the eval split, and write
    `output_dir/reference_summary.json`. Returns the summary."""
    from heterps_ray.data.dataset import prepare_dataset

    dataset = prepare_dataset(job.data, seed=job.seed)
    trainer = ReferenceTrainer.for_job(job)
    model = trainer.model
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
