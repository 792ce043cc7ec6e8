"""Fault-injection benchmark: one ctr_dnn run on small synthetic data per fault kind x kill method, in
sync and async mode, against an undisturbed run of the same mode. Prints a Markdown table (the one
in BENCHMARKS.md "Reliability") and writes the figures as JSON.

    .venv/bin/python scripts/bench_faults.py [--rows 100000 --steps 400 --every 50] [--out runs/bench_faults]

Each faulted run kills one actor (a PS shard, the DataWorker or a StageWorker) with `ray.kill` or
SIGKILL of its worker process, while the DataWorker is mid-chunk, half-way through the run (after
at least one checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import ray

from heterps_ray.cluster import init_kwargs
from heterps_ray.config import JobConfig, load_cluster
from heterps_ray.costmodel.plan import Plan, load_plan
from heterps_ray.data.layout import is_dataset
from heterps_ray.data.synth import synthesize
from heterps_ray.runtime.driver import train

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the fault-injection hook lives with the fault tests
from fault_injection import ActorKiller  # noqa: E402

QUIET = Path("/tmp/heterps_quiet")
KINDS = ("ps_shard", "data_worker", "stage_worker")
METHODS = ("ray.kill", "sigkill")


def _wait_quiet() -> None:
    """Another engineer's measurement needs the machine: wait between runs while the file exists."""
    while QUIET.exists():
        time.sleep(10)


def _job(data: Path, out: Path, mode: str, every: int, ps_hosting: str = "actors") -> JobConfig:
    # PS shards as actors, so that one can be killed (a hosted shard dies with its DataWorker)
    runtime: dict[str, Any] = {
        "micro_batches": 2,
        "max_in_flight": 2,
        "checkpoint_every": every,
        "ps_hosting": ps_hosting,
    }
    if mode == "async":
        runtime.update(micro_batches=1, max_staleness=0)
    return JobConfig.model_validate(
        {
            "name": f"bench-faults-{mode}",
            "model": {"name": "ctr_dnn", "embedding_dim": 8, "hidden": [64, 32]},
            "cluster": load_cluster(REPO / "configs" / "clusters" / "local.yaml").model_dump(),
            "data": {"path": str(data)},
            "batch_size": 128,
            "samples": 100_000,
            "throughput_min": 0,
            "mode": mode,
            "output_dir": str(out),
            "seed": 0,
            "runtime": runtime,
        }
    )


def _plan() -> Plan:
    raw = load_plan(REPO / "configs" / "plans" / "small_three_stage.json").to_dict()  # 3 stages
    raw["ps_shards"] = 2
    return Plan.from_dict(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="synthetic rows (80%% train)")
    parser.add_argument("--steps", type=int, default=400, help="batches per run")
    parser.add_argument("--every", type=int, default=50, help="checkpoint interval (batches)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_faults")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / f"data-{args.rows}"
    if not is_dataset(data):
        synthesize(data, args.rows, seed=2, rows_per_part=max(args.rows // 4, 1))
    cluster = load_cluster(REPO / "configs" / "clusters" / "local.yaml")
    ray.init(**init_kwargs(cluster))  # the embedded Ray a user gets, as the tests use
    rows: list[dict[str, Any]] = []
    for mode in ("sync", "async"):
        _wait_quiet()
        calm = train(
            _job(data, args.out / f"{mode}-calm", mode, args.every),
            _plan(),
            steps=args.steps,
            progress=False,
            overwrite=True,
        )
        for kind in KINDS:
            for method in METHODS:
                _wait_quiet()
                killer = ActorKiller(kind, method, after=max(args.steps // 2, args.every + 1))
                out = args.out / f"{mode}-{kind}-{method}"
                t0 = time.perf_counter()
                run = train(
                    _job(data, out, mode, args.every),
                    _plan(),
                    steps=args.steps,
                    progress=False,
                    overwrite=True,
                    on_chunk=killer,
                )
                faults = run.extra["faults"]
                row = {
                    "mode": mode,
                    "kind": kind,
                    "method": method,
                    "injected": 1,
                    "recovered": len(faults),
                    "steps": run.steps,
                    "batches_applied": run.extra.get("batches_applied"),
                    "batches_lost": run.extra.get("batches_lost"),
                    "batches_duplicated": run.extra.get("batches_duplicated"),
                    "batches_replayed": sum(f["batches_replayed"] for f in faults),
                    "updates_lost": sum(f["updates_lost"] for f in faults),
                    "recovery_s": sum(f["recovery_s"] for f in faults),
                    # a dead DataWorker's progress past the last chunk boundary is unknown
                    "lower_bound": any(f["lower_bound"] for f in faults),
                    "how": [a["how"] for f in faults for a in f["actors"]],
                    "auc": run.auc,
                    "auc_undisturbed": calm.auc,
                    "run_s": time.perf_counter() - t0,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    (args.out / "bench_faults.json").write_text(json.dumps(rows, indent=2) + "\n")
    print()
    print(
        "| mode | actor killed | how | recovered | batches applied / lost / dup. | replayed | "
        "updates lost | recovery s | AUC | AUC undisturbed |"
    )
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|")

    def at_least(row: dict[str, Any]) -> str:
        return "≥" if row.get("lower_bound") else ""

    for r in rows:
        counts = (
            f"{r['batches_applied']} / {r['batches_lost']} / {r['batches_duplicated']}"
            if r["mode"] == "sync"
            else "n/a (async)"
        )
        print(
            f"| {r['mode']} | {r['kind']} | {r['method']} | {r['recovered']}/{r['injected']} | {counts} | "
            f"{at_least(r)}{r['batches_replayed']} | {at_least(r)}{r['updates_lost']} | {r['recovery_s']:.1f} | "
            f"{r['auc']:.4f} | {r['auc_undisturbed']:.4f} |"
        )


if __name__ == "__main__":
    main()
