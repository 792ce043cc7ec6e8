"""The runtime terms of the cost model (DESIGN.md §3b, costmodel/runtime_terms.py): the formulas by
hand on a small problem, and `exact` still exact when a problem uses them (against enumerating every
assignment and every count)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from heterps_ray.costmodel import CostModel, as_executed, problem_from_dict
from heterps_ray.costmodel.plan import Plan
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.provisioning import provision_counts

B = 100
GBPS = 125_000.0  # bytes per ms per Gbit/s


def _problem(runtime: dict | None = None, hosts: list | None = None, floor: float = 0.0) -> dict:
    data = {
        "name": "runtime terms",
        "batch_size": B,
        "samples": 1e6,
        "throughput_min": floor,
        "input_bytes_per_sample": 125,  # 12,500 bytes a batch: 0.1 ms at 1 Gbit/s
        "resources": [
            {"name": "a", "price_per_hour": 1.0, "max_instances": 3, "bandwidth_gbps": 1.0, "latency_ms": 0.5,
             "threads": 1, "call_overhead_ms": 0.4},
            {"name": "b", "price_per_hour": 3.0, "max_instances": 2, "bandwidth_gbps": 2.0, "latency_ms": 0.25,
             "threads": 2, "call_overhead_ms": 0.5},
        ],
        "ps": {"resource": "a", "rows_per_second_per_shard": 1e6},
        "layers": [
            {"name": "emb", "out_bytes_per_sample": 250, "sparse_rows_per_sample": 10, "parallel_fraction": 0.5,
             "time_ms": {"a": {"fixed": 1.0, "per_sample": 0.01}, "b": {"fixed": 2.0, "per_sample": 0.01}}},
            {"name": "fc", "out_bytes_per_sample": 125, "parallel_fraction": 1.0,
             "time_ms": {"a": {"fixed": 1.0, "per_sample": 0.05}, "b": {"fixed": 0.5, "per_sample": 0.01}}},
            {"name": "out", "out_bytes_per_sample": 4, "parallel_fraction": 1.0,
             "time_ms": {"a": {"fixed": 0.5, "per_sample": 0.0}, "b": {"fixed": 0.5, "per_sample": 0.0}}},
        ],
    }  # fmt: skip
    if runtime is not None:
        data["runtime"] = runtime
    if hosts is not None:
        data["hosts"] = hosts
    return data


TERMS = {"call_ms": {"a": 1.0, "b": 2.0}, "ps_wait_ms_per_row": 0.001, "ps_hosted_ms_per_row": 0.0005}


def _model(**runtime) -> CostModel:
    return CostModel(problem_from_dict(_problem({**TERMS, **runtime})))


def test_the_table_lives_in_stage_0s_gpu_memory_when_it_hosts_the_shards_and_is_priced_there():
    """Stage 0 on b (a type with a measured GPU tier) hosting the shards keeps the rows in b's memory:
    a row costs gpu_table_ms_per_row there instead of the hosted shards' rate, and gpu_miss_ms_per_row
    for the share a cache does not serve; on a, or with shard actors, the rows stay on the shards."""
    gpu = {"gpu_table_ms_per_row": {"b": 0.002}, "gpu_miss_ms_per_row": {"b": 0.01}}
    model = _model(mode="sync", **gpu)
    on_b = model.evaluate(["b", "b", "b"], [1], 1)
    on_a = model.evaluate(["a", "a", "a"], [1], 1)
    assert on_b.runtime is not None and on_a.runtime is not None
    assert on_b.runtime.table.place == "gpu" and on_a.runtime.table.place == "ps"
    plain = _model(mode="sync").evaluate(["b", "b", "b"], [1], 1)
    assert plain.runtime is not None and plain.runtime.table.place == "ps"
    rows = 10 * B  # per batch
    assert on_b.runtime.stage_ms[0] - plain.runtime.stage_ms[0] == pytest.approx(rows * (0.002 - 0.0005))
    cached = _problem({**TERMS, "mode": "sync", **gpu})
    cached["ps"]["table"] = {"rows": 1000, "bytes_per_row": 100.0, "budget_gb": {"a": 1.0, "b": 1.0},
                             "shards_needed": 1, "gpu_rows": {"b": 250}, "gpu_hit_rate": {"b": 0.8}}  # fmt: skip
    cache = CostModel(problem_from_dict(cached)).evaluate(["b", "b", "b"], [1], 1)
    assert cache.runtime is not None and cache.runtime.table.place == "gpu_cache"
    assert cache.runtime.stage_ms[0] - on_b.runtime.stage_ms[0] == pytest.approx(rows * 0.2 * 0.01)
    # every row fits: still all rows in GPU memory, and each row's first lookup (a cold miss) is priced
    cached["ps"]["table"].update(gpu_rows={"b": 1000}, gpu_hit_rate={"b": 0.99})
    cold = CostModel(problem_from_dict(cached)).evaluate(["b", "b", "b"], [1], 1)
    assert cold.runtime is not None and cold.runtime.table.place == "gpu"
    assert cold.runtime.stage_ms[0] - on_b.runtime.stage_ms[0] == pytest.approx(rows * 0.01 * 0.01)
    off = _model(mode="sync", gpu_table="off", **gpu).evaluate(["b", "b", "b"], [1], 1)
    assert off.runtime is not None and off.runtime.table.place == "ps"
    actors = _model(mode="sync", ps_hosting="actors", **gpu).evaluate(["b", "b", "b"], [1], 1)
    assert actors.runtime is not None and actors.runtime.table.place == "ps"
    plan = Plan.from_evaluation(model.problem, on_b, "manual")
    assert (plan.table_place, plan.table_type) == ("gpu", "b")
    assert "GPU memory (all rows)" in plan.table() and plan.table_ms == pytest.approx(rows * 0.002)


def test_sync_two_stages_wait_for_each_other_with_calls_bytes_input_and_hosted_ps():
    model = _model(mode="sync")
    e = model.evaluate(["a", "b", "b"], [1, 1], 1)
    # stage 0 on a: emb 1 + 0.01*100, input 0.1, its side of the boundary 2*250*100 bytes at 1 Gbit/s,
    # the hosted PS 10 rows * 100 * 0.0005
    busy0 = 2.0 + 0.1 + 2 * 250 * B / GBPS + 10 * B * 0.0005
    # stage 1 on b: fc 0.5 + 1, out 0.5, of its one call (forward + loss + backward, a 2 ms round trip)
    # its own 0.5 ms, its side of the boundary at 2 Gbit/s
    busy1 = 2.0 + 0.5 + 2 * 250 * B / (2 * GBPS)
    assert e.runtime is not None and e.runtime.ps_hosted
    assert e.runtime.stage_ms == pytest.approx((busy0, busy1))
    loop = busy0 + busy1 + (2.0 - 0.5)  # the DataWorker waits the whole round trip
    assert e.runtime.loop_ms == pytest.approx(loop)
    assert e.throughput == pytest.approx(1000 * B / loop)
    assert e.bound == "loop"
    # the base model of the same problem pipelines the stages: the slower one alone sets the pace
    base = CostModel(problem_from_dict(_problem())).evaluate(["a", "b", "b"], [1, 1], 1)
    assert base.runtime is None and base.throughput > e.throughput


def test_hosted_shards_cost_no_ps_instance_and_take_none_of_its_instances():
    """Shards hosted in DataWorker 0's process start no actor: the plan pays its stages alone, and the
    PS type's instances are all the stages'. On actor shards (a replicated stage) the shards are paid."""
    model = _model(mode="sync", ps_hosting="auto")
    hosted = model.evaluate(["a", "b", "b"], [1, 1], 1)
    assert hosted.runtime is not None and hosted.runtime.ps_hosted
    assert hosted.cost_rate == pytest.approx(1.0 + 3.0)  # a's DataWorker and b's stage, no PS instance
    assert hosted.instances == (1, 1)
    on_actors = model.evaluate(["a", "b", "b"], [2, 1], 1)
    assert on_actors.runtime is not None and not on_actors.runtime.ps_hosted
    assert on_actors.cost_rate == pytest.approx(2 * 1.0 + 3.0 + 1 * 1.0)
    assert on_actors.instances == (3, 1)
    # the PS type with one instance: its DataWorker hosts the shards, so the plan on it alone exists
    data = _problem({**TERMS, "mode": "sync", "ps_hosting": "auto"})
    data["resources"][0]["max_instances"] = 1
    one = CostModel(problem_from_dict(data))
    assert one.evaluate(["a", "a", "a"], [1], 1).available
    assert not one.evaluate(["a", "a", "a"], [2], 1).available
    for method in ("brute", "levels"):
        plan = get_scheduler("exact", method=method).schedule(one.problem)
        assert plan.feasible and all(s.replicas == 1 for s in plan.stages)
        assert plan.cost_rate == pytest.approx(sum(
            {"a": 1.0, "b": 3.0}[s.type] for s in plan.stages
        ))


def test_a_middle_stage_takes_two_calls_and_both_boundaries():
    model = _model(mode="sync")
    e = model.evaluate(["a", "b", "a"], [1, 1, 1], 1)
    middle = 0.5 + 0.01 * B + 2 * 0.5 + (2 * 250 * B + 2 * 125 * B) / (2 * GBPS)
    assert e.runtime is not None
    assert e.runtime.stage_ms[1] == pytest.approx(middle)


def test_sync_replicas_add_nothing_and_micro_batches_pay_the_gpipe_bubble():
    model = _model(mode="sync")
    one = model.evaluate(["a", "b", "b"], [1, 1], 1)
    more = model.evaluate(["a", "b", "b"], [1, 2], 1)
    assert more.throughput < one.throughput  # the shards leave the DataWorker, nothing gains
    assert more.cost_rate > one.cost_rate
    k4 = _model(mode="sync", micro_batches=4).evaluate(["a", "b", "b"], [1, 1], 1)
    assert k4.runtime is not None
    busy = [ms / 4 for ms in k4.runtime.stage_ms]
    waiting = 2.0 - 0.5  # per micro-batch: the one call's round trip beyond what b itself spends
    assert k4.runtime.loop_ms == pytest.approx(sum(busy) + waiting + 3 * max(busy))


def test_async_overlaps_batches_and_data_workers_until_a_stage_binds():
    serial = _model(mode="async").evaluate(["a", "b", "b"], [1, 1], 1)
    ahead = _model(mode="async", batches_ahead=1).evaluate(["a", "b", "b"], [1, 1], 1)
    assert ahead.runtime is not None and serial.runtime is not None
    assert ahead.runtime.loop_throughput == pytest.approx(2 * serial.runtime.loop_throughput)
    assert ahead.throughput == pytest.approx(
        min(ahead.runtime.loop_throughput, *ahead.runtime.stage_throughput)
    )
    far = _model(mode="async", batches_ahead=3).evaluate(["a", "b", "b"], [1, 1], 1)
    assert far.runtime is not None and far.bound.startswith("stage")
    assert far.throughput == pytest.approx(min(far.runtime.stage_throughput))
    workers = _model(mode="async").evaluate(["a", "b", "b"], [2, 1], 2)
    assert workers.runtime is not None and not workers.runtime.ps_hosted  # shards on actors: PS waits
    assert workers.runtime.stage_ms[0] > serial.runtime.stage_ms[0]


def test_a_shared_host_caps_the_plan_at_its_free_cores():
    hosts = [{"name": "box", "cores": 2, "types": ["a", "b"], "background_cores": 0.5, "call_cpu_ms": 1.0}]
    model = CostModel(problem_from_dict(_problem({**TERMS, "mode": "async", "batches_ahead": 3}, hosts)))
    e = model.evaluate(["a", "b", "b"], [1, 1], 1)
    assert e.runtime is not None
    busy0, busy1 = e.runtime.stage_ms
    compute1 = 0.5 + 0.01 * B + 0.5
    waiting1 = 2.0 - 0.5  # the rest of its call's round trip: the DataWorker's side and Ray's
    work = busy0 + (busy1 - compute1) + waiting1 + 2 * compute1 + 1 * 1.0  # b's compute keeps 2 cores busy
    assert e.runtime.host_throughput == pytest.approx(1000 * B * 1.5 / work)
    assert e.throughput == pytest.approx(min(e.runtime.host_throughput, *e.runtime.stage_throughput))


def test_batch_evaluation_matches_one_by_one_with_runtime_terms():
    model = _model(mode="async")
    a = np.array([[0, 0, 0], [0, 1, 1], [1, 0, 1]])
    k = np.array([[2, 1, 1], [1, 2, 1], [1, 1, 1]])
    batch = model.evaluate_batch(a, k, np.array([1, 2, 1]))
    for i in range(3):
        stages = len(model.split_stages(a[i]))
        one = model.evaluate(a[i], k[i, :stages].tolist(), int([1, 2, 1][i]))
        assert batch.throughput[i] == pytest.approx(one.throughput)
        assert batch.cost[i] == pytest.approx(one.cost)


def _enumerate(model: CostModel) -> tuple[float, float]:
    """(cheapest feasible cost, highest throughput) over every assignment, count and shard number."""
    problem = model.problem
    cheapest, fastest = math.inf, 0.0
    caps = [r.max_instances for r in problem.resources]
    for assignment in itertools.product(range(problem.num_types), repeat=problem.num_layers):
        stages = len(model.split_stages(assignment))
        for counts in itertools.product(range(1, max(caps) + 1), repeat=stages):
            for shards in range(1, caps[model.ps_type] + 1):
                e = model.evaluate(assignment, list(counts), shards)
                if not (e.runnable and e.available):
                    continue
                fastest = max(fastest, e.throughput)
                if e.meets_floor:
                    cheapest = min(cheapest, e.cost)
    return cheapest, fastest


@pytest.mark.parametrize(
    ("runtime", "floor", "hosted"),
    [
        ({"mode": "sync"}, 2000.0, "auto"),
        ({"mode": "async"}, 3000.0, "auto"),
        ({"mode": "async", "batches_ahead": 2}, 9000.0, "auto"),
        ({"mode": "async", "micro_batches": 2}, 5000.0, "actors"),
    ],
)
def test_exact_agrees_with_enumerating_every_plan_of_the_runtime_model(runtime, floor, hosted):
    hosts = [{"name": "box", "cores": 3, "types": ["a", "b"], "call_cpu_ms": 0.3}]
    data = _problem({**TERMS, **runtime, "ps_hosting": hosted}, hosts, floor=floor)
    model = CostModel(problem_from_dict(data))
    cheapest, fastest = _enumerate(model)
    plan = get_scheduler("exact").schedule(model.problem)
    assert plan.extra["method"] == "brute"
    if math.isfinite(cheapest):
        assert plan.feasible and plan.cost == pytest.approx(cheapest, rel=1e-9)
    else:
        assert not plan.feasible
    assert plan.best_throughput == pytest.approx(fastest, rel=1e-9)
    # the plan promises what the model says of it, and every other scheduler prices the same way
    again = model.evaluate(list(plan.assignment), plan.replicas, plan.ps_shards)
    assert again.throughput == pytest.approx(plan.throughput)
    for assignment in itertools.product(range(2), repeat=3):
        counts = provision_counts(model, assignment)
        if counts.feasible:
            assert counts.cost >= plan.cost * (1 - 1e-9)


def _check_levels_against(model: CostModel, cheapest: float, fastest: float) -> None:
    """The ILP level walk (what `exact` runs above BRUTE_FORCE_LIMIT assignments) equals enumeration."""
    plan = get_scheduler("exact", method="levels").schedule(model.problem)
    assert plan.extra["method"] == "levels+ilp" and plan.extra["proof"]["proven"]
    if math.isfinite(cheapest):
        assert plan.feasible and plan.cost == pytest.approx(cheapest, rel=1e-9)
        assert plan.extra["proof"]["cost"] == pytest.approx(plan.cost)
    else:
        assert not plan.feasible
        assert plan.best_throughput == pytest.approx(fastest, rel=1e-8)


@pytest.mark.parametrize(
    ("runtime", "floor", "hosted"),
    [
        ({"mode": "sync"}, 2000.0, "auto"),
        ({"mode": "async"}, 3000.0, "auto"),
        ({"mode": "async", "batches_ahead": 2}, 9000.0, "auto"),
        ({"mode": "async", "micro_batches": 2}, 5000.0, "actors"),
        ({"mode": "sync", "micro_batches": 4}, 1500.0, "actors"),
        ({"mode": "async"}, 1e6, "auto"),  # no plan meets the floor: the fastest plan
        # the rows in b's GPU memory where stage 0 runs on b and hosts the shards (the table's place)
        ({"mode": "sync", "gpu_table_ms_per_row": {"b": 0.004}}, 2000.0, "auto"),
        (
            {"mode": "async", "gpu_table_ms_per_row": {"b": 1e-5}, "gpu_miss_ms_per_row": {"b": 0.01}},
            3000.0,
            "auto",
        ),
    ],
)
@pytest.mark.parametrize("shared_host", [True, False])
def test_the_ilp_level_search_agrees_with_enumerating_every_plan(runtime, floor, hosted, shared_host):
    hosts = [{"name": "box", "cores": 3, "types": ["a", "b"], "call_cpu_ms": 0.3}] if shared_host else None
    model = CostModel(
        problem_from_dict(_problem({**TERMS, **runtime, "ps_hosting": hosted}, hosts, floor=floor))
    )
    _check_levels_against(model, *_enumerate(model))


def _random_problem(seed: int) -> dict:
    """A small random problem with a random runtime section (and sometimes a shared host): few
    layers, types and instances, so that every assignment, count and shard number can be enumerated."""
    rng = np.random.default_rng(seed)
    L, T = int(rng.integers(2, 4)), int(rng.integers(2, 4))
    names = ["a", "b", "c"][:T]
    resources = [
        {"name": n, "price_per_hour": round(float(rng.uniform(0.3, 4.0)), 2), "max_instances": int(rng.integers(1, 4)),
         "bandwidth_gbps": float(rng.choice([1.0, 2.0, 10.0])), "latency_ms": round(float(rng.uniform(0, 0.5)), 2),
         "threads": int(rng.integers(1, 3)), "call_overhead_ms": round(float(rng.uniform(0, 0.6)), 2)}
        for n in names
    ]  # fmt: skip
    layers = []
    for li in range(L):
        runs = [n for n in names if n == "a" or rng.random() < 0.8]
        layers.append(
            {"name": f"l{li}", "out_bytes_per_sample": float(rng.integers(4, 400)),
             "sparse_rows_per_sample": float(rng.integers(0, 20)) if li == 0 else 0.0,
             "parallel_fraction": round(float(rng.uniform(0.3, 1.0)), 3),
             "time_ms": {n: {"fixed": round(float(rng.uniform(0.1, 2.0)), 3),
                             "per_sample": round(float(rng.uniform(0.0, 0.05)), 4)} for n in runs}}
        )  # fmt: skip
    mode = str(rng.choice(["sync", "async"]))
    runtime = {
        "mode": mode,
        "micro_batches": int(rng.choice([1, 2, 4])),
        "batches_ahead": int(rng.integers(0, 3)) if mode == "async" else 0,
        "ps_hosting": str(rng.choice(["auto", "actors"])),
        "call_ms": {n: round(float(rng.uniform(0.2, 2.5)), 2) for n in names},
        "ps_wait_ms_per_row": float(rng.choice([0.0, 1e-3])),
        "ps_hosted_ms_per_row": float(rng.choice([0.0, 5e-4])),
    }
    data = {
        "name": f"random-{seed}", "batch_size": B, "samples": 1e6, "throughput_min": 0.0,
        "input_bytes_per_sample": float(rng.integers(0, 200)), "resources": resources,
        "ps": {"resource": "a", "rows_per_second_per_shard": float(rng.uniform(2e5, 2e6)),
               "min_shards": int(rng.integers(1, 3))},
        "layers": layers, "runtime": runtime,
    }  # fmt: skip
    # the shard actors live on a (hosted shards take none of its instances: there, one can do)
    least = 2 if runtime["ps_hosting"] == "actors" else data["ps"]["min_shards"]
    resources[0]["max_instances"] = max(resources[0]["max_instances"], least)
    if rng.random() < 0.4:
        data["hosts"] = [{"name": "box", "cores": float(rng.integers(2, 5)), "types": names[:2],
                          "call_cpu_ms": round(float(rng.uniform(0, 0.5)), 2)}]  # fmt: skip
    return data


@pytest.mark.parametrize("seed", range(16))  # 12, 14, 15: hosting on a PS type of one instance
def test_exact_on_random_small_runtime_problems_equals_enumeration(seed):
    data = _random_problem(seed)
    model = CostModel(problem_from_dict(data))
    _, fastest = _enumerate(model)
    # floors from far below to above the fastest plan: the cheapest plan's speed changes with them
    for share in (0.3, 0.8, 1.2):
        data["throughput_min"] = round(share * fastest, 1)
        model = CostModel(problem_from_dict(data))
        cheapest, reached = _enumerate(model)
        _check_levels_against(model, cheapest, reached)


def test_execution_fields_are_set_and_checked():
    problem = problem_from_dict(_problem())
    executed = as_executed(problem, mode="async", batches_ahead=2)
    assert executed.runtime is not None and executed.runtime.in_flight == 3
    with pytest.raises(ConfigError, match="runtime.call_ms"):
        problem_from_dict(_problem({"call_ms": {"gpu": 1.0}}), "p.yaml")
    with pytest.raises(ConfigError, match="runtime.batches_ahead"):
        problem_from_dict(_problem({"mode": "sync", "batches_ahead": 1}), "p.yaml")
    with pytest.raises(ConfigError, match="runtime.micro_batches"):
        problem_from_dict(_problem({"micro_batches": 3}), "p.yaml")


@pytest.mark.parametrize("seed", range(16))  # 12, 14, 15: hosting on a PS type of one instance
def test_the_interval_bounds_stay_below_every_plan_in_their_interval(seed):
    """`ratio_bound(low, high)` (the walk stops on it with high = inf) never claims more than the
    cheapest R / Θ of a plan with low <= Θ <= high, by enumeration."""
    from heterps_ray.scheduling.runtime_levels import RuntimeLevels

    model = CostModel(problem_from_dict(_random_problem(seed)))
    caps = [r.max_instances for r in model.problem.resources]
    plans = []  # (Θ, R) of every plan within the limits
    for assignment in itertools.product(range(model.num_types), repeat=model.num_layers):
        stages = len(model.split_stages(assignment))
        for counts in itertools.product(range(1, max(caps) + 1), repeat=stages):
            for shards in range(1, caps[model.ps_type] + 1):
                e = model.evaluate(assignment, list(counts), shards)
                if e.runnable and e.available and e.throughput > 0:
                    plans.append((e.throughput, e.cost_rate))
    levels = RuntimeLevels(model)
    speeds = sorted({theta for theta, _ in plans})
    for low in speeds[:: max(1, len(speeds) // 6)]:
        for width in (0.0, 0.05, 0.3, 1.0, math.inf):
            high = low * (1.0 + width)
            inside = [rate / theta for theta, rate in plans if low <= theta <= high]
            best = min(inside)
            assert levels.ratio_bound(low, high) <= best * (1.0 + 1e-9)
