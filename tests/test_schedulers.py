"""Schedulers: exact equals brute force, provisioning is exact, baselines never beat the optimum."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from heterps_ray.costmodel import CostModel, Plan, Problem, evaluate_plan, problem_from_dict
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling import (
    Scheduler,
    get_scheduler,
    provision,
    provision_counts,
    register_scheduler,
)
from heterps_ray.scheduling.base_levels import BaseLevels
from heterps_ray.scheduling.exact import (
    brute_force,
    level_search,
    max_reachable_throughput,
    throughput_bounds,
)
from heterps_ray.scheduling.generator import generate_problem


def tight(problem: Problem, rng: np.random.Generator) -> Problem:
    """The same problem with 2..5 instances per type, so max_instances bind and stages compete."""
    data = problem.to_dict()
    for r in data["resources"]:
        r["max_instances"] = int(rng.integers(2, 6))
    data["ps"]["min_shards"] = 1
    return problem_from_dict(data)


def same_optimum(a: Plan, b: Plan) -> bool:
    if a.feasible != b.feasible:
        return False
    if a.feasible:
        return a.cost == pytest.approx(b.cost, rel=1e-9)
    return a.best_throughput == pytest.approx(b.best_throughput, rel=1e-9)


def test_exact_equals_brute_force_on_small_generated_problems():
    for seed in range(30):
        problem = generate_problem(seed, num_layers=(3, 6), num_types=(2, 3))
        brute, exact = brute_force(problem), level_search(problem)
        assert same_optimum(brute, exact), (seed, brute.table(), exact.table())
        if not exact.feasible:
            assert exact.best_throughput == pytest.approx(max_reachable_throughput(problem), rel=1e-9)


def test_exact_equals_brute_force_when_instance_limits_bind():
    rng = np.random.default_rng(1)
    counted = used_ilp = 0
    for seed in range(20):
        problem = tight(generate_problem(100 + seed, num_layers=(4, 6), num_types=(2, 3)), rng)
        brute = brute_force(problem)
        by_counting = level_search(problem)
        by_ilp = level_search(problem, state_limit=0)  # every constrained level: Lagrangian + ILP
        assert same_optimum(brute, by_counting), (seed, brute.table(), by_counting.table())
        assert same_optimum(brute, by_ilp), (seed, brute.table(), by_ilp.table())
        counted += by_counting.extra["counting_dp_solves"]
        used_ilp += by_ilp.extra["ilp_solves"]
    assert counted > 0 and used_ilp > 0  # both constrained paths were exercised


def _variant(problem: Problem, kind: int, rng: np.random.Generator) -> Problem:
    data = problem.to_dict()
    if kind == 0:
        data["throughput_min"] = 0.0
    elif kind == 1:
        data["ps"].pop("rows_per_second_per_shard")  # unlimited PS
    elif kind == 2:
        for layer in data["layers"]:
            layer["sparse_rows_per_sample"] = 0
    elif kind == 3:  # one resource type
        keep = data["resources"][0]["name"]
        data["resources"] = data["resources"][:1]
        for layer in data["layers"]:
            layer["time_ms"] = {keep: layer["time_ms"].get(keep, {"fixed": 1.0, "per_sample": 0.01})}
    else:
        for r in data["resources"]:
            r["max_instances"] = int(rng.integers(1, 4))
        data["ps"]["min_shards"] = 1
    return problem_from_dict(data)


def test_exact_equals_brute_force_on_edge_cases():
    """No floor, unlimited PS, no sparse rows, one type, one-to-three instances; 1..5 layers."""
    rng = np.random.default_rng(5)
    for seed in range(15):
        problem = _variant(generate_problem(500 + seed, num_layers=(1, 5), num_types=(2, 3)), seed % 5, rng)
        assert same_optimum(brute_force(problem), level_search(problem)), seed


def alternating_problem(gpu_max: int) -> Problem:
    """Even layers fast only on the GPU, odd layers only on the CPU: the free optimum alternates,
    which needs three GPU stages."""
    layers = []
    for li in range(5):
        gpu = {"fixed": 0.1, "per_sample": 0.0001 if li % 2 == 0 else 0.05}
        cpu = {"fixed": 0.1, "per_sample": 0.05 if li % 2 == 0 else 0.0001}
        layers.append({"name": f"l{li}", "out_bytes_per_sample": 4, "time_ms": {"cpu": cpu, "gpu": gpu}})
    return problem_from_dict(
        {
            "name": "alternating",
            "batch_size": 100,
            "samples": 1e7,
            "throughput_min": 10_000,
            "resources": [
                {"name": "cpu", "price_per_hour": 0.3, "max_instances": 10, "bandwidth_gbps": 100},
                {"name": "gpu", "price_per_hour": 1.0, "max_instances": gpu_max, "bandwidth_gbps": 100},
            ],
            "layers": layers,
        }
    )


def test_gpu_limit_forces_fewer_gpu_stages():
    free = level_search(alternating_problem(gpu_max=3))
    assert free.assignment == ("gpu", "cpu", "gpu", "cpu", "gpu")
    limited = level_search(alternating_problem(gpu_max=2))
    assert limited.feasible and sum(s.replicas for s in limited.stages if s.type == "gpu") <= 2
    assert limited.cost == pytest.approx(brute_force(alternating_problem(gpu_max=2)).cost, rel=1e-9)
    assert limited.cost > free.cost


def test_layer_only_one_type_can_run_is_placed_there():
    problem = alternating_problem(gpu_max=3).to_dict()
    del problem["layers"][1]["time_ms"]["cpu"]  # l1 now GPU-only
    plan = get_scheduler("exact").schedule(problem_from_dict(problem))
    assert plan.assignment[1] == "gpu"


def test_provisioning_equals_enumerating_every_count():
    rng = np.random.default_rng(2)
    checked = 0
    for seed in range(12):
        problem = tight(generate_problem(200 + seed, num_layers=(2, 4), num_types=(2, 3)), rng)
        model = CostModel(problem)
        choices = [np.flatnonzero(model.runnable[li]) for li in range(problem.num_layers)]
        for assignment in itertools.islice(itertools.product(*choices), 6):
            stages = model.split_stages(assignment)
            caps = [int(model.max_instances[t]) for _, _, t in stages]
            grid = np.array(list(itertools.product(*[range(1, c + 1) for c in caps])))
            shards = np.arange(model.ps_min_shards, int(model.max_instances[model.ps_type]) + 1)
            reps = np.repeat(grid, len(shards), axis=0)
            m = np.tile(shards, len(grid))
            padded = np.ones((len(reps), problem.num_layers), dtype=np.int64)
            padded[:, : len(stages)] = reps
            batch = model.evaluate_batch(np.tile(assignment, (len(reps), 1)), padded, m)
            counts = provision_counts(model, assignment)
            if batch.feasible.any():
                assert counts.feasible
                assert counts.cost == pytest.approx(batch.cost[batch.feasible].min(), rel=1e-9)
            else:
                assert not counts.feasible
            ok = batch.available & batch.runnable
            best = batch.throughput[ok].max() if ok.any() else 0.0
            assert counts.max_throughput == pytest.approx(best, rel=1e-9)
            checked += 1
    assert checked >= 30


def fixed_cost_problem(floor: float) -> Problem:
    """One perfectly parallel layer and three PS shards that are paid for whatever the speed."""
    return problem_from_dict(
        {
            "name": "fixed-cost",
            "batch_size": 100,
            "samples": 3.6e7,
            "throughput_min": floor,
            "resources": [
                {"name": "cpu", "price_per_hour": 1.0, "max_instances": 3, "bandwidth_gbps": 10},
                {"name": "gpu", "price_per_hour": 2.0, "max_instances": 8, "bandwidth_gbps": 10},
            ],
            "ps": {"resource": "cpu", "min_shards": 3},
            "layers": [
                {
                    "name": "fc",
                    "out_bytes_per_sample": 4,
                    "parallel_fraction": 1.0,
                    "time_ms": {"gpu": {"fixed": 10.0, "per_sample": 0.0}},
                }
            ],
        }
    )


def test_faster_plan_can_be_cheaper():
    # 1 GPU replica: 10,000 samples/s meets the floor at 2 + 3 = 5 $/h -> 3.6e7 / 1e4 s = 1 h -> 5 $.
    # 8 replicas: 80,000 samples/s at 16 + 3 = 19 $/h for 1/8 h -> 2.375 $: more replicas, less money.
    plan = provision(fixed_cost_problem(floor=5_000), ["gpu"])
    assert plan.stages[0].replicas == 8 and plan.ps_shards == 3
    assert plan.cost == pytest.approx(19 / 8)
    assert get_scheduler("exact").schedule(fixed_cost_problem(floor=5_000)).cost == pytest.approx(19 / 8)


def test_infeasible_problem_reports_the_highest_reachable_throughput():
    # 8 GPU replicas of a 10 ms stage at B = 100: 80,000 samples/s at most
    plan = get_scheduler("exact").schedule(fixed_cost_problem(floor=100_000))
    assert not plan.feasible
    assert plan.best_throughput == pytest.approx(80_000) and plan.throughput == pytest.approx(80_000)
    assert max_reachable_throughput(fixed_cost_problem(floor=100_000)) == pytest.approx(80_000)
    lower, upper = throughput_bounds(fixed_cost_problem(floor=100_000))
    assert lower <= 80_000 * (1 + 1e-9) and upper >= 80_000 * (1 - 1e-9)


SMALL_SEARCH = {"genetic": {"generations": 15}, "random": {"samples": 300}}


@pytest.mark.parametrize("name", ["greedy", "genetic", "random", "single"])
def test_baselines_never_beat_exact(name):
    for seed in range(4):
        problem = generate_problem(300 + seed, num_layers=(4, 10), num_types=(2, 4))
        exact = get_scheduler("exact").schedule(problem)
        plan = get_scheduler(name, seed=seed, **SMALL_SEARCH.get(name, {})).schedule(problem)
        assert plan.scheduler == name and plan.seconds >= 0 and plan.plans_evaluated >= 1
        if plan.feasible:
            assert exact.feasible and plan.cost >= exact.cost * (1 - 1e-9)
        assert evaluate_plan(plan, problem).cost == pytest.approx(plan.cost, rel=1e-12)


@pytest.mark.parametrize("name", ["genetic", "random"])
def test_seeded_searches_are_reproducible(name):
    problem = generate_problem(11, num_layers=(8, 8), num_types=(3, 3))
    a = get_scheduler(name, seed=4, **SMALL_SEARCH[name]).schedule(problem)
    b = get_scheduler(name, seed=4, **SMALL_SEARCH[name]).schedule(problem)
    assert (a.assignment, a.replicas, a.ps_shards, a.cost) == (b.assignment, b.replicas, b.ps_shards, b.cost)


def test_single_type_scheduler_names_its_type():
    problem = alternating_problem(gpu_max=3)
    plan = get_scheduler("single:cpu").schedule(problem)
    assert plan.assignment == ("cpu",) * 5 and plan.scheduler == "single:cpu"
    best_single = get_scheduler("single").schedule(problem)
    assert best_single.cost <= plan.cost
    with pytest.raises(ConfigError):
        get_scheduler("single:tpu").schedule(problem)


def test_base_prefix_schedules_the_base_model_and_prices_with_the_runtime_terms():
    problem = alternating_problem(gpu_max=3)
    plain = get_scheduler("base:exact").schedule(problem)  # no runtime section: the base model is the model
    exact = get_scheduler("exact").schedule(problem)
    assert (plain.scheduler, plain.assignment, plain.replicas) == (
        "base:exact",
        exact.assignment,
        exact.replicas,
    )
    assert plain.cost == pytest.approx(exact.cost) and plain.extra["base_cost"] == pytest.approx(exact.cost)

    data = problem.to_dict()
    data["runtime"] = {"mode": "async", "call_ms": {"cpu": 3.0, "gpu": 3.0}, "ps_wait_ms_per_row": 0.01}
    with_runtime = problem_from_dict(data)
    base = get_scheduler("base:greedy").schedule(with_runtime)
    greedy_on_base = get_scheduler("greedy").schedule(problem)  # the same problem without the section
    assert (base.assignment, base.replicas, base.ps_shards) == (
        greedy_on_base.assignment,
        greedy_on_base.replicas,
        greedy_on_base.ps_shards,
    )
    priced = CostModel(with_runtime).evaluate(list(base.assignment), base.replicas, base.ps_shards)
    assert (base.throughput, base.cost, base.feasible) == (priced.throughput, priced.cost, priced.feasible)
    assert base.extra["base_throughput"] == pytest.approx(greedy_on_base.throughput)
    assert base.throughput < greedy_on_base.throughput  # the runtime's call and PS terms cost throughput
    with pytest.raises(ConfigError, match="one base: prefix"):
        get_scheduler("base:base:exact")


def test_unknown_scheduler_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        get_scheduler("simulated-annealing")
    assert "exact" in str(info.value)


def test_another_module_can_register_a_scheduler():
    @register_scheduler("all-on-first-type")
    class FirstType(Scheduler):
        name = "all-on-first-type"

        def __init__(self, seed: int = 0, budget_s: float | None = None):
            pass

        def schedule(self, problem: Problem) -> Plan:
            return provision(problem, [0] * problem.num_layers, scheduler=self.name)

    plan = get_scheduler("all-on-first-type", seed=0, budget_s=1.0).schedule(alternating_problem(3))
    assert plan.scheduler == "all-on-first-type" and set(plan.assignment) == {"cpu"}


def test_generator_covers_the_sizes_and_makes_some_infeasible():
    sizes, feasible = set(), []
    for seed in range(30):
        problem = generate_problem(seed, num_layers=(3, 30), num_types=(2, 5))
        sizes.add((problem.num_layers, problem.num_types))
        lower, upper = throughput_bounds(problem)
        assert lower <= upper * (1 + 1e-9)
        feasible.append(problem.throughput_min <= lower)
        assert problem.throughput_min <= lower or problem.throughput_min > upper
    assert min(n for n, _ in sizes) <= 5 and max(n for n, _ in sizes) >= 25
    assert {t for _, t in sizes} == {2, 3, 4, 5}
    assert 0 < sum(feasible) < len(feasible)
    assert generate_problem(7) == generate_problem(7)


def test_generated_problems_have_layers_some_types_cannot_run():
    problems = [generate_problem(s, num_layers=(5, 12), num_types=(3, 5)) for s in range(10)]
    gaps = sum(len(layer.time_ms) < p.num_types for p in problems for layer in p.layers)
    assert gaps > 0
    assert all(not math.isnan(p.throughput_min) for p in problems)


def test_exact_uses_brute_force_only_on_small_problems():
    small = generate_problem(1, num_layers=(3, 3), num_types=(2, 2))
    large = generate_problem(2, num_layers=(12, 12), num_types=(3, 3))
    small_plan, large_plan = get_scheduler("exact").schedule(small), get_scheduler("exact").schedule(large)
    assert small_plan.extra["method"] == "brute" and large_plan.extra["method"] == "levels"
    assert small_plan.scheduler == large_plan.scheduler == "exact"


def test_the_ilp_and_the_counting_dp_agree_on_which_levels_a_plan_reaches():
    """The fastest-plan search's exact check (BaseLevels._any_path) where the limits bind: the 0/1
    program over segments (segment_paths.chain_rows) and the counting DP find a plan at the same levels
    around the highest reachable throughput, and the program's plan keeps every limit."""
    rng = np.random.default_rng(7)
    ilp_solves = 0
    for seed in range(8):
        problem = tight(generate_problem(200 + seed, num_layers=(12, 20), num_types=(3, 4)), rng)
        model = CostModel(problem)
        by_dp, by_ilp = BaseLevels(model), BaseLevels(model, state_limit=0)
        top = by_dp.max_throughput()
        assert by_ilp.max_throughput() == pytest.approx(top, rel=1e-12), seed
        for scale in (0.9, 0.98, 1.0, 1.0 + 1e-9, 1.02, 1.1):
            dp = by_dp.solve_level(top * scale, objective=False)
            ilp = by_ilp.solve_level(top * scale, objective=False)
            assert (dp is None) == (ilp is None), (seed, scale)
            if ilp is not None:
                reached = provision_counts(model, ilp.assignment).max_throughput
                assert reached >= top * scale * (1.0 - 1e-12), (seed, scale)
        ilp_solves += by_ilp.ilp_solves
    assert ilp_solves > 0  # the program decided levels
