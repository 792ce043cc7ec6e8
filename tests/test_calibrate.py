"""costmodel.calibrate: a problem refit on a run's measurement prices that run's plan at the measurement."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from heterps_ray.costmodel import CostModel, load_problem, problem_from_dict
from heterps_ray.costmodel.calibrate import predicted_throughput, refit
from heterps_ray.costmodel.plan import Plan

PROBLEMS = Path(__file__).resolve().parents[1] / "configs" / "problems"


def _random_plan(problem, rng: random.Random) -> Plan:
    types = problem.type_names
    while True:
        assignment = [rng.choice(types) for _ in problem.layers]
        if all(problem.can_run(i, t) for i, t in enumerate(assignment)):
            break
    stages = len(CostModel(problem).stage_times(CostModel(problem).indices(assignment)))
    replicas = [rng.randint(1, 3) for _ in range(stages)]
    shards = rng.randint(problem.ps.min_shards, problem.ps.min_shards + 2)
    evaluation = CostModel(problem).evaluate(assignment, replicas, shards)
    return Plan.from_evaluation(problem, evaluation, "test")


@pytest.mark.parametrize("name", ["ctr_dnn_cloud.yaml", "bst_attention_cloud.yaml"])
def test_refit_prices_any_plan_at_what_it_achieved(name):
    problem = load_problem(PROBLEMS / name)
    rng = random.Random(3)
    for _ in range(25):
        plan = _random_plan(problem, rng)
        predicted = predicted_throughput(problem, plan)
        assert predicted == pytest.approx(plan.throughput)
        for ratio in (0.3, 0.9, 1.7):  # the run was slower, a little slower, faster than promised
            achieved = predicted * ratio
            better = refit(problem, plan, achieved)
            assert predicted_throughput(better, plan) == pytest.approx(achieved, rel=1e-6)
            assert better.throughput_min == problem.throughput_min


def test_refit_scales_the_plans_types_only():
    problem = load_problem(PROBLEMS / "ctr_dnn_cloud.yaml")
    plan = Plan.from_evaluation(problem, CostModel(problem).evaluate(["cpu"] + ["t4"] * 5, [2, 1], 2), "test")
    better = refit(problem, plan, plan.throughput / 2.0)  # half as fast as promised: f = 2
    for old, new in zip(problem.layers, better.layers, strict=True):
        assert new.time_ms["cpu"].fixed == pytest.approx(2 * old.time_ms["cpu"].fixed)
        assert new.time_ms["t4"].per_sample == pytest.approx(2 * old.time_ms["t4"].per_sample)
        assert new.time_ms["a100"] == old.time_ms["a100"]  # not in the plan: nothing measured
    assert better.resource("t4").bandwidth_gbps == pytest.approx(problem.resource("t4").bandwidth_gbps / 2)
    assert better.resource("cpu").latency_ms == pytest.approx(2 * problem.resource("cpu").latency_ms)
    assert better.resource("v100") == problem.resource("v100")
    assert better.ps.rows_per_second_per_shard == pytest.approx(problem.ps.rows_per_second_per_shard / 2)


def test_refit_of_a_shared_host_scales_its_call_cpu():
    data = load_problem(PROBLEMS / "ctr_dnn_cloud.yaml").to_dict()
    data["hosts"] = [
        {"name": "box", "cores": 8, "types": ["cpu", "t4"], "call_cpu_ms": 0.5},
        {"name": "gpus", "cores": 8, "types": ["a100"], "call_cpu_ms": 0.5},
    ]
    problem = problem_from_dict(data)
    plan = Plan.from_evaluation(problem, CostModel(problem).evaluate(["cpu"] * 6, [1], 2), "test")
    better = refit(problem, plan, plan.throughput / 4.0)
    assert better.hosts is not None
    assert better.hosts[0].call_cpu_ms == pytest.approx(2.0) and better.hosts[1].call_cpu_ms == 0.5
    assert predicted_throughput(better, plan) == pytest.approx(plan.throughput / 4.0)


@pytest.mark.parametrize("achieved", [0.0, -5.0, float("nan"), float("inf")])
def test_refit_refuses_a_measurement_that_is_no_rate(achieved):
    problem = load_problem(PROBLEMS / "ctr_dnn_cloud.yaml")
    plan = Plan.from_evaluation(problem, CostModel(problem).evaluate(["cpu"] * 6, [1], 2), "test")
    with pytest.raises(ValueError, match="positive number"):
        refit(problem, plan, achieved)


def test_refit_scales_the_runtime_terms_of_the_plans_types():
    data = load_problem(PROBLEMS / "ctr_dnn_cloud.yaml").to_dict()
    data["runtime"] = {"mode": "sync", "call_ms": {"cpu": 2.0, "a100": 1.0}, "ps_wait_ms_per_row": 0.001}
    problem = problem_from_dict(data)
    plan = Plan.from_evaluation(problem, CostModel(problem).evaluate(["cpu"] * 6, [1], 2), "test")
    better = refit(problem, plan, plan.throughput / 3.0)
    assert predicted_throughput(better, plan) == pytest.approx(plan.throughput / 3.0)
    assert better.runtime is not None and problem.runtime is not None
    factor = better.layers[0].time_ms["cpu"].fixed / problem.layers[0].time_ms["cpu"].fixed
    assert better.runtime.call_ms == {"cpu": pytest.approx(2.0 * factor), "a100": 1.0}
    assert better.runtime.ps_wait_ms_per_row == pytest.approx(0.001 * factor)
    assert better.runtime.mode == "sync"


def test_scale_times_makes_a_model_uniformly_faster_or_slower():
    from heterps_ray.costmodel.calibrate import scale_times

    problem = load_problem(PROBLEMS / "ctr_dnn_cloud.yaml")
    rng = random.Random(5)
    optimistic = scale_times(problem, 0.3)
    for _ in range(10):
        plan = _random_plan(problem, rng)
        assert predicted_throughput(optimistic, plan) == pytest.approx(plan.throughput / 0.3)
    gpu_only = scale_times(problem, 2.0, {"t4"})
    assert gpu_only.ps == problem.ps and gpu_only.resource("cpu") == problem.resource("cpu")
    assert gpu_only.layers[1].time_ms["t4"].per_sample == pytest.approx(
        2 * problem.layers[1].time_ms["t4"].per_sample
    )
    with pytest.raises(ValueError, match="positive"):
        scale_times(problem, 0.0)


def test_refit_leaves_the_layer_times_of_a_type_that_only_hosts_the_ps():
    problem = load_problem(PROBLEMS / "ctr_dnn_cloud.yaml")  # PS on cpu
    plan = Plan.from_evaluation(problem, CostModel(problem).evaluate(["t4"] * 6, [1], 2), "test")
    better = refit(problem, plan, plan.throughput / 2.0)
    assert predicted_throughput(better, plan) == pytest.approx(plan.throughput / 2.0)
    assert [layer.time_ms["cpu"] for layer in better.layers] == [
        layer.time_ms["cpu"] for layer in problem.layers
    ]
    assert better.resource("cpu").latency_ms > problem.resource("cpu").latency_ms  # its network served the PS
    assert better.layers[2].time_ms["t4"].fixed > problem.layers[2].time_ms["t4"].fixed
