"""The pipeline simulator agrees with the analytic model where it must, and differs where the runtime's
structure (bounded in-flight work, the sync barrier, PS contention) makes the real pipeline differ."""

from __future__ import annotations

import json

import numpy as np
import pytest

from heterps_ray.cli import main
from heterps_ray.costmodel import CostModel, problem_from_dict
from heterps_ray.costmodel.simulator import simulate

B = 512


def _problem(
    rows_per_second: float | None = None, alphas=(1.0, 1.0, 1.0), shards: int = 1, overhead: float = 1.0
):
    """Three layers on two types; `overhead` scales every fixed cost and latency."""
    ps = {"resource": "a", "min_shards": shards}
    if rows_per_second is not None:
        ps["rows_per_second_per_shard"] = rows_per_second
    return problem_from_dict(
        {
            "name": "sim",
            "batch_size": B,
            "samples": 1e7,
            "throughput_min": 0,
            "input_bytes_per_sample": 200,
            "resources": [
                {"name": "a", "price_per_hour": 1, "max_instances": 8, "bandwidth_gbps": 10, "latency_ms": 0.2 * overhead, "io_bandwidth_gbps": 2},
                {"name": "b", "price_per_hour": 3, "max_instances": 8, "bandwidth_gbps": 25, "latency_ms": 0.1 * overhead},
            ],
            "ps": ps,
            "layers": [
                {"name": "emb", "out_bytes_per_sample": 1000, "sparse_rows_per_sample": 26, "parallel_fraction": alphas[0],
                 "time_ms": {"a": {"fixed": 0.4 * overhead, "per_sample": 0.010}, "b": {"fixed": 1.0 * overhead, "per_sample": 0.004}}},
                {"name": "fc1", "out_bytes_per_sample": 2048, "parallel_fraction": alphas[1],
                 "time_ms": {"a": {"fixed": 0.2 * overhead, "per_sample": 0.030}, "b": {"fixed": 0.3 * overhead, "per_sample": 0.006}}},
                {"name": "fc2", "out_bytes_per_sample": 4, "parallel_fraction": alphas[2],
                 "time_ms": {"a": {"fixed": 0.2 * overhead, "per_sample": 0.012}, "b": {"fixed": 0.3 * overhead, "per_sample": 0.002}}},
            ],
        }
    )  # fmt: skip


def _plan(problem, assignment, replicas, shards=1):
    model = CostModel(problem)
    stages = model.split_stages(assignment)
    plan = {
        "stages": [
            {"layers": problem.layer_names[s:e], "type": problem.type_names[t], "replicas": k}
            for (s, e, t), k in zip(stages, replicas, strict=True)
        ],
        "ps_shards": shards,
    }
    return plan, model.evaluate(assignment, replicas, shards)


@pytest.mark.parametrize(
    "assignment",
    [["a", "a", "a"], ["a", "b", "b"], ["a", "b", "a"], ["b", "a", "a"], ["a", "a", "b"]],
)
def test_one_replica_per_stage_unbounded_matches_the_analytic_bottleneck(assignment):
    problem = _problem()
    plan, analytic = _plan(problem, assignment, [1] * len(CostModel(problem).split_stages(assignment)))
    # DESIGN.md §3 charges a message's latency to both actors: so does the simulator when told to
    result = simulate(
        problem, plan, batches=200, mode="async", max_in_flight=None, ps_limit=False, latency_in_flight=False
    )
    assert result.throughput == pytest.approx(analytic.throughput, rel=0.02)
    bottleneck = int(np.argmin([s.throughput for s in analytic.stages]))
    assert result.utilisation[bottleneck] == pytest.approx(1.0, abs=0.03)
    # by default the latency is spent in flight: the pipeline is at least as fast, the bottleneck as busy
    in_flight = simulate(problem, plan, batches=200, mode="async", max_in_flight=None, ps_limit=False)
    assert in_flight.throughput >= result.throughput * 0.999
    assert in_flight.utilisation[bottleneck] == pytest.approx(1.0, abs=0.03)


def test_latency_in_flight_delays_a_sync_batch_but_occupies_no_actor():
    problem = _problem()
    plan, _ = _plan(problem, ["a", "b", "b"], [1, 1])
    busy = simulate(problem, plan, batches=20, mode="sync", latency_in_flight=False)
    flight = simulate(problem, plan, batches=20, mode="sync")
    # one batch at a time: the chain is as long either way (each message's two latencies)
    assert flight.makespan_ms == pytest.approx(busy.makespan_ms, rel=1e-6)
    # ... but the actors are busy for less of it
    assert flight.utilisation[1] < busy.utilisation[1]


@pytest.mark.parametrize(("assignment", "calls"), [(["a", "b", "b"], 1), (["a", "b", "a"], 3)])
def test_call_overhead_is_spent_by_the_receiving_stage_on_each_call(assignment, calls):
    problem = _problem()
    plan, _ = _plan(problem, assignment, [1] * len(CostModel(problem).split_stages(assignment)))
    slow = problem.model_copy(
        update={"resources": tuple(r.model_copy(update={"call_overhead_ms": 2.0}) for r in problem.resources)}
    )
    base = simulate(problem, plan, batches=20, mode="sync")
    charged = simulate(slow, plan, batches=20, mode="sync")
    # sync runs one batch at a time: each StageWorker call (forward, backward, forward_backward) of
    # each batch is 2 ms longer; the DataWorker receives no calls
    assert charged.makespan_ms - base.makespan_ms == pytest.approx(20 * calls * 2.0, rel=1e-6)
    spans = charged.spans
    assert (
        spans[spans["stage"] == 0]["end_ms"] - spans[spans["stage"] == 0]["start_ms"]
    ).sum() == pytest.approx(
        (
            base.spans[base.spans["stage"] == 0]["end_ms"] - base.spans[base.spans["stage"] == 0]["start_ms"]
        ).sum()
    )


def test_a_stage_shares_its_layers_fixed_costs():
    problem = _problem()
    plan, _ = _plan(problem, ["a", "a", "a"], [1])
    fused = problem.model_copy(
        update={"resources": tuple(r.model_copy(update={"fused_saving_ms": 0.1}) for r in problem.resources)}
    )
    base = simulate(problem, plan, batches=20, mode="sync", ps_limit=False)
    less = simulate(fused, plan, batches=20, mode="sync", ps_limit=False)
    # one stage of three layers: two of them 0.1 ms cheaper, every batch
    assert base.makespan_ms - less.makespan_ms == pytest.approx(20 * 2 * 0.1, rel=1e-6)
    # never below its slowest layer alone
    huge = problem.model_copy(
        update={"resources": tuple(r.model_copy(update={"fused_saving_ms": 1e6}) for r in problem.resources)}
    )
    slowest = max(layer.time_ms["a"].fixed + layer.time_ms["a"].per_sample * B for layer in problem.layers)
    assert simulate(huge, plan, batches=1, ps_limit=False).stages[0].forward_ms == pytest.approx(slowest / 3)


def test_replicas_scale_as_amdahl_says():
    problem = _problem(alphas=(0.8, 0.8, 0.8))
    plan, analytic = _plan(problem, ["a", "a", "a"], [4])
    result = simulate(problem, plan, batches=200, mode="async", ps_limit=False)
    assert result.throughput == pytest.approx(analytic.throughput, rel=0.02)
    one, _ = _plan(problem, ["a", "a", "a"], [1])
    alone = simulate(problem, one, batches=200, mode="async", ps_limit=False)
    assert result.throughput / alone.throughput == pytest.approx(1 / (0.2 + 0.8 / 4), rel=0.02)


def test_bounded_in_flight_gives_backpressure():
    problem = _problem()
    plan, analytic = _plan(problem, ["a", "b", "a"], [1, 1, 1])
    unbounded = simulate(problem, plan, batches=100, mode="async", max_in_flight=None, ps_limit=False)
    bounded = simulate(problem, plan, batches=100, mode="async", max_in_flight=2, ps_limit=False)
    serial = simulate(problem, plan, batches=100, mode="async", max_in_flight=1, ps_limit=False)
    # Unbounded, every micro-batch is in flight at once and the last stage's queue grows without limit.
    assert unbounded.queues["in_flight"].max() == 100
    assert bounded.queues["in_flight"].max() <= 2
    # a stage holds at most a forward and a backward call per micro-batch in flight
    assert bounded.summary()["max_queue"].max() <= 2 * 2
    # One in flight: no overlap but the next batch's read (as the DataWorker reads before it waits),
    # so a batch takes the sum of all stage times less the read.
    read_ms = 200 * B / (2 * 125_000)
    serial_expected = 1000.0 * B / (sum(s.tau_ms for s in analytic.stages) - read_ms)
    assert serial.throughput == pytest.approx(serial_expected, rel=0.01)
    assert serial.throughput < bounded.throughput <= unbounded.throughput * 1.001


def test_sync_barrier_serialises_batches_and_micro_batches_win_some_back():
    problem = _problem(rows_per_second=2e6)
    plan, analytic = _plan(problem, ["a", "b", "b"], [1, 1])
    sync = simulate(problem, plan, batches=40, mode="sync", micro_batches=1)
    # Per batch: the pull of all rows, both stages' work one after the other (tau_0 includes the
    # read), then the push, which overlaps the next batch's read.
    rows = B * 26
    pull_ms = rows * 0.5 / 2e6 * 1000
    push_ms = rows * 0.5 / 2e6 * 1000
    read_ms = 200 * B / (2 * 125_000)
    per_batch = max(read_ms, push_ms) + pull_ms + sum(s.tau_ms for s in analytic.stages) - read_ms
    assert sync.throughput == pytest.approx(1000.0 * B / per_batch, rel=0.02)
    assert sync.throughput < 0.6 * analytic.throughput  # the analytic model pipelines across batches
    # With little per-call overhead, micro-batches overlap the two stages (GPipe) and win time back.
    lean = _problem(rows_per_second=2e6, overhead=0.0)
    lean_plan, _ = _plan(lean, ["a", "b", "b"], [1, 1])
    one = simulate(lean, lean_plan, batches=40, mode="sync", micro_batches=1)
    gpipe = simulate(lean, lean_plan, batches=40, mode="sync", micro_batches=8)
    assert gpipe.throughput > 1.2 * one.throughput
    asynchronous = simulate(problem, plan, batches=40, mode="async")
    assert asynchronous.throughput > sync.throughput


def test_ps_shards_are_shared_and_limit_throughput():
    problem = _problem(rows_per_second=1e6)
    plan, analytic = _plan(problem, ["a", "b", "b"], [4, 1], shards=1)
    one = simulate(problem, plan, batches=80, mode="async")
    assert analytic.throughput == pytest.approx(analytic.ps_throughput)  # PS-bound by the analytic model
    assert one.throughput <= analytic.ps_throughput * 1.01
    assert one.ps_utilisation > 0.9
    plan2, analytic2 = _plan(problem, ["a", "b", "b"], [4, 1], shards=2)
    two = simulate(problem, plan2, batches=80, mode="async")
    assert two.throughput > 1.5 * one.throughput
    free = simulate(problem, plan, batches=80, mode="async", ps_limit=False)
    assert free.throughput > two.throughput


def test_timeline_and_queues_are_consistent():
    problem = _problem(rows_per_second=3e6)
    plan, _ = _plan(problem, ["a", "b", "a"], [2, 2, 1], shards=2)
    result = simulate(problem, plan, batches=30, mode="async", micro_batches=2)
    spans = result.spans
    assert set(spans.columns) == {"start_ms", "end_ms", "stage", "replica", "kind", "batch", "micro_batch"}
    for (stage, _replica), group in spans.groupby(["stage", "replica"]):
        group = group.sort_values("start_ms")
        # an actor (or a PS shard) does one thing at a time
        assert (group["start_ms"].to_numpy()[1:] >= group["end_ms"].to_numpy()[:-1] - 1e-9).all(), stage
    assert set(spans.loc[spans["stage"] == -1, "kind"]) == {"pull", "push"}
    assert result.samples == 30 * B
    assert all(0.0 < u <= 1.0 for u in result.utilisation)
    assert 0.0 < result.ps_utilisation <= 1.0
    summary = result.summary()
    assert list(summary["stage"]) == [0, 1, 2] and list(summary["replicas"]) == [2, 2, 1]
    assert (result.queues["time_ms"].diff().dropna() >= 0).all()


def test_async_dense_pushes_load_the_ps():
    problem = _problem(rows_per_second=1e7)
    plan, _ = _plan(problem, ["a", "b", "b"], [2, 1])
    plain = simulate(problem, plan, batches=40, mode="async")
    dense = simulate(
        problem,
        plan,
        batches=40,
        mode="async",
        dense_ms_per_param=1e-5,
        dense_params={"fc1": 500_000, "fc2": 1000},
    )
    assert dense.throughput < plain.throughput
    assert any(k.startswith("dense") for k in dense.spans["kind"])
    synced = simulate(
        problem, plan, batches=40, mode="sync", dense_ms_per_param=1e-5, dense_params={"fc1": 500_000}
    )
    assert not any(k.startswith("dense") for k in synced.spans["kind"])  # sync steps locally


def test_plan_object_gives_the_same_result_as_its_json():
    from heterps_ray.costmodel import Plan

    problem = _problem(rows_per_second=2e6)
    plan, evaluation = _plan(problem, ["a", "b", "b"], [1, 1])
    obj = Plan.from_evaluation(problem, evaluation, "manual")
    a = simulate(problem, obj, batches=10)
    b = simulate(problem, json.loads(obj.to_json()), batches=10)
    assert a.throughput == b.throughput


def test_simulate_command_prints_both_models(tmp_path, capsys):
    problem = _problem(rows_per_second=2e6)
    plan, evaluation = _plan(problem, ["a", "b", "b"], [1, 1])
    problem_file = problem.save(tmp_path / "problem.yaml")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    timeline = tmp_path / "timeline.csv"
    code = main(["simulate", "--problem", str(problem_file), "--plan", str(plan_file), "--batches", "8",
                 "--micro-batches", "4", "--timeline", str(timeline)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "simulator" in out and f"analytic model {evaluation.throughput:,.0f} samples/s" in out
    assert timeline.exists()
    plan["stages"][1]["layers"] = ["fc2", "fc1"]
    plan_file.write_text(json.dumps(plan))
    assert main(["simulate", "--problem", str(problem_file), "--plan", str(plan_file)]) == 2
    assert "stages.1.layers" in capsys.readouterr().err


def test_runtime_details_startup_push_work_and_chunk_drains_cost_time():
    problem = _problem(rows_per_second=2e6)
    plan, _ = _plan(problem, ["a", "b", "a"], [1, 1, 1])
    base = simulate(problem, plan, batches=40, mode="async")
    started = simulate(problem, plan, batches=40, mode="async", startup_ms=500.0)
    assert started.makespan_ms == pytest.approx(base.makespan_ms + 500.0, rel=1e-9)
    # summing gradients on the DataWorker moves push time from the shards onto stage 0
    client = simulate(problem, plan, batches=40, mode="async", push_client_share=0.5)
    assert client.utilisation[0] * client.makespan_ms > base.utilisation[0] * base.makespan_ms
    assert client.ps_utilisation * client.makespan_ms < base.ps_utilisation * base.makespan_ms
    # the driver's chunks drain the pipeline (every 20 batches in the runtime): nothing stays in flight
    drained = simulate(problem, plan, batches=40, mode="async", drain_every=5)
    assert drained.throughput != base.throughput
    stage0 = drained.queues[drained.queues["stage"] == 0]
    emptied = ((stage0["in_flight"] == 0) & (stage0["in_flight"].shift(fill_value=0) > 0)).sum()
    assert emptied >= 40 // 5
