"""Pretraining across problems, scoring a policy on held-out problems, and Tune picking its settings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.generator import generate_problem
from heterps_ray.scheduling.rl import ProblemView, RLConfig
from heterps_ray.scheduling.rl.policy import load_policy
from heterps_ray.scheduling.rl.pretrain import (
    HELD_OUT_SHAPES,
    MISSED_RATIO,
    held_out_problems,
    policy_only_score,
    pretrain,
    training_pool,
    validation_problems,
)
from heterps_ray.scheduling.rl.rollouts import policy_rollouts
from heterps_ray.scheduling.rl.scheduler import problem_fingerprint

SMALL = {"layers": (3, 6), "types": (2, 3)}


def _exact_costs(problems):
    plans = {p.name: get_scheduler("exact").schedule(p) for p in problems}
    return {name: float(plan.cost) if plan.feasible else None for name, plan in plans.items()}


def test_training_pool_validation_set_and_benchmark_problems_never_overlap():
    pool = {problem_fingerprint(p) for p in training_pool(15, seed=0)}
    validation = {problem_fingerprint(p) for p in validation_problems(15)}
    benchmark = {
        problem_fingerprint(generate_problem(s, num_layers=(3, 30), num_types=(2, 5)))
        for s in range(50)  # the benchmark set
    }
    assert len(pool) == len(validation) == 15 and len(benchmark) == 50
    assert not (pool & validation) and not (pool & benchmark) and not (validation & benchmark)
    # the same seed gives the same pool (the retrain command reproduces its problems)
    assert [problem_fingerprint(p) for p in training_pool(3, seed=0)] == [
        problem_fingerprint(p) for p in training_pool(15, seed=0)[:3]
    ]
    # the pool's GPU-cloud problems are never the GPU-cloud suite's (seeds 0-23, BENCHMARKS.md)
    clouds = training_pool(0, seed=0, wide_layers=(20, 40), gpu_cloud=3)
    suite = {
        problem_fingerprint(generate_problem(s, num_layers=(20, 40), num_types=(3, 8), catalogue="gpu_cloud"))
        for s in range(24)
    }
    assert len(clouds) == 3 and all(p.runtime is not None for p in clouds)
    assert not {problem_fingerprint(p) for p in clouds} & suite


def test_the_held_out_set_is_apart_from_the_training_pools_and_the_suites():
    held = held_out_problems()
    assert len({seed for seed, _ in held}) == len(held) == 3 * len(HELD_OUT_SHAPES)
    shapes = {(p.num_layers, p.num_types, p.runtime is not None) for _, p in held}
    assert shapes == {(60, 3, False), (100, 7, False), (60, 3, True), (110, 8, True)}  # GPU clouds: runtime
    apart = {problem_fingerprint(p) for _, p in held}
    pool = training_pool(5, seed=0, wide=5, gpu_cloud=5)
    suites = [
        generate_problem(s, num_layers=(20, 120), num_types=(3, 8), catalogue=c)
        for c, n in (("wide", 40), ("gpu_cloud", 24))
        for s in range(n)
    ]
    assert not apart & {problem_fingerprint(p) for p in pool + suites}


def test_policy_only_score_is_the_best_rollout_over_the_exact_optimum():
    problems = validation_problems(8, **SMALL)
    exact = _exact_costs(problems)
    exact[problems[0].name] = None  # as if no feasible plan existed: the problem is left out
    policy = load_policy()
    score = policy_only_score(policy, problems, exact, rollouts=8, seed=3)
    # recompute by hand: cheapest feasible of the greedy plan and 8 samples, over the exact optimum
    expected = []
    for problem in problems:
        if exact[problem.name] is None:
            continue  # no feasible plan exists: nothing to score
        results = policy_rollouts(policy, ProblemView(problem), 8, 3)
        costs = [r.provisioned.cost for r in results if r.feasible]
        expected.append(min(costs) / exact[problem.name] if costs else MISSED_RATIO)
    assert score["problems"] == len(expected)
    assert score["mean_ratio"] == pytest.approx(np.mean(expected), rel=1e-12)
    assert score["median_ratio"] == pytest.approx(np.median(expected), rel=1e-12)
    assert min(expected) >= 1.0 - 1e-9  # no plan beats the exact optimum
    assert score["greedy_median_ratio"] >= score["median_ratio"] - 1e-12  # samples only add candidates


def test_untrained_policy_scores_worse_than_the_shipped_one():
    import torch

    from heterps_ray.scheduling.rl import SchedulingEnv
    from heterps_ray.scheduling.rl.module import TypeScoringModule

    problems = validation_problems(12, layers=(3, 12), types=(2, 5))
    exact = _exact_costs(problems)
    torch.manual_seed(0)
    observation_space, action_space = SchedulingEnv.spaces()
    untrained = TypeScoringModule(
        observation_space=observation_space, action_space=action_space, model_config={}
    )
    shipped = policy_only_score(load_policy(), problems, exact, rollouts=0)
    random_init = policy_only_score(untrained, problems, exact, rollouts=0)
    assert shipped["mean_ratio"] < random_init["mean_ratio"]


def test_pretrain_runs_the_iterations_asked_and_reports_a_curve(ray_local):
    calls = []
    config = RLConfig(train_batch_size=64, minibatch_size=32, num_epochs=1, num_envs=2)
    module, curve = pretrain(
        config,
        training_pool(4, seed=5, **SMALL),
        seed=5,
        iterations=2,
        on_iteration=lambda i, m, point: calls.append((i, point["env_steps"])),
        between_iterations=lambda: calls.append("wait"),
    )
    assert calls == ["wait", (1, curve[0]["env_steps"]), "wait", (2, curve[1]["env_steps"])]
    assert [p["iteration"] for p in curve] == [1, 2]
    assert 64 <= curve[0]["env_steps"] < curve[1]["env_steps"]
    assert all(math.isfinite(p["episode_return_mean"]) for p in curve)
    assert module.state_dict()  # a trained RLModule the scorer can roll out
    with pytest.raises(ValueError, match="iterations or minutes"):
        pretrain(config, training_pool(2, **SMALL))


def test_asha_tune_stops_trials_behind_and_ships_the_best_full_length_trial(ray_local, tmp_path):
    import torch
    from ray import tune

    from heterps_ray.experiments.policy_search import (
        POLICY_METRICS,
        asha_milestones,
        ship_policy,
        tune_policy,
    )
    from heterps_ray.scheduling.rl.policy import policy_metadata

    space = {
        "lr": tune.loguniform(1e-4, 3e-3),
        "lr_end": tune.choice([1.0, 0.1]),
        "train_batch_size": tune.choice([128]),  # half the base's PPO iterations: likely behind it
        "minibatch_size": tune.choice([64]),
        "num_epochs": tune.choice([1]),
    }
    search = tune_policy(
        num_samples=3,
        max_env_steps=512,
        report_every=128,
        grace_env_steps=256,
        reduction_factor=2,
        max_concurrent=1,  # one at a time: ASHA sees the trials in a fixed order
        pool_size=4,
        validation=5,
        seed=2,
        search_space=space,
        # scored by the greedy plan alone (rollouts=0): on such small problems 32 samples all find the optimum
        base=RLConfig(train_batch_size=64, minibatch_size=32, num_epochs=2, lr=2e-3, num_envs=2, rollouts=0),
        storage_path=tmp_path / "tune",
        **SMALL,
    )
    table = search.table
    assert asha_milestones(512, 256, 2) == [256, 512] == search.settings["milestones"]
    assert len(table) == 3 and set(POLICY_METRICS) <= set(table.columns)
    current = table[table["current"]]
    assert len(current) == 1 and current["lr"].iloc[0] == 2e-3  # the base config is one trial
    exact = _exact_costs(validation_problems(5, **SMALL))
    assert (table["problems"] == sum(c is not None for c in exact.values())).all()
    assert (table["mean_ratio"] >= 1.0 - 1e-9).all() and np.isfinite(table["mean_ratio"]).all()
    for trial in search.trials:
        steps = [h["env_steps"] for h in trial["history"]]
        assert steps == sorted(steps) and steps[0] >= 128  # validated every 128 env steps, in order
        if trial["full_length"]:
            assert steps[-1] >= 512 and len(steps) == 4
        else:  # ASHA stopped it at its first rung: it got there and went no further
            assert 256 <= steps[-1] < 512 and math.isnan(
                table.set_index("trial").loc[trial["trial"], "mean_ratio@512"]
            )
    # ASHA stopped at least one trial (deterministic: seeded, one at a time)
    assert not table["full_length"].all()
    # the winner is the best trial among those that ran the full length, a stopped trial cannot win
    full = table[table["full_length"]]
    assert table["full_length"].iloc[0] and table["mean_ratio"].iloc[0] == full["mean_ratio"].min()
    assert search.best_config == {k: table[k].iloc[0] for k in space}

    shipped = ship_policy(search, tmp_path / "shipped", "python scripts/train_policy.py --tune (test)")
    meta = policy_metadata(shipped)
    assert meta["command"] == "python scripts/train_policy.py --tune (test)" and meta["seed"] == 2
    assert {k: meta["config"][k] for k in space} == search.best_config == meta["tune"]["picked"]
    assert meta["config"]["lr_decay_steps"] == 512  # a decaying lr ends where the full run ends
    assert meta["curve"][-1]["env_steps"] == meta["validation"][-1]["env_steps"] >= 512
    assert meta["validation"][-1]["mean_ratio"] == search.best_mean_ratio
    assert len(meta["tune"]["trials"]) == 3
    saved = torch.load(search.best_checkpoint / "policy.pt", weights_only=True)
    policy = load_policy(shipped)
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in saved.items())
    # the shipped policy plans an unseen problem zero-shot, without training
    problem = generate_problem(7, num_layers=(3, 6), num_types=(2, 3))
    plan = get_scheduler("rl", policy=shipped).schedule(problem)
    assert plan.feasible == (exact_plan := get_scheduler("exact").schedule(problem)).feasible
    assert plan.cost >= exact_plan.cost - 1e-9
