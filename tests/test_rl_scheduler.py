"""RLScheduler: PPO trained on a small problem inside the session's Ray; plans, masks, seeds, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from heterps_ray.costmodel import CostModel, check_plan
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.exact import brute_force
from heterps_ray.scheduling.generator import generate_problem
from heterps_ray.scheduling.rl import ProblemView, RLConfig, RLScheduler, SchedulingEnv, greedy_rollout
from heterps_ray.scheduling.rl.policy import load_policy, save_policy
from heterps_ray.scheduling.rl.polish import hill_climb, neighbours

# Small and quick: 3 PPO iterations of 256 layer decisions each.
_CONFIG = RLConfig(train_batch_size=256, minibatch_size=64, num_epochs=4, polish=False)
_ITERATIONS = 3


@pytest.fixture(scope="module")
def problem():
    # 5 layers, 3 types, one layer a GPU kind cannot run; the optimum is heterogeneous (cpu, h100, t4 x3)
    return generate_problem(3, num_layers=(5, 5), num_types=(3, 3))


@pytest.fixture(scope="module")
def trained(ray_local, problem, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("rl") / "checkpoint"
    scheduler = RLScheduler(seed=0, config=_CONFIG, iterations=_ITERATIONS, checkpoint_dir=checkpoint)
    return scheduler, scheduler.schedule(problem), checkpoint


def test_plan_is_valid_and_priced_by_the_cost_model(trained, problem):
    scheduler, plan, _ = trained
    check_plan(plan, problem)  # one runnable type per layer, stages = maximal runs
    evaluation = CostModel(problem).evaluate(list(plan.assignment), plan.replicas, plan.ps_shards)
    assert plan.feasible and evaluation.feasible
    assert math.isclose(plan.cost, evaluation.cost, rel_tol=1e-12)
    assert math.isclose(plan.throughput, evaluation.throughput, rel_tol=1e-12)
    assert plan.scheduler == "rl"
    assert plan.extra["iterations"] == _ITERATIONS and plan.extra["episodes"] > 0
    assert len(scheduler.history) == _ITERATIONS


def test_plan_is_within_ten_percent_of_exact_after_three_iterations(trained, problem):
    _, plan, _ = trained
    exact = brute_force(problem)
    assert exact.feasible
    assert plan.cost <= 1.10 * exact.cost  # polishing is off: this is PPO's own search
    # the policy's own plans (not the env's reference heuristics) are what got there
    assert plan.extra["source"] in ("greedy", "sampled")


def test_trained_policy_gives_masked_types_zero_probability(trained):
    import torch
    from ray.rllib.core.columns import Columns

    _, _, checkpoint = trained
    module = RLScheduler.from_checkpoint(checkpoint)._module
    # unseen problems of other sizes: the feature observation lets the same policy plan them
    for seed, layers, types in ((7, 12, 4), (13, 30, 5), (2, 3, 2)):
        problem = generate_problem(seed, num_layers=(layers, layers), num_types=(types, types))
        env = SchedulingEnv({"problem": problem})
        obs, _ = env.reset(seed=0)
        done = False
        while not done:
            batch = {Columns.OBS: {k: torch.as_tensor(v)[None] for k, v in obs.items()}}
            with torch.no_grad():
                logits = module.forward_exploration(batch)[Columns.ACTION_DIST_INPUTS][0]
            probabilities = torch.softmax(logits, dim=-1).numpy()
            assert probabilities[obs["action_mask"] < 0.5].sum() == 0.0
            action = int(
                np.random.default_rng(len(env.assignment)).choice(len(probabilities), p=probabilities)
            )
            obs, _, done, _, _ = env.step(action)  # the env raises on a masked action
        result = greedy_rollout(module, ProblemView(problem))
        assert all(CostModel(problem).runnable[layer, t] for layer, t in enumerate(result.assignment))


def test_same_seed_and_iterations_give_the_same_plan(trained, problem):
    first, plan, _ = trained
    second = RLScheduler(seed=0, config=_CONFIG, iterations=_ITERATIONS)
    again = second.schedule(problem)
    assert again.assignment == plan.assignment and again.replicas == plan.replicas
    assert again.extra["greedy_cost"] == plan.extra["greedy_cost"]
    assert [h["episode_return_mean"] for h in second.history] == [
        h["episode_return_mean"] for h in first.history
    ]


def test_checkpoint_round_trip_gives_the_same_plan_without_training(trained, problem):
    _, plan, checkpoint = trained
    restored = RLScheduler.from_checkpoint(checkpoint)
    assert restored.config == _CONFIG and restored.seed == 0
    replanned = restored.schedule(problem)
    assert replanned.extra["trained"] is False
    assert replanned.assignment == plan.assignment and replanned.replicas == plan.replicas
    assert replanned.ps_shards == plan.ps_shards and replanned.cost == plan.cost
    # the restored policy's own greedy choice is the trained policy's
    assert replanned.extra["greedy_cost"] == plan.extra["greedy_cost"]


def test_registered_as_rl_in_the_scheduler_registry():
    scheduler = get_scheduler("rl", seed=3, budget_s=5)
    assert isinstance(scheduler, RLScheduler)
    assert scheduler.seed == 3 and scheduler.budget_s == 5


def test_infeasible_problem_gives_an_infeasible_plan_with_the_highest_throughput(ray_local):
    problem = generate_problem(1, num_layers=(5, 5), num_types=(3, 3))
    exact = brute_force(problem)
    assert not exact.feasible
    plan = RLScheduler(seed=0, config=_CONFIG, iterations=1).schedule(problem)
    assert not plan.feasible
    assert plan.best_throughput == pytest.approx(exact.best_throughput, rel=1e-9)
    assert plan.throughput <= plan.best_throughput * (1 + 1e-9)


def test_polish_ends_at_a_local_optimum_no_worse_than_its_start():
    problem = generate_problem(7, num_layers=(10, 10), num_types=(4, 4))
    view = ProblemView(problem)
    start = view.record(view.reference_assignments["fastest_per_layer"])
    result = hill_climb(view, start, deadline=math.inf)
    assert result.feasible >= start.feasible
    if start.feasible:
        assert result.provisioned.cost <= start.provisioned.cost
    for assignment in neighbours(view, result.assignment):
        other = view.record(assignment)
        assert not (
            other.feasible and (not result.feasible or other.provisioned.cost < result.provisioned.cost)
        )


def test_saved_policy_plans_zero_shot_and_fine_tunes_from_its_weights(trained, problem, tmp_path):
    import torch

    scheduler, plan, _ = trained
    save_policy(scheduler.module, tmp_path, {"hidden": _CONFIG.hidden})
    loaded = load_policy(tmp_path)  # plain torch, no Ray
    for name, tensor in scheduler.module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)

    zero_shot = RLScheduler(policy=tmp_path, config=_CONFIG)
    assert zero_shot.mode == "zero-shot"
    replanned = zero_shot.schedule(problem)
    assert (
        replanned.extra["mode"] == "zero-shot" and replanned.extra["greedy_cost"] == plan.extra["greedy_cost"]
    )

    # fine-tuning starts from the saved weights (learner and env runner): with a vanishing step
    # size, one PPO iteration leaves them where they were
    still = dataclasses.replace(_CONFIG, lr=1e-12)
    finetune = RLScheduler(policy=tmp_path, config=still, iterations=1)
    assert finetune.mode == "finetune"
    tuned = finetune.schedule(problem)
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(finetune.module.state_dict()[name], tensor, atol=1e-6, rtol=0)
    # the zero-shot plan (polished) is one of fine-tuning's candidates: it never ends worse
    assert replanned.feasible and tuned.feasible and tuned.cost <= replanned.cost * (1 + 1e-9)


def test_fine_tuning_a_policy_of_another_width_trains_a_network_of_its_width(ray_local, problem, tmp_path):
    import torch

    from heterps_ray.scheduling.rl.network import PolicyNetwork

    # a tuned policy may be wider than the scheduler's config (hidden 128 against 64)
    observation = SchedulingEnv.spaces()[0]
    torch.manual_seed(1)
    wide = PolicyNetwork(observation["type_features"].shape[1], observation["context"].shape[0], hidden=96)
    save_policy(wide, tmp_path, {"hidden": 96})
    still = dataclasses.replace(_CONFIG, lr=1e-12)
    assert still.hidden == 64
    finetune = RLScheduler(policy=tmp_path, config=still, iterations=1)
    plan = finetune.schedule(problem)
    assert plan.extra["mode"] == "finetune"
    for name, tensor in wide.state_dict().items():
        torch.testing.assert_close(finetune.module.state_dict()[name], tensor, atol=1e-6, rtol=0)


def test_train_policy_script_writes_a_policy_the_scheduler_loads(ray_local, tmp_path):
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_policy.py"
    spec = importlib.util.spec_from_file_location("train_policy", script)
    assert spec is not None and spec.loader is not None
    train_policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_policy)
    small = ["--set", "train_batch_size=128", "--set", "minibatch_size=64", "--set", "num_epochs=1"]
    assert (
        train_policy.main(
            ["--iterations", "1", "--pool", "4", "--layers", "3,6", "--out", str(tmp_path)] + small
        )
        == 0
    )
    meta = json.loads((tmp_path / "policy.json").read_text())
    assert meta["iterations"] == 1 and len(meta["curve"]) == 1 and meta["config"]["train_batch_size"] == 128
    plan = RLScheduler(policy=tmp_path).schedule(generate_problem(4, num_layers=(6, 6), num_types=(3, 3)))
    assert plan.extra["mode"] == "zero-shot"


def test_shipped_pretrained_policy_is_the_default_and_beats_an_untrained_one():
    import torch

    from heterps_ray.scheduling.rl.module import TypeScoringModule
    from heterps_ray.scheduling.rl.policy import policy_metadata

    assert RLScheduler().mode == "zero-shot"  # no budget: the shipped policy, no training
    meta = policy_metadata()
    assert meta["iterations"] > 0 or meta["imitation"]["rounds"]  # trained by PPO, or taught by exact
    shipped = load_policy()
    torch.manual_seed(0)
    observation_space, action_space = SchedulingEnv.spaces()
    untrained = TypeScoringModule(
        observation_space=observation_space, action_space=action_space, model_config={}
    )
    shipped_rewards, untrained_rewards = [], []
    for seed in range(500, 512):  # unseen: the policy trained on problems drawn from seed 1_000_000
        problem = generate_problem(seed, num_layers=(3, 16), num_types=(2, 5))
        shipped_rewards.append(greedy_rollout(shipped, ProblemView(problem)).reward)
        untrained_rewards.append(greedy_rollout(untrained, ProblemView(problem)).reward)
    # reward = log(reference cost / cost): the shipped policy's greedy plans are far cheaper on average
    assert np.mean(shipped_rewards) > np.mean(untrained_rewards) + 1.0
    plan = RLScheduler().schedule(generate_problem(500, num_layers=(3, 16), num_types=(2, 5)))
    check_plan(plan, generate_problem(500, num_layers=(3, 16), num_types=(2, 5)))
    assert plan.extra["mode"] == "zero-shot" and plan.scheduler == "rl"
