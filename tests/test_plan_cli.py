"""Plans as data (JSON, table, checked against their problem) and the `heterps plan` / `compare` CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TINY_MODEL, cloud_problem_with_runtime_terms

from heterps_ray.cli import main
from heterps_ray.costmodel import Plan, load_plan, load_problem
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling import get_scheduler, provision
from heterps_ray.scheduling.generator import generate_problem, with_runtime_section

REPO = Path(__file__).resolve().parents[1]
CTR = REPO / "configs" / "problems" / "ctr_dnn_cloud.yaml"


@pytest.fixture(scope="module")
def problem():
    return load_problem(CTR)


@pytest.fixture(scope="module")
def plan(problem):
    return get_scheduler("exact").schedule(problem)


def test_plan_json_has_the_contract_fields(plan):
    data = json.loads(plan.to_json())
    for key in (
        "assignment",
        "stages",
        "ps_shards",
        "throughput",
        "cost",
        "cost_rate",
        "feasible",
        "scheduler",
        "seconds",
    ):
        assert key in data
    assert len(data["assignment"]) == 6
    for stage in data["stages"]:
        assert {"layers", "type", "replicas", "stage_ms", "throughput"} <= set(stage)


def test_plan_round_trips_through_json(plan, problem, tmp_path):
    path = plan.save(tmp_path / "plan.json")
    assert load_plan(path, problem) == plan
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_with_unlimited_ps_round_trips(tmp_path):
    data = yaml.safe_load(CTR.read_text())
    data["ps"].pop("rows_per_second_per_shard")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    problem = load_problem(path)
    plan = provision(problem, ["cpu"] + ["t4"] * 5)
    assert plan.ps_throughput == float("inf")
    assert "Infinity" not in plan.to_json()  # strict JSON
    assert load_plan(plan.save(tmp_path / "plan.json"), problem) == plan


def test_plan_table_has_summary_units_and_totals(plan):
    text = plan.table()
    first = text.splitlines()[0]
    assert "exact" in first and "plans evaluated" in first and "feasible" in first and " s " in first
    for header in ("layers", "type", "replicas", "stage time (ms)", "throughput (samples/s)"):
        assert header in text
    assert "$/h" in text and "total cost" in text and f"{plan.cost:,.4f} $" in text


def _edited(plan: Plan, tmp_path: Path, edit) -> Path:
    data = json.loads(plan.to_json())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_plan_with_wrong_layer_count_is_rejected(plan, problem, tmp_path):
    path = _edited(plan, tmp_path, lambda d: d["assignment"].pop())
    with pytest.raises(ConfigError) as info:
        load_plan(path, problem)
    assert info.value.field == "assignment" and str(path) in str(info.value)


def test_plan_with_unknown_type_is_rejected(plan, problem, tmp_path):
    def edit(d):
        d["assignment"][0] = "h100"

    with pytest.raises(ConfigError) as info:
        load_plan(_edited(plan, tmp_path, edit), problem)
    assert info.value.field == "assignment.0"


def test_plan_whose_stages_disagree_with_its_assignment_is_rejected(plan, problem, tmp_path):
    def edit(d):
        d["stages"][0]["type"] = "a100"

    with pytest.raises(ConfigError) as info:
        load_plan(_edited(plan, tmp_path, edit), problem)
    assert info.value.field == "stages.0"


def test_plan_missing_a_field_is_rejected(plan, tmp_path):
    with pytest.raises(ConfigError) as info:
        load_plan(_edited(plan, tmp_path, lambda d: d.pop("ps_shards")))
    assert info.value.field == "ps_shards"


# -- the plans shipped in configs/plans/, each against the job and model it is meant for -------------

PLANS = REPO / "configs" / "plans"
# the small model the tests train (TINY_MODEL: layers embedding, fc1, fc2, logit); the plans written
# for it say so in their "problem" field
SMALL_MODEL = ("ctr_dnn hidden [32, 16]", TINY_MODEL)


def _job_for_plan(path: Path):
    """The job a shipped plan is meant for: the job of configs/jobs/ its "problem" field names (or
    that job on the tests' small model), in async mode for an async plan (its name says so)."""
    from heterps_ray.config import load_job

    meant = json.loads(path.read_text())["problem"]
    jobs = {load_job(p).name: p for p in sorted((REPO / "configs" / "jobs").glob("*.yaml"))}
    overrides = {"mode": "async"} if "async" in path.stem else {}
    if meant in jobs:
        return load_job(jobs[meant], overrides)
    if meant == SMALL_MODEL[0]:
        return load_job(jobs["quickstart"], {**overrides, "model": SMALL_MODEL[1]})
    known = [*sorted(jobs), SMALL_MODEL[0]]
    pytest.fail(f"{path.name}: meant for {meant!r}, not a job of configs/jobs/ nor the small model: {known}")


@pytest.mark.parametrize("name", sorted(p.name for p in PLANS.glob("*.json")))
def test_every_shipped_plan_loads_and_resolves_against_its_model(name):
    from heterps_ray.models import build_model
    from heterps_ray.runtime.pipeline import check_capacity, resolve_stages

    path = PLANS / name
    job = _job_for_plan(path)
    plan = load_plan(path)
    model = build_model(job.model)
    stages = resolve_stages(plan, model, job, str(path))  # what `heterps train --plan` checks first
    check_capacity(stages, job.runtime.ps_shards or int(plan.ps_shards), job.cluster, str(path))
    assert [layer for s in stages for layer in s.layers] == [layer.name for layer in model.layers]
    assert [s.type for s in stages] == [s.type for s in plan.stages]
    assert plan.ps_shards >= job.cluster.ps.min_shards and plan.ps_type in (None, job.cluster.ps_resource)
    assert plan.feasible and (job.mode == "async") == any(s.replicas > 1 for s in plan.stages)


def test_shipped_plan_lookup_refuses_a_plan_meant_for_no_job(tmp_path):
    stray = tmp_path / "stray.json"
    stray.write_text(json.dumps({**json.loads((PLANS / "quickstart.json").read_text()), "problem": "deepfm"}))
    with pytest.raises(pytest.fail.Exception, match="meant for 'deepfm'"):
        _job_for_plan(stray)


# -- CLI ---------------------------------------------------------------------------------------


def test_heterps_plan_prints_and_writes_the_plan(tmp_path, capsys, problem):
    out = tmp_path / "plan.json"
    assert main(["plan", "--problem", str(CTR), "--scheduler", "greedy", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "plan by greedy" in printed and "total cost" in printed
    plan = load_plan(out, problem)
    assert plan.scheduler == "greedy" and plan.feasible


def test_heterps_plan_single_type(capsys):
    assert main(["plan", "--problem", str(CTR), "--scheduler", "single:v100"]) == 0
    assert "single:v100" in capsys.readouterr().out


def test_heterps_plan_bad_problem_exits_2(tmp_path, capsys):
    data = yaml.safe_load(CTR.read_text())
    data["layers"][2]["time_ms"]["tpu"] = {"fixed": 1, "per_sample": 0}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", "--problem", str(path)]) == 2
    err = capsys.readouterr().err
    assert "layers.2.time_ms.tpu" in err and str(path) in err


def test_heterps_plan_unknown_scheduler_exits_2(capsys):
    assert main(["plan", "--problem", str(CTR), "--scheduler", "annealing"]) == 2
    assert "scheduler" in capsys.readouterr().err


def test_heterps_plan_unreachable_floor_exits_3_with_the_highest_throughput(tmp_path, capsys):
    data = yaml.safe_load(CTR.read_text())
    data["throughput_min"] = 5.0e6
    path = tmp_path / "too_fast.yaml"
    path.write_text(yaml.safe_dump(data))
    best = get_scheduler("exact").schedule(load_problem(path)).best_throughput
    assert main(["plan", "--problem", str(path), "--scheduler", "greedy"]) == 3
    err = capsys.readouterr().err
    assert "no plan meets the floor" in err and f"{best:,.0f} samples/s" in err and str(path) in err


def test_heterps_plan_rl_refuses_an_unreachable_floor_from_the_bound_with_exit_3(tmp_path, capsys):
    problem = with_runtime_section(
        generate_problem(4, num_layers=(40, 60), num_types=(5, 6), catalogue="wide", infeasible_share=1.0)
    )
    path = problem.save(tmp_path / "unreachable.yaml")
    assert main(["plan", "--problem", str(path), "--scheduler", "rl"]) == 3
    err = capsys.readouterr().err
    assert str(path) in err and "no plan meets the floor" in err and "(an upper bound)" in err
    assert f"{problem.throughput_min:,.0f} samples/s" in err


def test_heterps_plan_exact_past_its_time_limit_prints_its_best_plan_marked_not_proven(tmp_path, capfd):
    """--budget-s is exact's time limit: past it, the best plan found, said to be not proven. stdout holds
    the plan and that line only (capfd: what HiGHS prints with C printf, past Python, would show)."""
    problem = with_runtime_section(
        generate_problem(5, num_layers=(20, 60), num_types=(3, 6), catalogue="wide", infeasible_share=0.0)
    )
    path = problem.save(tmp_path / "large.yaml")
    out_file = tmp_path / "plan.json"
    args = ["plan", "--problem", str(path), "--scheduler", "exact", "--output", str(out_file)]
    assert main([*args, "--budget-s", "0.01"]) == 0
    printed = capfd.readouterr().out
    plan = load_plan(out_file, problem)
    assert plan.feasible and plan.extra["proof"]["proven"] is False
    assert printed == (
        f"{plan.table()}\nnot proven optimal: exact stopped (time limit, --budget-s 0.01) before its proof; "
        f"this is the best plan it found\nplan written to {out_file}\n"
    )
    assert main(args) == 0  # no limit: proven, and no dearer than the plan found in time
    printed = capfd.readouterr().out
    proven = load_plan(out_file, problem)
    assert proven.extra["proof"]["proven"] and proven.cost <= plan.cost * (1 + 1e-12)
    assert printed == f"{proven.table()}\nplan written to {out_file}\n"


def test_python_dash_m_heterps_ray_runs_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "heterps_ray", "plan", "--problem", str(CTR), "--scheduler", "single:t4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "plan by single:t4" in result.stdout


def test_heterps_compare_lists_each_scheduler_with_its_ratio(tmp_path, capsys):
    out = tmp_path / "compare.json"
    names = "greedy,random,single:cpu,single:t4"
    assert main(["compare", "--problem", str(CTR), "--schedulers", names, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    for header in ("cost ($)", "ratio to exact", "throughput (samples/s)", "feasible", "seconds"):
        assert header in printed
    rows = json.loads(out.read_text())
    assert [r["scheduler"] for r in rows] == ["exact", "greedy", "random", "single:cpu", "single:t4"]
    assert rows[0]["ratio_to_exact"] == pytest.approx(1.0)
    assert all(r["ratio_to_exact"] >= 1 - 1e-9 for r in rows if r["feasible"])
    assert rows[3]["ratio_to_exact"] > 1.5  # CPU only is far dearer for CTR-DNN here
    # no runtime section: the base model only, as DESIGN.md §3 prices it
    assert all("base_cost" not in r and "scheduled_with" not in r for r in rows)
    assert "base cost" not in printed and "cheapest under the true model" not in printed


@pytest.mark.parametrize("floor", [200_000, 300_000])
def test_heterps_compare_prices_each_plan_under_the_true_and_the_base_model(floor, tmp_path, capsys):
    from heterps_ray.costmodel import CostModel
    from heterps_ray.scheduling import base_model

    path, out = cloud_problem_with_runtime_terms(tmp_path, floor), tmp_path / "compare.json"
    names = "greedy,random,single:cpu"
    assert main(["compare", "--problem", str(path), "--schedulers", names, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    for header in ("scheduled with", "cost ($)", "base cost ($)", "base throughput", "bound"):
        assert header in printed
    rows = json.loads(out.read_text())
    assert [r["scheduler"] for r in rows] == ["exact", "base:exact", "greedy", "random", "single:cpu"]
    assert [r["scheduled_with"] for r in rows] == [
        "base" if r["scheduler"] == "base:exact" else "true" for r in rows
    ]

    problem = load_problem(path)
    true_model, base = CostModel(problem), CostModel(base_model(problem))
    for r in rows:  # every number is the cost model's, under each model
        t = true_model.evaluate(r["assignment"], r["replicas"], r["ps_shards"])
        b = base.evaluate(r["assignment"], r["replicas"], r["ps_shards"])
        assert (r["cost"], r["throughput"], r["feasible"]) == (
            pytest.approx(t.cost),
            pytest.approx(t.throughput),
            t.feasible,
        )
        assert (r["base_cost"], r["base_throughput"], r["base_feasible"]) == (
            pytest.approx(b.cost),
            pytest.approx(b.throughput),
            b.feasible,
        )
        assert r["bound"] == t.bound
    exact, base_optimum = rows[0], rows[1]
    optimum = get_scheduler("exact").schedule(base_model(problem))  # exact on the base model, directly
    assert (base_optimum["assignment"], base_optimum["replicas"]) == (
        list(optimum.assignment),
        optimum.replicas,
    )
    assert base_optimum["base_cost"] == pytest.approx(optimum.cost) and base_optimum["base_feasible"]
    assert base_optimum["base_cost"] <= min(r["base_cost"] for r in rows if r["base_feasible"]) * (1 + 1e-9)
    # exact is exact for the true model: no plan that meets the floor there is cheaper, the base optimum included
    assert exact["feasible"]
    assert all(r["cost"] >= exact["cost"] * (1 - 1e-9) for r in rows if r["feasible"])
    winners = [r["scheduler"] for r in rows if r["feasible"] and r["cost"] <= exact["cost"] * (1 + 1e-9)]
    assert f"cheapest under the true model: {', '.join(winners)} ({exact['cost']:,.4f} $)" in printed
    # here the runtime terms move the optimum: the base model's plan is dearer, or misses the floor
    if base_optimum["feasible"]:
        assert base_optimum["ratio_to_exact"] > 1.1 and "x the true optimum" in printed
    else:
        assert base_optimum["throughput"] < floor and "misses the floor" in printed
    assert base_optimum["feasible"] == (floor == 200_000)


def test_heterps_plan_rl_plans_a_cluster_of_nine_types(tmp_path, capsys):
    problem = generate_problem(
        8, num_layers=(40, 40), num_types=(9, 9), catalogue="wide", infeasible_share=0.0
    )
    path = tmp_path / "nine.yaml"
    path.write_text(yaml.safe_dump(problem.to_dict()))
    greedy = get_scheduler("greedy").schedule(load_problem(path))
    assert greedy.feasible  # a plan meets the floor, so rl must find one (exact's optimum: 42.37 $)
    out_file = tmp_path / "plan.json"
    code = main(["plan", "--problem", str(path), "--output", str(out_file)])  # the default: rl, zero-shot
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "plan by rl" in out.out and "Traceback" not in out.err
    plan = load_plan(out_file, load_problem(path))
    assert plan.scheduler == "rl" and plan.feasible and plan.throughput >= problem.throughput_min
    for t in problem.types_running_all_layers():  # never worse than a single type's plan that meets it
        single = provision(problem, [t] * problem.num_layers)
        assert not single.feasible or plan.cost <= single.cost * (1 + 1e-12)


@pytest.mark.parametrize("flag", ["--budget-s", "--finetune-s"])
def test_heterps_plan_bad_time_budget_exits_2_naming_the_field(flag, capsys):
    assert main(["plan", "--problem", str(CTR), "--scheduler", "rl", flag, "-5"]) == 2
    assert flag.removeprefix("--").replace("-", "_") in capsys.readouterr().err
