"""Benchmark: rows held against AUC for admission, TTL and row-wise Adagrad (BENCHMARKS.md "Tables").

One epoch of the quickstart job's model (sync, fixed seed) with the one-process reference trainer
on Criteo-Kaggle-shaped synthetic data (``heterps data synth --shape criteo-kaggle``), once per
table setting: the reference trainer's table is replaced by a SparseTable with that setting (its
clock is then the batch index: the reference pulls once per batch). Reports rows held at the end,
the table's bytes, eval AUC against the data's achievable AUC, and the rows saved against the
setting with everything off.

    .venv/bin/python scripts/bench_admission.py --rows 2000000
    .venv/bin/python scripts/bench_admission.py --rows 300000 --settings off admit2 rowwise
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "jobs" / "quickstart.yaml"
SETTINGS: dict[str, dict[str, Any]] = {
    "off": {},
    "admit2": {"admit_after": 2},
    "admit3": {"admit_after": 3},
    "ttl2000": {"ttl": 2000},
    "admit2+ttl2000": {"admit_after": 2, "ttl": 2000},
    "rowwise": {"optimizer": "rowwise_adagrad"},
}


def run(dataset_path: Path, name: str, table_args: dict[str, Any]) -> dict[str, Any]:
    from heterps_ray.config import load_job
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.models import build_model
    from heterps_ray.ps.table import SparseTable
    from heterps_ray.runtime.reference import ReferenceTrainer

    job = load_job(JOB)
    model = build_model(job.model)
    dataset = Dataset(dataset_path)
    trainer = ReferenceTrainer(model, job.optimizer, seed=job.seed)
    plain = trainer.table
    trainer.table = SparseTable(
        plain.dim, seed=plain.seed, lr=plain.lr, init_accumulator=plain.init_accumulator,
        init_scale=plain.init_scale, **table_args,
    )  # fmt: skip
    start = time.perf_counter()
    history = trainer.fit(dataset, job.batch_size, epochs=1, progress=False)
    metrics = trainer.evaluate(dataset.load("eval"))
    return {
        "setting": name,
        "table": table_args,
        "steps": history["steps"],
        "rows": len(trainer.table),
        "table_mb": round(trainer.table.nbytes / 2**20, 1),
        "auc": round(metrics["auc"], 5),
        "logloss": round(metrics["logloss"], 5),
        "achievable_auc": dataset.meta["achievable_auc"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of synthetic data")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--data", type=Path, default=None, help="dataset dir (default: synthesised)")
    parser.add_argument("--result", type=Path, default=REPO / "benchmarks" / "admission.json")
    args = parser.parse_args()
    data = args.data or REPO / "runs" / "bench_admission" / f"criteo-kaggle-{args.rows}"
    if not (data / "_meta.json").exists():
        from heterps_ray.data.synth import SHAPES, SynthSpec, synthesize

        synthesize(data, args.rows, seed=0, spec=SynthSpec(**SHAPES["criteo-kaggle"]), overwrite=True)
    results = []
    print(
        f"{'setting':>16} {'rows':>10} {'saved':>6} {'MiB':>7} {'AUC':>7} {'dAUC':>7} {'achievable':>10} {'s':>6}"
    )
    for name in args.settings:
        r = run(data, name, SETTINGS[name])
        results.append(r)
        base = results[0]
        saved = 1 - r["rows"] / base["rows"] if base["setting"] == "off" else float("nan")
        print(
            f"{name:>16} {r['rows']:>10,} {saved:>6.1%} {r['table_mb']:>7.1f} {r['auc']:>7.4f} "
            f"{r['auc'] - base['auc']:>+7.4f} {r['achievable_auc']:>10.4f} {r['seconds']:>6.0f}"
        )
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written {args.result}")


if __name__ == "__main__":
    main()
