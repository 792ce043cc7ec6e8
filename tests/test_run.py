"""`heterps run`: profile -> fit -> plan -> train -> report, end to end on the session's real local Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from heterps_ray.config import load_job
from heterps_ray.errors import ConfigError, InfeasibleError
from heterps_ray.run import REPORT_FILE, run_job

REPO = Path(__file__).resolve().parents[1]


def _job(tmp_path: Path, **changes) -> Path:
    job = {
        "name": "tiny",
        "model": {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]},
        "cluster": str(REPO / "configs" / "clusters" / "local.yaml"),
        "data": {"path": str(tmp_path / "data"), "synth_rows": 6000},
        "batch_size": 128,
        "samples": 1_000_000,
        "throughput_min": 50,
        "mode": "sync",
        "scheduler": "exact",
        "output_dir": str(tmp_path / "out"),
    }
    job.update(changes)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.slow
def test_run_profiles_plans_trains_and_reports(ray_local, tmp_path):
    job = load_job(_job(tmp_path))
    report = run_job(job, steps=8, progress=False, quick_profile=True)

    out = tmp_path / "out"
    for name in ("problem.yaml", "plan.json", "run_summary.json", REPORT_FILE):
        assert (out / name).is_file(), name
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["assignment"]) == 4 and set(plan["assignment"]) <= {"cpu_small", "cpu_big"}
    assert all(stage["replicas"] == 1 for stage in plan["stages"])  # sync: one replica per stage
    assert plan["throughput"] >= 50
    assert report.predicted_throughput == pytest.approx(plan["throughput"])
    # the simulator's steady state of the same plan, from the same profile and its measured extras
    from heterps_ray.config import read_yaml
    from heterps_ray.costmodel import load_problem
    from heterps_ray.costmodel.simulator import simulate
    from heterps_ray.profiling.fit import simulator_options

    extras = {**simulator_options(read_yaml(out / "problem.runtime.yaml")), "startup_ms": 0.0}
    again = simulate(load_problem(out / "problem.yaml"), plan, batches=100, micro_batches=job.runtime.micro_batches,
                     max_in_flight=job.runtime.max_in_flight, drain_every=20, **extras)  # fmt: skip
    assert report.simulated_throughput == pytest.approx(again.throughput)
    assert "simulated" in report.table() and "(analytic model)" in report.table()
    assert report.achieved_throughput > 0 and report.cost_rate == pytest.approx(plan["cost_rate"])
    assert report.projected_cost == pytest.approx(
        report.cost_rate * job.samples / report.achieved_throughput / 3600
    )
    assert 0.0 <= report.auc <= 1.0 and report.logloss > 0
    saved = json.loads((out / REPORT_FILE).read_text())
    assert saved["achieved_throughput"] == pytest.approx(report.achieved_throughput)

    with pytest.raises(ConfigError, match="without a previous run"):
        run_job(job, steps=8, progress=False, quick_profile=True)


@pytest.mark.slow
def test_run_with_unreachable_floor_names_the_highest_reachable(ray_local, tmp_path):
    job = load_job(_job(tmp_path, throughput_min=1e9))
    with pytest.raises(InfeasibleError, match="the fastest reaches") as err:
        run_job(job, steps=2, progress=False, quick_profile=True)
    assert 0 < err.value.best_throughput < 1e9
    assert not (tmp_path / "out" / "run_summary.json").exists()  # nothing trained
