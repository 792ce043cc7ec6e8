"""Model quality against the library CTR users reach for: DeepCTR-Torch's DNN and the heterps reference
trainer on the same data, the same architecture and the same epochs (BENCHMARKS.md "Model quality").

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python benchmarks/bench_quality.py [--job configs/jobs/quickstart.yaml] [--sweep] [--out runs/bench_quality]
    .venv/bin/python benchmarks/bench_quality.py --sweep --output benchmarks/bench_quality/quality.json   # BENCHMARKS.md

The data is the job's (the quickstart's 200k synthetic rows, generated into OUT/data with the job's seed:
the same rows as runs/quickstart/data). DeepCTR-Torch's DNN is its WDL with no wide part: the slot
embeddings (dim of the job's model) and the 13 dense features (the same log1p transform) into the same
ReLU tower, Adam at lr 1e-3, its own defaults otherwise (init_std 1e-4, L2 1e-5 on embeddings); the
categorical values are label-encoded per slot over both splits, as DeepCTR's examples do. Both train one
pass over the train split in file order with the job's batch size and are scored on the eval split
(AUC, logloss). `--sweep` also trains the reference trainer over a grid of sparse lr, initial Adagrad
accumulator and embedding init scale, which is how the shipped defaults were chosen. Prints a Markdown
table and writes the figures to OUT/quality.json (or --output). Quality only: no timings are compared.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from heterps_ray.config import JobConfig, load_job
from heterps_ray.data.dataset import Dataset, prepare_dataset
from heterps_ray.runtime.evaluation import evaluate_logits
from heterps_ray.runtime.reference import run_reference

REPO = Path(__file__).resolve().parents[1]
QUIET = Path("/tmp/heterps_quiet")
GRID_KEYS = ("sparse_lr", "sparse_init_accumulator", "init_scale", "dense_lr")
SWEEP = {"sparse_lr": [0.01, 0.02, 0.05, 0.1], "sparse_init_accumulator": [1e-6, 1e-4, 1e-2, 0.1]}


def _wait_quiet() -> None:
    """Another engineer's measurement needs the machine: wait between runs while the file exists."""
    while QUIET.exists():
        time.sleep(10)


def deepctr_dnn(job: JobConfig, dataset: Dataset) -> dict[str, Any]:
    """DeepCTR-Torch's DNN (WDL without its wide part) with the job's architecture, one epoch."""
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import WDL

    params = job.model.params
    dim, hidden = int(params.get("embedding_dim", 9)), tuple(params.get("hidden", (512, 256, 128, 32)))
    train, held_out = dataset.load("train"), dataset.load("eval")
    n = len(train["label"])
    columns: list[Any] = []
    x_train: dict[str, np.ndarray] = {}
    x_eval: dict[str, np.ndarray] = {}
    for s in range(train["keys"].shape[1]):
        ids = np.unique(np.concatenate([train["keys"][:, s], held_out["keys"][:, s]]), return_inverse=True)[1]
        columns.append(SparseFeat(f"C{s + 1}", vocabulary_size=int(ids.max()) + 1, embedding_dim=dim))
        x_train[f"C{s + 1}"], x_eval[f"C{s + 1}"] = ids[:n], ids[n:]
    for j in range(train["dense"].shape[1]):
        columns.append(DenseFeat(f"I{j + 1}", 1))
        x_train[f"I{j + 1}"], x_eval[f"I{j + 1}"] = train["dense"][:, j], held_out["dense"][:, j]
    torch.manual_seed(job.seed)
    model = WDL([], columns, dnn_hidden_units=hidden, seed=job.seed, device="cpu")
    model.compile("adam", "binary_crossentropy")  # Adam's lr: torch's default, 1e-3 (the job's dense lr)
    steps = n // job.batch_size
    keep = steps * job.batch_size  # the reference trainer drops the last partial batch: so does this
    start = time.perf_counter()
    model.fit(
        {k: v[:keep] for k, v in x_train.items()},
        train["label"][:keep],
        batch_size=job.batch_size,
        epochs=job.runtime.epochs,
        verbose=0,
        shuffle=False,
    )
    seconds = time.perf_counter() - start
    p = np.clip(model.predict(x_eval, batch_size=8192).ravel().astype(np.float64), 1e-7, 1 - 1e-7)
    metrics = evaluate_logits(held_out["label"], np.log(p) - np.log1p(-p))
    return {"trainer": "DeepCTR-Torch DNN (WDL, no wide part)", "steps": steps, "seconds": round(seconds, 1),
            **metrics}  # fmt: skip


def reference(job: JobConfig, out: Path, **changes: float) -> dict[str, Any]:
    """The heterps reference trainer on the job, with optimizer / init-scale changes."""
    optimizer = type(job.optimizer)(**{**job.optimizer.model_dump(), **{k: v for k, v in changes.items() if k != "init_scale"}})
    model = job.model
    if "init_scale" in changes:
        model = type(model)(**{**model.model_dump(), "init_scale": changes["init_scale"]})
    name = "-".join(f"{k}={v:g}" for k, v in changes.items()) or "shipped"
    variant = job.model_copy(update={"optimizer": optimizer, "model": model, "output_dir": out / name})
    summary = run_reference(variant, progress=False)
    settings = {
        "sparse_lr": optimizer.sparse_lr,
        "sparse_init_accumulator": optimizer.sparse_init_accumulator,
        "init_scale": model.params.get("init_scale", 0.01),
        "dense_lr": optimizer.dense_lr,
    }
    return {"trainer": f"heterps reference ({name})", **settings, "steps": summary["steps"],
            "seconds": summary["train_seconds"], "auc": summary["auc"], "logloss": summary["logloss"]}  # fmt: skip


def _grid(items: list[str]) -> dict[str, list[float]]:
    grid = {}
    for item in items:
        key, _, values = item.partition("=")
        if key not in GRID_KEYS or not values:
            raise SystemExit(f"--grid {item}: expected KEY=V1,V2 with KEY one of {GRID_KEYS}")
        grid[key] = [float(v) for v in values.split(",")]
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, default=REPO / "configs" / "jobs" / "quickstart.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_quality")
    parser.add_argument("--sweep", action="store_true", help="also the reference trainer over the grid SWEEP")
    parser.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2",
        help=f"sweep these values instead (repeatable; keys: {', '.join(GRID_KEYS)})",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=None, help="JSON of the figures (default OUT/quality.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (quality does not depend on it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    job = load_job(args.job)
    job = job.model_copy(update={"data": job.data.model_copy(update={"path": args.out / "data"})})
    dataset = prepare_dataset(job.data, seed=job.seed)
    rows = []
    _wait_quiet()
    rows.append(deepctr_dnn(job, dataset))
    _wait_quiet()
    rows.append(reference(job, args.out))
    grid = _grid(args.grid) if args.grid else SWEEP if args.sweep else {}
    for values in itertools.product(*grid.values()) if grid else []:
        _wait_quiet()
        rows.append(reference(job, args.out, **dict(zip(grid, values, strict=True))))
    output = args.output or args.out / "quality.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "job": str(args.job),
        "data": {"path": str(dataset.path), "train_rows": dataset.num_rows("train"),
                 "eval_rows": dataset.num_rows("eval"), "achievable_auc": dataset.meta.get("achievable_auc")},
        "model": job.model.model_dump(),
        "batch_size": job.batch_size,
        "epochs": job.runtime.epochs,
        "rows": rows,
    }  # fmt: skip
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"data: {result['data']['train_rows']:,} train / {result['data']['eval_rows']:,} eval rows, "
          f"achievable AUC {result['data']['achievable_auc']:.4f}; batch {job.batch_size}, {job.runtime.epochs} epoch")  # fmt: skip
    print("| trainer | sparse lr | init accumulator | init scale | dense lr | AUC | logloss |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        settings = [f"{r[k]:g}" if k in r else "–" for k in GRID_KEYS]
        print(f"| {r['trainer']} | {' | '.join(settings)} | {r['auc']:.4f} | {r['logloss']:.4f} |")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
