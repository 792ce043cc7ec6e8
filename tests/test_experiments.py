"""Tune experiments over schedulers (real Tune trials on the session's local Ray) and the frontier."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import cloud_problem_with_runtime_terms

from heterps_ray.cli import main
from heterps_ray.experiments import (
    frontier,
    generate_problems,
    make_cases,
    make_scheduler,
    sweep_scheduler,
    with_floor,
)
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.exact import max_reachable_throughput
from heterps_ray.scheduling.generator import generate_problem

REPO = Path(__file__).resolve().parents[1]
BUDGET = "600"  # seconds: far above what these tiny problems need, so no run is cut short by time


def test_scheduler_comparison_rows_match_direct_schedule_calls(ray_local, tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["tune", "schedulers", "--generate", "2", "--seed", "3", "--floors", "0.3,0.8"]
    args += ["--schedulers", "single,greedy", "--budget-s", BUDGET, "-o", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "mean cost / exact optimum's cost" in printed and "wins on the true model: exact 4 of 4" in printed
    assert "base wins" not in printed  # no runtime sections: one model
    table = pd.read_parquet(out / "schedulers.parquet")
    assert len(table) == 2 * 2 * 3  # exact always runs
    assert set(table["scheduler"]) == {"exact", "single", "greedy"}
    for name in ("cost_vs_floor.png", "ratio_to_exact.png"):
        assert (out / name).stat().st_size > 10_000

    cases = {(c.problem_name, c.floor): c for c in make_cases(generate_problems(2, seed=3), (0.3, 0.8))}
    for row in table.itertuples():
        case = cases[(row.problem, row.floor)]
        assert row.throughput_min == pytest.approx(case.problem.throughput_min)
        plan = make_scheduler(row.scheduler, seed=3, budget_s=float(BUDGET)).schedule(case.problem)
        assert row.feasible == plan.feasible
        assert row.assignment == " ".join(plan.assignment)
        assert row.replicas == " ".join(map(str, plan.replicas))
        assert row.throughput == pytest.approx(plan.throughput, rel=1e-12)
        if plan.feasible:
            assert row.cost == pytest.approx(plan.cost, rel=1e-12)
            exact = table[
                (table.problem == row.problem) & (table.floor == row.floor) & (table.scheduler == "exact")
            ]
            assert row.ratio == pytest.approx(row.cost / exact["cost"].iloc[0])
            assert row.ratio >= 1.0 - 1e-9  # nothing beats the optimum
        else:
            assert math.isinf(row.cost)
        # no runtime section: the base model is the problem's model
        assert (row.base_cost, row.base_throughput, row.base_feasible) == (
            row.cost,
            row.throughput,
            row.feasible,
        )
        assert row.scheduled_with == "true"


def test_scheduler_comparison_prices_each_plan_under_the_true_and_the_base_model(ray_local, tmp_path, capsys):
    from heterps_ray.costmodel import CostModel, load_problem
    from heterps_ray.scheduling import base_model

    path, out = cloud_problem_with_runtime_terms(tmp_path), tmp_path / "cmp"
    args = ["tune", "schedulers", "--problems", str(path), "--floors", "0.5,0.9"]
    args += ["--schedulers", "greedy,single", "--budget-s", BUDGET, "-o", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    table = pd.read_parquet(out / "schedulers.parquet")
    assert set(table["scheduler"]) == {"exact", "base:exact", "greedy", "single"}  # base:exact always runs
    assert len(table) == 2 * 4

    cases = {c.floor: c for c in make_cases([load_problem(path)], (0.5, 0.9))}
    for row in table.itertuples():
        problem = cases[row.floor].problem
        replicas = [int(k) for k in row.replicas.split()]
        t = CostModel(problem).evaluate(row.assignment.split(), replicas, row.ps_shards)
        b = CostModel(base_model(problem)).evaluate(row.assignment.split(), replicas, row.ps_shards)
        assert (row.throughput, row.feasible) == (pytest.approx(t.throughput, rel=1e-12), t.feasible)
        assert (row.base_throughput, row.base_feasible) == (
            pytest.approx(b.throughput, rel=1e-12),
            b.feasible,
        )
        assert row.cost == (pytest.approx(t.cost, rel=1e-12) if t.feasible else math.inf)
        assert row.base_cost == (pytest.approx(b.cost, rel=1e-12) if b.feasible else math.inf)
        assert row.scheduled_with == ("base" if row.scheduler == "base:exact" else "true")
        if row.scheduler == "base:exact":  # the base model's own exact optimum
            optimum = get_scheduler("exact").schedule(base_model(problem))
            assert row.assignment == " ".join(optimum.assignment)
            assert row.base_cost == pytest.approx(optimum.cost)
        assert row.ratio >= 1.0 - 1e-9 or not row.feasible
    base = table[table.scheduler == "base:exact"]
    assert (base["ratio"] > 1.1).all()  # here the runtime terms make the base optimum dearer or infeasible
    wins = table[table.feasible & (table.ratio <= 1 + 1e-9)].groupby("scheduler").size()
    expected = ", ".join(
        f"{name} {n} of 2" for name, n in wins.sort_values(ascending=False, kind="stable").items()
    )
    ok = table[table.base_feasible]
    base_wins = ok[ok.base_cost <= ok.groupby("floor").base_cost.transform("min") * (1 + 1e-9)]
    base_wins = base_wins.groupby("scheduler").size()
    assert base_wins.get("base:exact", 0) == 2  # on the base model its optimum wins every case
    summary = {x.split()[0]: x.split() for x in printed.splitlines() if x}
    for name, rows in table.groupby("scheduler"):  # every scheduler has its row, misses and wins counted
        assert int(summary[name][3]) == int(np.isinf(rows["ratio"]).sum())
        assert int(summary[name][4]) == int(wins.get(name, 0))
        assert int(summary[name][5]) == int(base_wins.get(name, 0))
    line = next(x for x in printed.splitlines() if x.startswith("wins on the true model"))
    assert line == "wins on the true model (the runtime terms, DESIGN.md §3b): " + expected


def test_genetic_sweep_scores_each_setting_by_its_cost_ratio(ray_local, tmp_path, capsys):
    out = tmp_path / "genetic"
    args = ["tune", "genetic", "--generate", "1", "--seed", "5", "--floors", "0.4,0.9"]
    args += ["--num-samples", "2", "--budget-s", BUDGET, "-o", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    table = pd.read_parquet(out / "sweep_genetic.parquet")
    best = json.loads((out / "best_genetic.json").read_text())
    assert len(table) == 2
    assert table["mean_ratio"].is_monotonic_increasing  # best first
    assert best["population"] == table["population"].iloc[0] and "best: population=" in printed
    assert set(table["population"]) <= {16, 32, 48, 96} and table["mutation_rate"].between(0.02, 0.5).all()

    # Recompute the best setting's score outside Tune: the same plans, the same mean ratio.
    cases = make_cases(generate_problems(1, seed=5), (0.4, 0.9))
    ratios = []
    for case in cases:
        optimum = get_scheduler("exact").schedule(case.problem)
        if not optimum.feasible:
            continue
        settings = {k: best[k] for k in ("population", "mutation_rate", "generations")}
        plan = make_scheduler("genetic", seed=5, budget_s=float(BUDGET), **settings).schedule(case.problem)
        ratios.append(plan.cost / optimum.cost if plan.feasible else 10.0)
    assert table["cases"].iloc[0] == len(ratios)
    assert best["mean_ratio"] == pytest.approx(np.mean(ratios))


@pytest.mark.slow
def test_rl_sweep_trains_one_policy_per_setting(ray_local, tmp_path):
    from ray import tune

    space = {
        "lr": tune.loguniform(1e-4, 3e-3),
        "train_batch_size": tune.choice([64]),
        "minibatch_size": tune.choice([32]),
    }
    result = sweep_scheduler(
        "rl",
        [generate_problem(11, num_layers=(3, 4), num_types=(2, 2))],
        search_space=space,
        num_samples=2,
        floors=(0.6,),
        fixed={"iterations": 1},
        seed=1,
        storage_path=tmp_path / "tune",
    )
    assert len(result.table) == 2
    assert result.table["lr"].nunique() == 2  # two different sampled settings
    assert (result.table["mean_ratio"] >= 1.0 - 1e-9).all() and np.isfinite(result.table["mean_ratio"]).all()
    assert result.best_config["lr"] == result.table["lr"].iloc[0]


def test_unknown_scheduler_or_bad_floors_exit_with_code_2(tmp_path, capsys):
    base = ["tune", "schedulers", "--generate", "1", "-o", str(tmp_path)]
    assert main([*base, "--schedulers", "greedy,simulated-annealing"]) == 2
    assert "simulated-annealing" in capsys.readouterr().err
    assert main([*base, "--floors", "0.2,lots"]) == 2
    assert "--floors" in capsys.readouterr().err
    assert main([*base, "--layers", "9"]) == 2
    assert "MIN,MAX" in capsys.readouterr().err
    assert main(["tune", "genetic", "--problems", str(tmp_path / "none*.yaml"), "-o", str(tmp_path)]) == 2


def test_frontier_steps_are_the_exact_optimum_at_every_floor():
    problem = generate_problem(4, num_layers=(4, 5), num_types=(3, 3))
    table = frontier(problem)
    theta_max = max_reachable_throughput(problem)
    feasible = table[table["exact_feasible"]]
    assert len(feasible) >= 2 and feasible["exact_cost"].is_monotonic_increasing
    assert (feasible["throughput_min"] <= theta_max * (1 + 1e-9)).all()
    assert not table[table["throughput_min"] > theta_max * (1 + 1e-6)]["exact_feasible"].any()
    assert (
        table["single_cost"] >= table["exact_cost"] * (1 - 1e-9)
    ).all()  # a single type is one kind of mix
    # between steps the cost holds: check a floor inside each step against a fresh exact solve
    floors = table["throughput_min"].to_numpy()
    for i in range(0, len(feasible) - 1, max(1, len(feasible) // 4)):
        inside = (floors[i] + floors[i + 1]) / 2
        plan = get_scheduler("exact").schedule(with_floor(problem, inside))
        assert plan.cost == pytest.approx(table["exact_cost"].iloc[i], rel=1e-9)
