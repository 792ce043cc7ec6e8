"""benchmarks/validate_costmodel.py --measured: saved real runs are predicted again from a problem file,
without Ray, so the cost model can be iterated on offline."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from heterps_ray.costmodel import load_problem
from heterps_ray.costmodel.simulator import simulate

REPO = Path(__file__).resolve().parents[1]
SMALL, BIG = "cpu_small", "cpu_big"


def _run(measured: Path, problem: Path | None = None) -> str:
    cmd = [sys.executable, str(REPO / "benchmarks" / "validate_costmodel.py"), "--measured", str(measured)]
    if problem is not None:
        cmd += ["--problem", str(problem)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_measured_runs_are_predicted_again_with_and_without_a_shared_host(tmp_path):
    source = REPO / "benchmarks" / "validate_costmodel" / "costmodel_validation_problem.yaml"
    data = yaml.safe_load(source.read_text())
    data.pop("hosts", None)  # every actor on cores of its own
    (tmp_path / "problem.yaml").write_text(yaml.safe_dump(data))
    data["hosts"] = [{"name": "local", "cores": 1, "types": [SMALL, BIG]}]
    (tmp_path / "shared.yaml").write_text(yaml.safe_dump(data))
    rows = [
        {"case": "2 stages, async", "assignment": [SMALL] + [BIG] * 5, "replicas": [2, 1], "ps_shards": 1,
         "mode": "async", "micro_batches": 1, "max_in_flight": 4, "batches": 40, "measured": 1000.0,
         "measured_busy": [0.5, 0.5], "load_average": [0.5, 0.7]},
        {"case": "1 stage, sync", "assignment": [SMALL] * 6, "replicas": [1], "ps_shards": 1, "mode": "sync",
         "micro_batches": 2, "max_in_flight": 4, "batches": 20, "measured": 2000.0, "measured_busy": [0.9],
         "load_average": [0.5, 0.6]},
    ]  # fmt: skip
    measured = tmp_path / "results.json"
    measured.write_text(json.dumps({"problem": "problem.yaml", "rows": rows}))  # relative: beside it

    out = _run(measured)
    table = [line for line in out.splitlines() if line.startswith("| ") and "→" not in line[:3]]
    assert len(table) == 1 + len(rows)  # header + one line per run
    # the printed simulator figure is the simulator's, and the error is against the saved measurement
    problem = load_problem(tmp_path / "problem.yaml")
    plan = {"stages": [{"layers": problem.layer_names, "type": SMALL, "replicas": 1}], "ps_shards": 1}
    sim = simulate(problem, plan, batches=20, micro_batches=2, mode="sync", max_in_flight=4, drain_every=20)
    assert f"{sim.throughput:,.0f}" in table[2]
    assert f"{sim.throughput / 2000.0 - 1:+.0%}" in table[2]
    assert "| 0.5–0.6 |" in table[2]

    # one core shared by both types slows the async plan (both stage types busy at once)
    alone = float(re.search(r"simulator +([\d,]+)", out.splitlines()[0]).group(1).replace(",", ""))
    shared_out = _run(measured, tmp_path / "shared.yaml")
    shared = float(re.search(r"simulator +([\d,]+)", shared_out.splitlines()[0]).group(1).replace(",", ""))
    assert shared < alone
