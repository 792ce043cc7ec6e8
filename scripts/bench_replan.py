"""Benchmark: how soon a closed-loop re-plan trains again (issue 29: its first batch at most 3 s after
the decision when its types are already up). The README's main job (configs/jobs/quickstart.yaml) run
with a deliberately optimistic problem, as tests/test_run.py's re-plan test does: a profile of the job
with cpu_small 5x and cpu_big 50x as fast, cpu_big priced 100x, the PS unlimited and no shared-core
budget, at a floor of 3x what the profile prices the one-stage plan on cpu_small. The cheapest plan
(one stage on cpu_small) promises the floor and misses it; the loop re-plans onto cpu_big, misses
again, and stops with exit 3 once no plan is left. Each re-plan's record (``floor_attempts[].restart``
in the report) says, from the decision on, when the new plan's train() was called (``replan_s``), its
actors were placed (``ready_s``) and it trained its first batch (``first_batch_s``).

    .venv/bin/heterps profile configs/jobs/quickstart.yaml -o problem.yaml   # once
    .venv/bin/python scripts/bench_replan.py --problem problem.yaml    # ~1 min here

Each run is a fresh `heterps run` process (its own embedded Ray, as a user runs it); prints one line
per re-plan and the load average beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from heterps_ray.closedloop.report import REPORT_FILE
from heterps_ray.costmodel import CostModel, load_problem, problem_from_dict
from heterps_ray.costmodel.calibrate import scale_times

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "jobs" / "quickstart.yaml"


def optimistic(problem_file: Path, out: Path) -> tuple[Path, float]:
    """The optimistic problem (see above) and the floor: 3x the profile's one-stage cpu_small price."""
    measured = load_problem(problem_file)
    layers = len(measured.layers)
    on_small = CostModel(measured).evaluate(["cpu_small"] * layers, [1], 1).throughput
    data = scale_times(scale_times(measured, 0.2, {"cpu_small"}), 0.02, {"cpu_big"}).to_dict()
    for resource in data["resources"]:
        if resource["name"] == "cpu_big":
            resource["price_per_hour"] *= 100.0
    data["ps"].pop("rows_per_second_per_shard", None)
    if data.get("runtime"):
        data["runtime"].update(ps_wait_ms_per_row=0.0, ps_hosted_ms_per_row=0.0)
    data.pop("hosts", None)
    problem = problem_from_dict(data)
    on_big = CostModel(problem).evaluate(["cpu_big"] * layers, [1], 1).throughput
    return problem.save(out / "optimistic.yaml"), min(3.0 * on_small, 0.95 * on_big)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problem", type=Path, required=True, help="a profile of the quickstart job")
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "quickstart" / "data")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    job = yaml.safe_load(JOB.read_text())
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-replan-") as scratch:
            out = Path(scratch)
            problem, floor = optimistic(args.problem, out)
            job.update(
                model=str((JOB.parent / job["model"]).resolve()),
                cluster=str((JOB.parent / job["cluster"]).resolve()),
                data={"path": str(args.data.resolve()), "synth_rows": job["data"]["synth_rows"]},
                output_dir=str(out / "run"),
                throughput_min=round(floor),
                runtime={**job.get("runtime", {}), "epochs": 20},  # data for several attempts
            )
            job_file = out / "job.yaml"
            job_file.write_text(yaml.safe_dump(job))
            load = os.getloadavg()
            ran = subprocess.run(
                [sys.executable, "-m", "heterps_ray", "run", str(job_file), "--problem", str(problem),
                 "--no-progress"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            report_file = out / "run" / REPORT_FILE
            if not report_file.is_file():
                sys.exit(f"run {run + 1}: exit {ran.returncode}, no report\n{ran.stderr[-3000:]}")
            report = json.loads(report_file.read_text())
            for i, entry in enumerate(report["floor_attempts"] + report["replans"]):
                if not entry.get("restart"):
                    continue
                r = {k: float("nan") if v is None else v for k, v in entry["restart"].items()}
                print(
                    f"run {run + 1} re-plan {i + 1} ({entry.get('old_plan', '?')} -> {entry.get('new_plan', '?')}): "
                    f"train() called {r['replan_s']:.2f} s, actors placed {r['ready_s']:.2f} s, first batch "
                    f"{r['first_batch_s']:.2f} s after the decision; load {load[0]:.2f} before, "
                    f"{os.getloadavg()[0]:.2f} after (exit {ran.returncode})"
                )


if __name__ == "__main__":
    main()
