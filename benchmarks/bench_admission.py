"""Benchmark: rows held against AUC for admission, TTL and row-wise Adagrad (BENCHMARKS.md "Admission").

One epoch of the quickstart job's model (sync, fixed seed) with the one-process reference trainer
on Criteo-Kaggle-shaped synthetic data (``heterps data synth --shape criteo-kaggle``), once per
table setting. Admission and TTL go through the job's own ``table:`` section (``TableConfig``), the
path a sync run takes (the reference's clock is the batch index, as the runtime's). Row-wise Adagrad
is not a job setting; its row is the table replaced by one with ``optimizer="rowwise_adagrad"``, for
comparison. Reports rows held at the end, keys waiting for admission, the table's bytes (rows,
index and waiting keys), eval AUC and logloss, and rows and bytes saved against everything off.
Results do not depend on the machine's load; the seconds do.

    .venv/bin/python benchmarks/bench_admission.py --rows 2000000
    .venv/bin/python benchmarks/bench_admission.py --rows 300000 --settings off admit2 rowwise
    .venv/bin/python benchmarks/bench_admission.py --rows 2000000 --data-seed 1 --settings off admit2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "jobs" / "quickstart.yaml"
# table: settings (TableConfig fields), or "optimizer" for the row-wise comparison. TTLs are in
# batches: an epoch of 2M rows is 3,515 batches of 512, so 500 and 1000 expire rows within it.
SETTINGS: dict[str, dict[str, Any]] = {
    "off": {},
    "admit2": {"admit_after": 2},
    "admit3": {"admit_after": 3},
    "admit5": {"admit_after": 5},
    "ttl500": {"ttl_batches": 500},
    "ttl1000": {"ttl_batches": 1000},
    "admit2+ttl1000": {"admit_after": 2, "ttl_batches": 1000},
    "rowwise": {"optimizer": "rowwise_adagrad"},
}


def run(dataset_path: Path, name: str, setting: dict[str, Any]) -> dict[str, Any]:
    from heterps_ray.config import TableConfig, load_job
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.models import build_model
    from heterps_ray.ps.table import SparseTable
    from heterps_ray.runtime.reference import ReferenceTrainer

    job = load_job(JOB)
    model = build_model(job.model)
    dataset = Dataset(dataset_path)
    table_args = {k: v for k, v in setting.items() if k != "optimizer"}
    trainer = ReferenceTrainer(model, job.optimizer, seed=job.seed, table=TableConfig(**table_args))
    if "optimizer" in setting:
        plain = trainer.table
        trainer.table = SparseTable(
            plain.dim, seed=plain.seed, lr=plain.lr, init_accumulator=plain.init_accumulator,
            init_scale=plain.init_scale, optimizer=setting["optimizer"],
        )  # fmt: skip
    start = time.perf_counter()
    history = trainer.fit(dataset, job.batch_size, epochs=1, progress=False)
    metrics = trainer.evaluate(dataset.load("eval"))
    stats = trainer.table.stats()
    return {
        "setting": name,
        "table": setting,
        "steps": history["steps"],
        "rows": stats["rows"],
        "waiting": stats.get("candidates", 0),
        "table_mb": round(stats["bytes"] / 2**20, 2),
        "auc": round(metrics["auc"], 5),
        "logloss": round(metrics["logloss"], 5),
        "achievable_auc": dataset.meta["achievable_auc"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of synthetic data")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic data")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--data", type=Path, default=None, help="dataset dir (default: synthesised)")
    parser.add_argument(
        "--result", type=Path, default=None, help="JSON (default: benchmarks/bench_admission/admission_*.json)"
    )
    args = parser.parse_args()
    data = args.data or REPO / "runs" / "bench_admission" / f"criteo-kaggle-{args.rows}-seed{args.data_seed}"
    if not (data / "_meta.json").exists():
        from heterps_ray.data.synth import SHAPES, SynthSpec, synthesize

        synthesize(
            data, args.rows, seed=args.data_seed, spec=SynthSpec(**SHAPES["criteo-kaggle"]), overwrite=True
        )
    result = args.result or (
        REPO / "benchmarks" / "bench_admission" / f"admission_{args.rows}_seed{args.data_seed}.json"
    )
    results: list[dict[str, Any]] = []
    print(
        f"{'setting':>15} {'rows':>10} {'waiting':>10} {'saved':>6} {'MiB':>7} {'MiB sv':>6} "
        f"{'AUC':>7} {'dAUC':>7} {'logloss':>7} {'s':>5}",
        flush=True,
    )
    for name in args.settings:
        r = run(data, name, SETTINGS[name])
        base = results[0] if results else r
        if base["setting"] == "off":
            r["rows_saved"] = round(1 - r["rows"] / base["rows"], 4)
            r["bytes_saved"] = round(1 - r["table_mb"] / base["table_mb"], 4)
            r["auc_delta"] = round(r["auc"] - base["auc"], 5)
        results.append(r)
        print(
            f"{name:>15} {r['rows']:>10,} {r['waiting']:>10,} {r.get('rows_saved', float('nan')):>6.1%} "
            f"{r['table_mb']:>7.1f} {r.get('bytes_saved', float('nan')):>6.1%} {r['auc']:>7.4f} "
            f"{r.get('auc_delta', float('nan')):>+7.4f} {r['logloss']:>7.4f} {r['seconds']:>5.0f}",
            flush=True,
        )
        result.parent.mkdir(parents=True, exist_ok=True)  # written after each setting: a partial run counts
        result.write_text(
            json.dumps({"rows": args.rows, "data_seed": args.data_seed, "results": results}, indent=2) + "\n"
        )
    print(f"written {result}")


if __name__ == "__main__":
    main()
