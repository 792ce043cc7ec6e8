"""Benchmark: how soon a closed-loop re-plan trains again (issue 29: its first batch at most 3 s after
the decision when its types are already up). The README's main job (configs/jobs/quickstart.yaml) run
with a deliberately optimistic problem, as tests/test_run.py's re-plan test does: a profile of the job
with cpu_small 5x and cpu_big 50x as fast, cpu_big priced 100x, the PS unlimited and no shared-core
budget, at a floor of 3x what the profile prices the one-stage plan on cpu_small. The cheapest plan
(one stage on cpu_small) promises the floor and misses it; the loop re-plans onto cpu_big, misses
again, and stops with exit 3 once no plan is left. Each re-plan's record (``floor_attempts[].restart``
in the report) says, from the decision on, when the new plan's train() was called (``replan_s``), its
actors were placed (``ready_s``) and it trained its first batch (``first_batch_s``).

Two ways to meet the re-plan:

* cold (default): each run is a fresh `heterps run` process given the problem, so no profile left an
  actor up: the re-plan onto cpu_big starts its DataWorker (a torch process).
* ``--types-up GAP``: the types are up, as a profile leaves them. In one process (its own Ray, started
  as `heterps run` starts it), the profile's last runtime probes run first (the one-stage plan on
  cpu_small, then on cpu_big: closedloop/probes.py run_probe, a DataWorker of each type left warm),
  then GAP seconds pass (a re-plan that comes that long after its type was last used: warm.IDLE_S is
  20 s), then the run (closedloop run_job). As in `heterps run`, where the profile runs inside the run,
  one warm.hold() covers the probes, the gap and the run. Each line also says how many actors the run
  reconfigured and started (warm.counts()).

    .venv/bin/heterps profile configs/jobs/quickstart.yaml -o problem.yaml   # once
    .venv/bin/python benchmarks/bench_replan.py --problem problem.yaml                  # ~1 min here
    .venv/bin/python benchmarks/bench_replan.py --problem problem.yaml --types-up 25    # ~1.5 min here

Prints one line per re-plan and the load average beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def run_cold(job_file: Path, problem: Path) -> tuple[int, str, dict[str, int] | None]:
    """`heterps run JOB --problem PROBLEM` in a process of its own: (exit code, stderr, None)."""
    ran = subprocess.run(
        [sys.executable, "-m", "heterps_ray", "run", str(job_file), "--problem", str(problem), "--no-progress"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return ran.returncode, ran.stderr, None


def run_types_up(job_file: Path, problem: Path, gap_s: float) -> tuple[int, str, dict[str, int] | None]:
    """The profile's one-stage probe on each type, `gap_s` idle, then the run, in this process under
    one warm.hold(): (exit code, the error, the run's warm.counts())."""
    import ray

    from heterps_ray.closedloop import run_job
    from heterps_ray.closedloop.probes import run_probe
    from heterps_ray.cluster import connect
    from heterps_ray.config import load_job
    from heterps_ray.errors import HeterPSError
    from heterps_ray.models import build_model
    from heterps_ray.runtime import warm

    job = load_job(job_file)
    layers = [layer.name for layer in build_model(job.model).layers]
    connect(job.cluster)
    try:
        with warm.hold():
            for rtype in ("cpu_small", "cpu_big"):
                run_probe(job, layers, rtype, "", len(layers))
            time.sleep(gap_s)
            before = warm.counts()
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # its plan tables, as the cold mode's
                    run_job(job, problem_file=problem, progress=False)
                code, error = 0, ""
            except HeterPSError as exc:
                code, error = exc.exit_code, str(exc)
            used = {k: warm.counts()[k] - before[k] for k in before}
    finally:
        ray.shutdown()
    return code, error, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problem", type=Path, required=True, help="a profile of the quickstart job")
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "quickstart" / "data")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--types-up", type=float, default=None, metavar="GAP",
        help="put both types up first (the profile's one-stage probes), wait GAP s, then run in this process",
    )  # fmt: skip
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
            if args.types_up is None:
                code, error, used = run_cold(job_file, problem)
            else:
                code, error, used = run_types_up(job_file, problem, args.types_up)
            report_file = out / "run" / REPORT_FILE
            if not report_file.is_file():
                sys.exit(f"run {run + 1}: exit {code}, no report\n{error[-3000:]}")
            report = json.loads(report_file.read_text())
            for i, entry in enumerate(report["floor_attempts"] + report["replans"]):
                if entry.get("restart"):
                    print(_line(run + 1, i + 1, entry, load, code, used), flush=True)


def _line(
    run: int,
    replan: int,
    entry: dict[str, Any],
    load: tuple[float, ...],
    code: int,
    used: dict[str, int] | None,
) -> str:
    r = {k: float("nan") if v is None else v for k, v in entry["restart"].items()}
    actors = "" if used is None else f"; the run reused {used['reused']} actor(s), started {used['started']}"
    return (
        f"run {run} re-plan {replan} ({entry.get('old_plan', '?')} -> {entry.get('new_plan', '?')}): "
        f"train() called {r['replan_s']:.2f} s, actors placed {r['ready_s']:.2f} s, first batch "
        f"{r['first_batch_s']:.2f} s after the decision{actors}; load {load[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after (exit {code})"
    )


if __name__ == "__main__":
    main()
