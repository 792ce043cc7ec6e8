"""The analytic cost model (DESIGN.md §3), formula by formula on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from heterps_ray.costmodel import CostModel, problem_from_dict
from heterps_ray.costmodel.formulas import (
    boundary_ms,
    input_ms,
    ps_throughput,
    stage_throughput,
)
from heterps_ray.costmodel.pricing import monetary_cost
from heterps_ray.scheduling.generator import generate_problem


def hand_problem(**overrides) -> dict:
    """Two types, two layers, B = 100; every number below is worked out by hand in the tests."""
    data = {
        "name": "hand",
        "batch_size": 100,
        "samples": 1.0e6,
        "throughput_min": 20000,
        "input_bytes_per_sample": 500,
        "resources": [
            # a: 1 Gbit/s = 125,000 bytes/ms; io 2 Gbit/s = 250,000 bytes/ms
            {
                "name": "a",
                "price_per_hour": 1.0,
                "max_instances": 4,
                "bandwidth_gbps": 1,
                "io_bandwidth_gbps": 2,
                "latency_ms": 0.5,
            },
            # b: 2 Gbit/s = 250,000 bytes/ms; io 1 Gbit/s = 125,000 bytes/ms
            {
                "name": "b",
                "price_per_hour": 3.0,
                "max_instances": 2,
                "bandwidth_gbps": 2,
                "io_bandwidth_gbps": 1,
            },
        ],
        "ps": {"resource": "a", "rows_per_second_per_shard": 50000, "min_shards": 1},
        "layers": [
            {
                "name": "l0",
                "out_bytes_per_sample": 1000,
                "sparse_rows_per_sample": 2,
                "parallel_fraction": 0.5,
                "time_ms": {"a": {"fixed": 1, "per_sample": 0.01}, "b": {"fixed": 2, "per_sample": 0.01}},
            },
            {
                "name": "l1",
                "out_bytes_per_sample": 10,
                "parallel_fraction": 1.0,
                "time_ms": {"a": {"fixed": 0, "per_sample": 0.08}, "b": {"fixed": 1, "per_sample": 0.01}},
            },
        ],
    }
    data.update(overrides)
    return data


@pytest.fixture
def model() -> CostModel:
    return CostModel(problem_from_dict(hand_problem()))


def test_layer_times_are_fixed_plus_per_sample_times_batch(model):
    # c(l0,a) = 1 + 0.01*100 = 2; c(l0,b) = 3; c(l1,a) = 8; c(l1,b) = 2
    np.testing.assert_allclose(model.compute_ms, [[2.0, 3.0], [8.0, 2.0]])


def test_boundary_traffic_each_side_at_its_own_bandwidth(model):
    # 2 * 1000 B * 100 = 200,000 bytes; a: 200000/125000 + 2*0.5 = 2.6 ms; b: 200000/250000 + 0 = 0.8 ms
    assert boundary_ms(1000, 100, 1.0, 0.5) == pytest.approx(2.6)
    assert model.boundary_ms[0].tolist() == pytest.approx([2.6, 0.8])


def test_input_read_at_io_bandwidth(model):
    # 500 B * 100 = 50,000 bytes; a: /250,000 = 0.2 ms; b: /125,000 = 0.4 ms
    assert input_ms(500, 100, 2.0) == pytest.approx(0.2)
    assert model.input_ms.tolist() == pytest.approx([0.2, 0.4])


def test_io_bandwidth_defaults_to_bandwidth():
    data = hand_problem()
    del data["resources"][1]["io_bandwidth_gbps"]
    assert CostModel(problem_from_dict(data)).input_ms[1] == pytest.approx(50_000 / 250_000)


def test_stage_time_sums_compute_boundaries_and_input(model):
    first, second = model.stage_times(["a", "b"])
    assert (first.start, first.end, first.type) == (0, 1, 0)
    assert first.tau_ms == pytest.approx(2.0 + 2.6 + 0.2)  # compute + its boundary side + input
    assert second.tau_ms == pytest.approx(2.0 + 0.8)  # compute + its boundary side (at b's bandwidth)
    assert first.alpha == pytest.approx(0.5) and second.alpha == pytest.approx(1.0)


def test_middle_stage_pays_two_boundaries():
    data = hand_problem()
    data["layers"].append(
        {"name": "l2", "out_bytes_per_sample": 4, "time_ms": {"a": {"fixed": 1, "per_sample": 0.0}}}
    )
    stages = CostModel(problem_from_dict(data)).stage_times(["a", "b", "a"])
    # b: 2 ms compute + 0.8 (boundary in, 1000 B/sample) + 2*10*100/250000 = 0.008 (boundary out)
    assert stages[1].tau_ms == pytest.approx(2.0 + 0.8 + 0.008)
    # last a: 1 ms + 2*10*100/125000 + 2*0.5 = 0.016 + 1.0
    assert stages[2].tau_ms == pytest.approx(1.0 + 0.016 + 1.0)


def test_single_stage_has_no_boundary_and_weights_alpha_by_compute(model):
    (stage,) = model.stage_times(["a", "a"])
    assert stage.tau_ms == pytest.approx(2.0 + 8.0 + 0.2)
    assert stage.alpha == pytest.approx((2.0 * 0.5 + 8.0 * 1.0) / 10.0)


def test_amdahl_replica_scaling():
    # 1000 * 100 / 4.8 = 20833.3 samples/s for one replica; alpha 0.5, k = 2: / (0.5 + 0.25)
    assert stage_throughput(100, 4.8, 0.5, 1) == pytest.approx(100_000 / 4.8)
    assert stage_throughput(100, 4.8, 0.5, 2) == pytest.approx(100_000 / 4.8 / 0.75)
    assert stage_throughput(100, 4.8, 0.5, 10**9) == pytest.approx(
        2 * 100_000 / 4.8, rel=1e-6
    )  # the 1/(1-alpha) cap
    assert stage_throughput(100, 4.8, 1.0, 3) == pytest.approx(3 * 100_000 / 4.8)  # perfectly parallel


def test_ps_tier_throughput():
    assert ps_throughput(2, 50_000, 2) == pytest.approx(50_000)
    assert math.isinf(ps_throughput(3, 50_000, 0))  # no sparse rows: never the bottleneck


def test_two_stage_plan_throughput_cost_rate_and_cost(model):
    e = model.evaluate(["a", "b"], [2, 1], 2)
    assert [s.throughput for s in e.stages] == pytest.approx([100_000 / 4.8 / 0.75, 100_000 / 2.8])
    assert e.ps_throughput == pytest.approx(50_000)
    assert e.throughput == pytest.approx(27_777.777, rel=1e-6)  # stage 0 is the bottleneck
    assert e.cost_rate == pytest.approx(2 * 1.0 + 1 * 3.0 + 2 * 1.0)  # $/h
    # 1e6 samples / 27,777.8 samples/s = 36 s = 0.01 h -> 7 $/h * 0.01 h
    assert e.cost == pytest.approx(0.07)
    assert monetary_cost(7.0, 1e6, 27_777.777777777777) == pytest.approx(0.07)
    assert e.instances == (4, 1) and e.available and e.meets_floor and e.feasible


def test_ps_shards_can_be_the_bottleneck(model):
    e = model.evaluate(["a", "b"], [2, 1], 1)
    assert e.throughput == pytest.approx(25_000)  # 1 shard * 50,000 rows/s / 2 rows per sample


def test_instances_over_max_are_unavailable(model):
    e = model.evaluate(["a", "b"], [3, 1], 2)  # a: 3 replicas + 2 PS shards = 5 > 4
    assert e.instances == (5, 1) and not e.available and not e.feasible


def test_below_floor_is_infeasible(model):
    e = model.evaluate(["a", "a"], [1], 1)
    assert e.throughput == pytest.approx(100_000 / 10.2)  # alpha cancels with one replica
    assert not e.meets_floor and not e.feasible and e.available


def test_too_few_ps_shards_is_unavailable():
    m = CostModel(problem_from_dict(hand_problem(ps={"resource": "a", "min_shards": 2})))
    assert not m.evaluate(["a", "b"], [1, 1], 1).available
    assert m.evaluate(["a", "b"], [1, 1], 2).available


def test_type_that_cannot_run_a_layer_gives_no_throughput():
    data = hand_problem()
    del data["layers"][1]["time_ms"]["a"]
    m = CostModel(problem_from_dict(data))
    e = m.evaluate(["a", "a"], [1], 1)
    assert not e.runnable and e.throughput == 0.0 and math.isinf(e.cost) and not e.feasible


def test_batch_evaluation_matches_one_by_one():
    rng = np.random.default_rng(0)
    for seed in range(8):
        problem = generate_problem(seed, num_layers=(3, 12), num_types=(2, 5))
        m = CostModel(problem)
        P, L = 300, problem.num_layers
        assignments = rng.integers(0, problem.num_types, size=(P, L))
        sticky = rng.random((P, L)) < 0.6  # longer stages too
        for li in range(1, L):
            assignments[:, li] = np.where(sticky[:, li], assignments[:, li - 1], assignments[:, li])
        replicas = rng.integers(0, 6, size=(P, L))
        shards = rng.integers(0, 5, size=P)
        batch = m.evaluate_batch(assignments, replicas, shards)
        for p in range(P):
            n = len(m.split_stages(assignments[p]))
            one = m.evaluate(assignments[p], replicas[p, :n].tolist(), int(shards[p]))
            assert batch.num_stages[p] == n
            assert batch.throughput[p] == pytest.approx(one.throughput, rel=1e-9)
            assert batch.cost_rate[p] == pytest.approx(one.cost_rate, rel=1e-12)
            assert batch.cost[p] == pytest.approx(one.cost, rel=1e-9)
            assert (batch.runnable[p], batch.available[p], batch.feasible[p]) == (
                one.runnable,
                one.available,
                one.feasible,
            )


def test_batch_evaluation_accepts_one_count_for_every_stage(model):
    batch = model.evaluate_batch(np.array([[0, 1], [0, 0]]), np.array([1, 1]), 1)
    # [a | b], one replica each: stage 0 (4.8 ms) limits, below the PS (25,000); [a a]: 10.2 ms
    assert batch.throughput.tolist() == pytest.approx([100_000 / 4.8, 100_000 / 10.2])
    assert batch.cost_rate.tolist() == pytest.approx([1 + 3 + 1, 1 + 1])


def test_segment_tables_match_stage_times():
    problem = generate_problem(5, num_layers=(6, 6), num_types=(3, 3))
    m = CostModel(problem)
    tau, alpha = m.segment_tables()
    for i in range(6):
        for j in range(i, 6):
            for t in range(3):
                st = m.segment_time(i, j + 1, t)
                if math.isinf(st.tau_ms):
                    assert math.isinf(tau[i, j, t])
                else:
                    assert tau[i, j, t] == pytest.approx(st.tau_ms, rel=1e-12)
                    assert alpha[i, j, t] == pytest.approx(st.alpha, rel=1e-12)
