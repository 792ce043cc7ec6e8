"""`heterps run`: profile -> fit -> plan -> train -> report, end to end on the session's real local Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from heterps_ray.cli import main
from heterps_ray.closedloop import REPORT_FILE, run_job
from heterps_ray.config import load_job
from heterps_ray.costmodel import load_problem, one_replica_per_stage
from heterps_ray.costmodel.calibrate import refit, scale_times
from heterps_ray.costmodel.plan import load_plan
from heterps_ray.data.dataset import Dataset
from heterps_ray.errors import ConfigError, InfeasibleError
from heterps_ray.runtime.loop import FLOOR_WINDOW_S
from heterps_ray.scheduling import get_scheduler

REPO = Path(__file__).resolve().parents[1]


def load_run_problem(path: Path):
    """A problem file as `heterps run` plans on it in sync mode (one replica per stage)."""
    return one_replica_per_stage(load_problem(path))


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


# A run long enough for the closed loop's check (warm-up chunk + FLOOR_WINDOW_S of steady chunks)
# and for the model to learn: 40,000 rows, 36,000 to train on, 5 epochs of 281 batches of 128
# (~7 s at the ~27,000 samples/s measured here).
ROWS = 40_000
FLOOR = 1_000  # samples/s: well under what the tiny model trains at here, so it must be met


@pytest.fixture(scope="module")
def first_run(ray_local, tmp_path_factory):
    """One `heterps run` (quick profile, exact scheduler) whose profile and measured rate the closed
    loop tests reuse: (job, report, output_dir)."""
    root = tmp_path_factory.mktemp("run")
    data = {"path": str(root / "data"), "synth_rows": ROWS}
    job = load_job(_job(root, throughput_min=FLOOR, data=data, runtime={"epochs": 5}))
    report = run_job(job, progress=False, quick_profile=True)
    return job, report, root / "out"


@pytest.mark.slow
def test_run_profiles_plans_trains_and_reports(first_run):
    job, report, out = first_run
    for name in ("problem.yaml", "plan.json", "run_summary.json", REPORT_FILE):
        assert (out / name).is_file(), name
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["assignment"]) == 4 and set(plan["assignment"]) <= {"cpu_small", "cpu_big"}
    assert all(stage["replicas"] == 1 for stage in plan["stages"])  # sync: one replica per stage
    assert plan["throughput"] >= FLOOR
    assert report.predicted_throughput == pytest.approx(plan["throughput"])
    # the simulator's steady state of the same plan, from the same profile (its measured details in it)
    from heterps_ray.costmodel import load_problem
    from heterps_ray.costmodel.simulator import simulate

    again = simulate(load_problem(out / "problem.yaml"), plan, batches=100, micro_batches=job.runtime.micro_batches,
                     max_in_flight=job.runtime.max_in_flight, drain_every=20, startup_ms=0.0)  # fmt: skip
    assert report.simulated_throughput == pytest.approx(again.throughput)
    assert "simulated" in report.table() and "(analytic model)" in report.table()
    assert report.cost_rate == pytest.approx(plan["cost_rate"])
    assert report.projected_cost == pytest.approx(
        report.cost_rate * job.samples / report.achieved_throughput / 3600
    )
    # what the run achieved: the floor, with the closed loop's check done and passed (no re-plan)
    summary = json.loads((out / "run_summary.json").read_text())
    check = summary["extra"]["floor_check"]  # the run was long enough to be checked, once
    assert check["met"] is True and check["floor"] == FLOOR and check["seconds"] >= FLOOR_WINDOW_S
    assert check["achieved"] >= 0.9 * FLOOR
    assert report.achieved_throughput == pytest.approx(summary["steady_throughput"])
    assert report.achieved_throughput >= 0.9 * FLOOR
    assert report.throughput_min == FLOOR and report.floor_met is True and report.floor_attempts == []
    assert "met (achieved >= 90% of it)" in report.table()
    # and the model: 5 epochs of 36,000 rows get within 0.06 of the generator's achievable AUC
    achievable = Dataset(job.data.path).meta["achievable_auc"]
    assert 0.5 < achievable - 0.06 < report.auc <= achievable + 0.02 and report.logloss < 0.69
    saved = json.loads((out / REPORT_FILE).read_text())
    assert saved["achieved_throughput"] == pytest.approx(report.achieved_throughput)
    assert saved["throughput_min"] == FLOOR and saved["floor_met"] is True

    with pytest.raises(ConfigError, match="without a previous run"):
        run_job(job, steps=8, progress=False, quick_profile=True)


@pytest.mark.slow
def test_run_keeps_the_floor_in_closed_loop_after_an_optimistic_profile(first_run, tmp_path, capsys):
    """`heterps run --problem` with a deliberately optimistic profile: the first run's, refit on what
    its plan (all on cpu_small) achieved, then cpu_small made 0.3x and cpu_big 0.05x as slow. At twice
    the first run's rate, the first plan (the same cheap one) promises the floor and misses it; the
    closed loop refits cpu_small (and the PS it hosts) on the measurement, re-plans onto cpu_big when
    the refit model still lets a plan there reach the floor, resumes from the checkpoint, measures
    again, and either meets the floor or stops with exit 3 naming the highest throughput measured."""
    job, report, out = first_run
    first_plan = load_plan(out / "plan.json")
    assert {s.type for s in first_plan.stages} == {"cpu_small"}
    measured = refit(load_problem(out / "problem.yaml"), first_plan, report.achieved_throughput)
    optimistic = scale_times(scale_times(measured, 0.3, {"cpu_small"}), 0.05, {"cpu_big"})
    problem_file = optimistic.save(tmp_path / "optimistic.yaml")
    floor = 2.0 * report.achieved_throughput
    job_file = _job(tmp_path, throughput_min=floor, data={"path": str(job.data.path)}, output_dir=str(tmp_path / "loop"),
                    runtime={"epochs": 20})  # fmt: skip  # data for several attempts
    code = main(["run", str(job_file), "--problem", str(problem_file), "--no-progress"])

    loop = json.loads((tmp_path / "loop" / REPORT_FILE).read_text())
    assert loop["throughput_min"] == pytest.approx(floor)
    attempts = loop["floor_attempts"]
    assert 1 <= len(attempts) <= 4
    first, *later = attempts
    # the cheapest plan the optimistic model finds (one stage: on cpu_small, or on the even more
    # optimistic cpu_big) promises the floor and misses it
    assert first["old_plan"].startswith("embedding..logit@cpu_")
    assert first["predicted"] >= floor and first["measured"] < 0.9 * floor  # promised, then missed
    assert first["checkpoint"] and Path(first["checkpoint"]).is_dir()
    for i, attempt in enumerate(attempts):  # a re-plan onto a type the refits left, or none left
        if attempt["new_plan"] is None:
            assert attempt["refit_best"] < floor and i == len(attempts) - 1
    for attempt in attempts:
        if attempt["new_plan"] is not None:  # the refit model prices the plan that missed as measured
            assert attempt["old_plan_refit"] == pytest.approx(attempt["measured"], rel=1e-6)
            assert attempt["new_predicted"] >= floor and attempt["new_plan"] != attempt["old_plan"]
    for before, after in zip(attempts, later, strict=False):  # each re-plan ran, from the checkpoint on
        assert after["old_plan"] == before["new_plan"] and after["step"] > before["step"]
    if loop["floor_met"]:
        assert code == 0 and loop["achieved_throughput"] >= 0.9 * floor
        assert attempts[-1]["new_plan"] == loop["plan"]
        resumed = json.loads((tmp_path / "loop" / "run_summary.json").read_text())["extra"]["resumed_from"]
        assert resumed["checkpoint"] == attempts[-1]["checkpoint"] and resumed["plan_changed"]
    else:
        assert code == 3 and loop["floor_met"] is False
        best = max(a["measured"] for a in attempts)
        assert all(a["measured"] < 0.9 * floor for a in attempts)
        assert f"the highest throughput measured is {best:,.0f} samples/s" in capsys.readouterr().err
        assert loop["achieved_throughput"] == pytest.approx(attempts[-1]["measured"])
        assert (tmp_path / "loop" / "plan.json").is_file()  # nothing already written is lost


@pytest.mark.slow
def test_run_refuses_a_floor_three_times_what_the_machine_does(first_run, tmp_path, capsys):
    job, report, out = first_run
    floor = 3.0 * report.achieved_throughput
    job_file = _job(
        tmp_path, throughput_min=floor, data={"path": str(job.data.path)}, output_dir=str(tmp_path / "x3")
    )
    assert main(["run", str(job_file), "--problem", str(out / "problem.yaml"), "--no-progress"]) == 3
    err = capsys.readouterr().err
    fastest = get_scheduler("exact").schedule(load_run_problem(tmp_path / "x3" / "problem.yaml"))
    if not fastest.feasible:  # refused at plan time: the model's fastest plan is named
        assert f"the fastest reaches {fastest.throughput:,.0f} samples/s" in err
        assert not (tmp_path / "x3" / "run_summary.json").exists()  # refused before training
    else:  # a model that over-promises: the closed loop measures and refuses
        loop = json.loads((tmp_path / "x3" / REPORT_FILE).read_text())
        best = max(a["measured"] for a in loop["floor_attempts"])
        assert loop["floor_met"] is False and best < 0.9 * floor
        assert f"the highest throughput measured is {best:,.0f} samples/s" in err


@pytest.mark.slow
def test_run_with_unreachable_floor_names_the_highest_reachable(ray_local, tmp_path):
    job = load_job(_job(tmp_path, throughput_min=1e9))
    with pytest.raises(InfeasibleError, match="the fastest reaches") as err:
        run_job(job, steps=2, progress=False, quick_profile=True)
    assert 0 < err.value.best_throughput < 1e9
    assert not (tmp_path / "out" / "run_summary.json").exists()  # nothing trained
