"""Tune experiments over schedulers (real Tune trials on the session's local Ray) and the frontier."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

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

BUDGET = "600"  # seconds: far above what these tiny problems need, so no run is cut short by time


def test_scheduler_comparison_rows_match_direct_schedule_calls(ray_local, tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["tune", "schedulers", "--generate", "2", "--seed", "3", "--floors", "0.3,0.8"]
    args += ["--schedulers", "single,greedy", "--budget-s", BUDGET, "-o", str(out)]
    assert main(args) == 0
    assert "mean cost / exact optimum's cost" in capsys.readouterr().out
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
