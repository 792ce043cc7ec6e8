"""A policy taught by the solver: exact's plans as labels, behaviour cloning, DAgger, the retrain command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.generator import generate_problem, with_runtime_section
from heterps_ray.scheduling.rl import ProblemView, greedy_rollout
from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES
from heterps_ray.scheduling.rl.imitation import _completion_costs as completion_costs
from heterps_ray.scheduling.rl.imitation import _priced_label as priced_label
from heterps_ray.scheduling.rl.imitation import _rollout_costs as rollout_costs
from heterps_ray.scheduling.rl.imitation import _walked as walked
from heterps_ray.scheduling.rl.imitation import (
    clone,
    dagger_states,
    demonstrations,
    exact_assignment,
    exact_labels,
    priced_states,
)
from heterps_ray.scheduling.rl.network import PolicyNetwork
from heterps_ray.scheduling.rl.policy import PRETRAINED_DIR, load_planning_policy, load_policy
from heterps_ray.scheduling.rl.scheduler import problem_fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def _problems(count: int, seed: int = 40) -> list:
    return [
        generate_problem(seed + i, num_layers=(4, 8), num_types=(2, 3), infeasible_share=0.0)
        for i in range(count)
    ]


def test_exact_labels_replay_to_exact_cost_with_and_without_runtime_terms():
    problems = _problems(3)
    problems.append(with_runtime_section(problems[0]))
    labels = exact_labels(problems)
    assert len(labels) == 4  # the runtime section makes another problem (another fingerprint)
    for problem in problems:
        assignment = labels[problem_fingerprint(problem)]
        plan = get_scheduler("exact").schedule(problem)
        assert assignment == [problem.type_index(t) for t in plan.assignment]
        # the env's provisioning of exact's assignment is exact's plan: the episode reproduces the optimum
        assert ProblemView(problem).provision(assignment).cost == pytest.approx(plan.cost, rel=1e-9)
    states = demonstrations(problems, labels)
    assert len(states) == sum(p.num_layers for p in problems)
    # every label is an action the env allowed in that state
    assert all(states.observations["action_mask"][i, a] == 1.0 for i, a in enumerate(states.actions))


def test_a_search_past_its_limit_gives_no_label():
    problem = generate_problem(
        3, num_layers=(60, 60), num_types=(6, 6), catalogue="wide", infeasible_share=0.0
    )
    assert exact_assignment(problem, time_limit_s=1e-4) is None


def test_cloning_exact_teaches_an_untrained_policy_its_plans():
    import torch

    problems = _problems(6)
    labels = exact_labels(problems)
    torch.manual_seed(0)
    module = PolicyNetwork(len(TYPE_FEATURES), len(CONTEXT_FEATURES), 32, 16)

    def ratios() -> list[float]:
        out = []
        for problem in problems:
            view = ProblemView(problem)
            optimum = view.provision(labels[problem_fingerprint(problem)]).cost
            result = greedy_rollout(module, view)
            out.append(result.cost / optimum)
        return out

    before = ratios()
    states = demonstrations(problems, labels)
    fit = clone(module, states, epochs=60, lr=3e-3)
    after = ratios()
    assert fit["accuracy"] > 0.85
    # the greedy plan is exact's (or as cheap) on most problems it was shown, and never worse overall
    assert sum(r <= 1.0 + 1e-9 for r in after) >= 4 and np.median(after) <= np.median(before)
    value_before = module.value[0].weight.detach().clone()
    # DAgger: only states where the policy leaves exact's plan, each labelled with exact's type
    more = dagger_states(module, problems, labels, samples=3, seed=1)
    assert all(more.observations["action_mask"][i, a] == 1.0 for i, a in enumerate(more.actions))
    clone(module, states + more, epochs=2)
    assert bool((module.value[0].weight == value_before).all())  # only the scoring layers learn


def _with_exact(problems: list) -> tuple[dict, list]:
    """exact's labels of `problems`, and each problem with its view and exact's assignment."""
    labels = exact_labels(problems)
    return labels, [(p, ProblemView(p), labels[problem_fingerprint(p)]) for p in problems]


def test_priced_labels_pick_the_cheapest_feasible_completion_from_where_the_policy_stands():
    problems = _problems(4, seed=60)
    labels, solved = _with_exact(problems)
    checked = 0
    for _, view, expert in solved:
        optimum = view.provision(expert).cost
        runnable = [np.flatnonzero(view.mask[layer] > 0.5) for layer in range(view.num_layers)]
        # on exact's own path the label completes to exact's cost: the optimum
        for layer in range(view.num_layers):
            label = priced_label(
                completion_costs(view, expert[:layer], [expert[layer + 1 :]]), -1, expert[layer]
            )
            assert view.provision([*expert[:layer], label, *expert[layer + 1 :]]).cost == pytest.approx(
                optimum
            )
        # off it (the prefix of the cheapest-per-layer plan): the label's completion is the cheapest
        # feasible one of all types, or no label when none is feasible
        off = view.reference_assignments["cheapest_per_layer"]
        for layer in range(1, view.num_layers):
            costs = completion_costs(view, off[:layer], [expert[layer + 1 :]])
            done = {
                int(t): view.provision([*off[:layer], int(t), *expert[layer + 1 :]]) for t in runnable[layer]
            }
            feasible = {t: p.cost for t, p in done.items() if p.feasible}
            if not feasible:
                assert not costs
                continue
            checked += 1
            label = priced_label(costs, -1, expert[layer])
            assert done[label].feasible and done[label].cost == pytest.approx(min(feasible.values()))
    assert checked > 0
    module = PolicyNetwork(len(TYPE_FEATURES), len(CONTEXT_FEATURES), 32, 16)
    states = priced_states(module, problems, labels, samples=2, seed=1)
    assert 0 < len(states) <= 3 * sum(p.num_layers for p in problems)
    assert all(states.observations["action_mask"][i, a] == 1.0 for i, a in enumerate(states.actions))


def test_rollouts_price_each_type_by_the_policys_own_greedy_completion():
    module = load_policy(PRETRAINED_DIR)
    checked = 0
    for problem in _problems(4, seed=60):
        view = ProblemView(problem)
        greedy = greedy_rollout(module, view)
        plan = list(greedy.assignment)
        for layer in (0, view.num_layers // 2, view.num_layers - 1):
            costs = rollout_costs(module, view, problem.num_types, plan[:layer])
            assert set(costs) <= set(np.flatnonzero(view.mask[layer] > 0.5).tolist())
            if greedy.feasible:  # the policy's own type at the layer completes to its greedy plan
                assert costs[plan[layer]] == pytest.approx(greedy.cost)
                checked += 1
    assert checked > 0
    labels = exact_labels(_problems(2, seed=60))
    plain = priced_states(module, _problems(2, seed=60), labels, samples=1, seed=1)
    rolled = priced_states(module, _problems(2, seed=60), labels, samples=1, seed=1, rollouts=3)
    assert len(rolled) >= len(plain)  # a rollout can only add completions (and labels)


def test_the_level_walk_completes_a_held_prefix_to_a_plan_that_meets_the_floor():
    completed = 0
    for problem, view, expert in _with_exact(_problems(6, seed=60))[1]:
        whole = walked(problem, [], 3)  # no prefix: a plan of exact's walk, never below the optimum
        assert whole is not None and view.provision(whole).cost >= view.provision(expert).cost * (1 - 1e-9)
        off = view.reference_assignments["cheapest_per_layer"]
        for layer in range(1, view.num_layers):
            plan = walked(problem, off[:layer], 3)  # the prefix held, the rest by the walk
            if plan is not None:
                assert plan[:layer] == list(off[:layer]) and view.provision(plan).feasible
                completed += 1
    assert completed > 0


def test_train_policy_imitate_writes_a_policy_that_plans(tmp_path):
    import train_policy

    labels, out = tmp_path / "labels.json", tmp_path / "policy"
    argv = [
        "--imitate", "--pool", "6", "--layers", "4,8", "--types", "2,3", "--runtime-share", "0.5",
        "--labels", str(labels), "--epochs", "2", "--dagger", "1", "--priced", "1", "--priced-walk-steps", "2", "--out", str(out),
    ]  # fmt: skip
    assert train_policy.main(argv) == 0
    cached = json.loads(labels.read_text())
    assert len(cached) == 6
    meta = json.loads((out / "policy.json").read_text())
    assert meta["imitation"]["labelled"] == 6 and [r["round"] for r in meta["imitation"]["rounds"]] == [
        "behaviour cloning",
        "dagger 1",
        "priced 1",
    ]
    assert meta["command"].startswith("python scripts/train_policy.py --imitate")
    policy = load_planning_policy(out)  # numpy twin, as zero-shot planning reads it
    problem = _problems(1, seed=90)[0]
    assert greedy_rollout(policy, ProblemView(problem)).assignment
    # a rerun finds every label cached: exact is not called again
    before = labels.stat().st_mtime_ns
    assert train_policy.main([*argv, "--labels-only"]) == 0
    assert labels.stat().st_mtime_ns == before
