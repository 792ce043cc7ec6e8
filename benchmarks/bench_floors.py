"""Benchmark: does `heterps run` keep its floor? The README's main job (configs/jobs/quickstart.yaml:
CTR-DNN, 200k synthetic rows, the rl scheduler, a full profile) at floors of 0.3x, 0.5x and 0.7x the
one-process reference trainer's throughput on this machine, and at 3x (which no plan on 2 cores
reaches): each run must meet its floor (achieved >= 0.9 x floor) or stop with exit 3.

    ../shared/bench/quiet.sh && .venv/bin/python benchmarks/bench_floors.py     # ~8 min here

The reference is measured in this run, before and after the jobs (median of the two). Each job is a
fresh `heterps run` process (its own embedded Ray, as a user runs it). Writes benchmarks/bench_floors/floors.json
and prints the table of BENCHMARKS.md "Floors".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from heterps_ray.runtime.reference import reference_rate  # the plain loop, 2 torch threads

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "jobs" / "quickstart.yaml"
FLOOR_MET = 0.9  # achieved >= 0.9 x floor counts as met (the rule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factors", nargs="*", type=float, default=[0.3, 0.5, 0.7, 3.0])
    parser.add_argument("--output-dir", type=Path, default=REPO / "runs" / "bench_floors")
    parser.add_argument("--result", type=Path, default=REPO / "benchmarks" / "bench_floors" / "floors.json")
    parser.add_argument("--reference-steps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=None, help="batches each job trains (default: all)")
    args = parser.parse_args()
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)

    from heterps_ray.config import load_job
    from heterps_ray.data.dataset import prepare_dataset

    job = load_job(JOB)
    prepare_dataset(job.data, seed=job.seed)
    references = [reference_rate(job, args.reference_steps)]
    print(f"reference trainer: {references[0]:,.0f} samples/s", flush=True)
    rows = []
    for factor in args.factors:
        floor = factor * references[0]
        rows.append(_run(job, factor, floor, out, args.steps))
        _print_row(rows[-1])
    references.append(reference_rate(job, args.reference_steps))
    reference = statistics.median(references)
    for row in rows:
        row["reference"] = reference
    result = {"load_average": os.getloadavg()[0], "references": references, "rows": rows}
    args.result.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(_markdown(rows, references))
    print(f"wrote {args.result}")


def _run(job: Any, factor: float, floor: float, out: Path, steps: int | None) -> dict[str, Any]:
    """One `heterps run` of the job at `floor`: its exit code and what its report says."""
    run_dir = out / f"floor_{factor:g}x"
    spec = job.model_dump(mode="json")
    spec.update(throughput_min=round(floor), output_dir=str(run_dir))
    job_file = out / f"job_{factor:g}x.yaml"
    job_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    cmd = [sys.executable, "-m", "heterps_ray.cli", "run", str(job_file), "--overwrite", "--no-progress"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    row: dict[str, Any] = {
        "factor": factor,
        "floor": floor,
        "exit_code": done.returncode,
        "seconds": time.perf_counter() - t0,
        "stderr_tail": done.stderr.strip().splitlines()[-3:],
    }
    report_file = run_dir / "run_report.json"
    if report_file.exists():
        report = json.loads(report_file.read_text())
        row.update(
            plan=report.get("plan"),
            predicted=report.get("predicted_throughput"),
            achieved=report.get("achieved_throughput"),
            floor_met=report.get("floor_met"),
            attempts=len(report.get("floor_replans", report.get("replans", []))),
            auc=report.get("auc"),
        )
    return row


def _verdict(row: dict[str, Any]) -> str:
    if row["exit_code"] == 3:
        return "refused (exit 3)"
    achieved = row.get("achieved") or 0.0
    if row["exit_code"] == 0 and achieved >= FLOOR_MET * row["floor"]:
        return "met"
    return f"MISSED (exit {row['exit_code']})"


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"floor {row['factor']:g}x = {row['floor']:,.0f}: {_verdict(row)}; achieved {row.get('achieved') or 0:,.0f}, "
        f"predicted {row.get('predicted') or 0:,.0f}, plan {row.get('plan')}; {row['seconds']:.0f} s",
        flush=True,
    )


def _markdown(rows: list[dict[str, Any]], references: list[float]) -> str:
    lines = [
        f"reference trainer: {' / '.join(f'{r:,.0f}' for r in references)} samples/s (before / after)",
        "",
        "| floor | samples/s | outcome | plan | predicted | achieved | achieved / floor | re-plans | AUC |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        achieved = r.get("achieved") or 0.0
        auc = f"{r['auc']:.4f}" if r.get("auc") is not None else "–"
        plan = (r.get("plan") or "–").replace(" | ", " · ")  # the plan line's separators are the table's
        lines.append(
            f"| {r['factor']:g}× | {r['floor']:,.0f} | {_verdict(r)} | {plan} | "
            f"{r.get('predicted') or 0:,.0f} | {achieved:,.0f} | {achieved / r['floor']:.2f} | "
            f"{r.get('attempts', 0)} | {auc} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
