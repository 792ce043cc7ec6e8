"""The table in a GPU's memory, end to end on a real local Ray: a plan whose stage 0 runs on a ``cuda``
type keeps its rows in that DataWorker's device memory (ps/device_table.py), here with the cuda type on
the CPU under the explicit test flag (the same tensor code). A sync run through it trains the reference
trainer's model: its losses within 1e-5 over 100 batches, its rows those of the CPU store; a checkpoint
and a resume, a killed DataWorker and a shard killed inside a checkpoint end as the undisturbed run; a
table 4x over the GPU budget trains through the cache to the same model, with its hit rate in the run
summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fault_injection import PhaseKiller

from heterps_ray.config import JobConfig, load_cluster
from heterps_ray.costmodel.plan import Plan
from heterps_ray.costmodel.table_memory import table_place
from heterps_ray.data.dataset import Dataset
from heterps_ray.devices import CUDA_AS_CPU_VAR
from heterps_ray.profiling.probes import PROBE_WARMUP
from heterps_ray.ps.row_bytes import device_row_bytes
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import RunSummary, train
from heterps_ray.runtime.reference import ReferenceTrainer

REPO = Path(__file__).resolve().parents[1]
GPU = "gpu_t4"  # declared by the session Ray (conftest.py): 2 GPUs, no CUDA behind them
MODEL = {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]}
BATCH, STEPS = 64, 100


@pytest.fixture(autouse=True)
def cuda_on_the_cpu(monkeypatch):
    monkeypatch.setenv(CUDA_AS_CPU_VAR, "1")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("gpu_table") / "data"
    synthesize(path, 7_200, seed=5, rows_per_part=3_600)  # 6,480 train rows: 101 batches of 64
    return path


def _job(dataset: Path, output: Path, gpu_memory_gb: float | None = None, **runtime: Any) -> JobConfig:
    local = load_cluster(REPO / "configs" / "clusters" / "local.yaml").model_dump()
    gpu = {"name": GPU, "device": "cuda", "price_per_hour": 0.5, "max_instances": 1,
           "ray_resources": {"CPU": 0.25}, "num_gpus": 1, "gpu_memory_gb": gpu_memory_gb}  # fmt: skip
    cluster = {**local, "name": "local-with-gpu", "resource_types": [*local["resource_types"], gpu]}
    return JobConfig.model_validate({
        "name": "gpu-table", "model": MODEL, "cluster": cluster, "data": {"path": str(dataset)},
        "batch_size": BATCH, "samples": 10_000, "throughput_min": 0, "mode": "sync",
        "output_dir": str(output), "seed": 3, "runtime": {"max_in_flight": 2, **runtime},
    })  # fmt: skip


def _plan(stages: list[tuple[list[str], str]]) -> Plan:
    return Plan.from_dict({
        "problem": "gpu table", "assignment": [t for layers, t in stages for _ in layers], "ps_shards": 1,
        "ps_type": "cpu_small", "stages": [{"layers": ls, "type": t, "replicas": 1} for ls, t in stages],
        "throughput": None, "cost": None, "cost_rate": 0.0, "feasible": True, "scheduler": "manual",
        "seconds": 0.0,
    })  # fmt: skip


ONE_STAGE = _plan([(["embedding", "fc1", "fc2", "logit"], GPU)])
TWO_STAGES = _plan([(["embedding", "fc1"], GPU), (["fc2", "logit"], "cpu_small")])


def _rows(summary: RunSummary) -> dict[str, np.ndarray]:
    return load_checkpoint(Path(summary.output_dir or "") / "model").table.state()


def _same_rows(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = 0.0) -> None:
    np.testing.assert_array_equal(a["keys"], b["keys"])
    for field in ("weights", "accumulators"):
        np.testing.assert_allclose(a[field], b[field], rtol=0, atol=atol, err_msg=field)


@pytest.fixture(scope="module")
def reference(dataset) -> tuple[list[float], dict[str, np.ndarray]]:
    """The one-process reference trainer on the same job: its losses and its table's rows."""
    trainer = ReferenceTrainer.for_job(_job(dataset, dataset.parent / "unused"))
    history = trainer.fit(Dataset(dataset), BATCH, steps=STEPS, progress=False)
    return history["loss"], trainer.table.state()


@pytest.fixture(scope="module")
def in_gpu_memory(ray_local, dataset, tmp_path_factory) -> RunSummary:
    """The undisturbed sync run with every row in the GPU tier (one stage on the cuda type)."""
    import os

    os.environ[CUDA_AS_CPU_VAR] = "1"  # module-scoped: before the function-scoped flag exists
    out = tmp_path_factory.mktemp("gpu_all")
    return train(_job(dataset, out, checkpoint_every=20), ONE_STAGE, steps=STEPS, progress=False)


def test_the_rows_go_to_the_cuda_types_memory_where_one_dataworker_hosts_the_shards(dataset, tmp_path):
    job = _job(dataset, tmp_path, gpu_memory_gb=1.0)
    assert table_place(job, GPU, True, None, 4).place == "gpu"
    assert table_place(job, "cpu_small", True, None, 4).place == "ps"
    assert table_place(job, GPU, False, None, 4).place == "ps"  # several DataWorkers would hold copies
    off = job.model_copy(update={"runtime": job.runtime.model_copy(update={"gpu_table": "off"})})
    assert table_place(off, GPU, True, None, 4).place == "ps"
    ttl = job.model_copy(update={"table": job.table.model_copy(update={"ttl_batches": 50})})
    assert table_place(ttl, GPU, True, None, 4).place == "ps"  # the shards expire rows the GPU holds


def test_a_sync_run_with_its_rows_in_gpu_memory_trains_the_reference_model(in_gpu_memory, reference):
    losses, rows = reference
    assert len(in_gpu_memory.losses) == STEPS
    np.testing.assert_allclose(in_gpu_memory.losses, losses, rtol=0, atol=1e-5)
    _same_rows(_rows(in_gpu_memory), rows, atol=1e-6)
    table = in_gpu_memory.extra["table"]
    assert table["tier"] == "gpu" and table["evicted"] == 0 and table["hit_rate"] > 0.5
    extra = in_gpu_memory.extra
    assert (extra["batches_applied"], extra["batches_lost"], extra["batches_duplicated"]) == (STEPS, 0, 0)


def test_the_same_plan_with_rows_on_the_cpu_trains_the_same_rows(ray_local, dataset, tmp_path, in_gpu_memory):
    job = _job(dataset, tmp_path, gpu_table="off")
    on_cpu = train(job, ONE_STAGE, steps=STEPS, progress=False)
    assert on_cpu.extra["table"]["tier"] == "ps"
    np.testing.assert_allclose(on_cpu.losses, in_gpu_memory.losses, rtol=0, atol=1e-6)
    _same_rows(_rows(on_cpu), _rows(in_gpu_memory), atol=1e-6)


def test_a_two_stage_plan_with_stage_0_on_the_gpu_trains_the_reference_model(
    ray_local, dataset, tmp_path, reference
):
    summary = train(_job(dataset, tmp_path), TWO_STAGES, steps=STEPS, progress=False)
    assert summary.extra["table"]["tier"] == "gpu"
    np.testing.assert_allclose(summary.losses, reference[0], rtol=0, atol=1e-5)
    _same_rows(_rows(summary), reference[1], atol=1e-6)


def test_a_checkpointed_run_resumed_equals_the_uninterrupted_one(ray_local, dataset, tmp_path, in_gpu_memory):
    job = _job(dataset, tmp_path, checkpoint_every=20)
    train(job, ONE_STAGE, steps=STEPS // 2, progress=False)  # the driver stops after its checkpoint at 40
    resumed = train(job, ONE_STAGE, steps=STEPS, progress=False, resume=True)
    assert resumed.extra["resumed_from"]["step"] == STEPS // 2
    np.testing.assert_allclose(resumed.losses[-10:], in_gpu_memory.losses[-10:], rtol=0, atol=1e-6)
    _same_rows(_rows(resumed), _rows(in_gpu_memory), atol=1e-6)


@pytest.mark.parametrize("point", ["train", "checkpoint"])
def test_a_killed_dataworker_ends_the_run_as_the_undisturbed_one(
    ray_local, dataset, tmp_path, in_gpu_memory, point
):
    """The DataWorker holds the rows in its GPU's memory and the shards behind them: killed mid-chunk,
    or inside a checkpoint (after its rows went back to the shards, before they were written), it takes
    both with it; the run rolls back to the checkpoint before, the tier starts empty, and it replays to
    the undisturbed model."""
    kind = "data_worker"
    killer = PhaseKiller(kind, point, "sigkill", at=40, flag_dir=str(tmp_path))
    job = _job(dataset, tmp_path / "out", checkpoint_every=20)
    summary = train(job, ONE_STAGE, steps=STEPS, progress=False, on_chunk=killer)
    (fault,) = summary.extra["faults"]
    assert [a["kind"] for a in fault["actors"]] == [kind]
    extra = summary.extra
    assert (extra["batches_applied"], extra["batches_lost"], extra["batches_duplicated"]) == (STEPS, 0, 0)
    np.testing.assert_allclose(summary.losses, in_gpu_memory.losses, rtol=0, atol=1e-6)
    _same_rows(_rows(summary), _rows(in_gpu_memory), atol=1e-6)
    assert summary.auc == pytest.approx(in_gpu_memory.auc, abs=1e-6)


def test_a_table_four_times_over_the_gpu_budget_trains_the_same_model_through_the_cache(
    ray_local, dataset, tmp_path, in_gpu_memory
):
    rows = len(_rows(in_gpu_memory)["keys"])
    budget = rows / 4 * 1.5 * device_row_bytes(4) / 2**30  # the tier holds a quarter of the rows
    job = _job(dataset, tmp_path, gpu_memory_gb=budget)
    cached = train(job, ONE_STAGE, steps=STEPS, progress=False)
    table = cached.extra["table"]
    assert table["tier"] == "gpu_cache" and table["evicted"] > 0 and table["rows_held"] <= rows // 4
    assert 0.0 < table["hit_rate"] < in_gpu_memory.extra["table"]["hit_rate"]
    np.testing.assert_allclose(cached.losses, in_gpu_memory.losses, rtol=0, atol=1e-6)
    _same_rows(_rows(cached), _rows(in_gpu_memory), atol=1e-6)


@pytest.mark.parametrize("first,then", [(ONE_STAGE, "cpu_small"), ("cpu_small", ONE_STAGE)])
def test_a_re_plan_moves_the_table_between_the_gpu_and_the_cpu(
    ray_local, dataset, tmp_path, in_gpu_memory, first, then
):
    """A run stopped at a checkpoint resumes under another plan (an elastic or floor re-plan does so):
    from the rows in GPU memory to a plan on a CPU type, and back. The checkpoint is the shards', so
    either way the run ends with the undisturbed model."""
    on_cpu = _plan([(["embedding", "fc1", "fc2", "logit"], "cpu_small")])
    plans = [on_cpu if p == "cpu_small" else p for p in (first, then)]
    job = _job(dataset, tmp_path, checkpoint_every=20)
    head = train(job, plans[0], steps=STEPS // 2, progress=False)
    tail = train(job, plans[1], steps=STEPS, progress=False, resume=True)
    assert {head.extra["table"]["tier"], tail.extra["table"]["tier"]} == {"gpu", "ps"}
    assert tail.extra["resumed_from"]["plan_changed"]
    np.testing.assert_allclose(tail.losses[-10:], in_gpu_memory.losses[-10:], rtol=0, atol=1e-6)
    _same_rows(_rows(tail), _rows(in_gpu_memory), atol=1e-6)


def test_the_profile_prices_the_gpu_tier_and_the_plan_says_where_the_table_lives(
    ray_local, dataset, tmp_path
):
    """A (quick) profile of a cluster with a cuda type measures its GPU tier (the per-row cost with the
    rows held, and for rows taken and given back) and the rows its memory holds; the model prices a plan
    on it with the rows there, each row's first lookup from the shards, and the printed plan says so
    instead of a shard actor's rate. Its one-stage probe starts from an empty tier and counts the cold
    misses (rows fetched from the shards) of its steady batches, for the fit to price apart (test_fit.py)."""
    from heterps_ray.closedloop.probes import profile_job
    from heterps_ray.costmodel import CostModel, problem_from_dict
    from heterps_ray.profiling.profiler import ProfileSettings

    job = _job(dataset, tmp_path, gpu_memory_gb=0.01)
    settings = ProfileSettings.quick(progress=False, probe_steps=24, probe_repeats=1, probe_extra=0)
    fitted = profile_job(job, settings)
    problem = problem_from_dict(fitted.problem)
    terms, table = problem.runtime, problem.ps.table
    assert terms is not None and table is not None
    assert set(terms.gpu_table_ms_per_row) == set(terms.gpu_miss_ms_per_row) == {GPU}
    assert terms.gpu_table_ms_per_row[GPU] > 0 and terms.gpu_miss_ms_per_row[GPU] > 0
    assert table.gpu_rows[GPU] == int(0.01 * 2**30 // (1.5 * device_row_bytes(4)))
    lookups = job.samples * sum(layer.sparse_rows_per_sample for layer in problem.layers)
    assert table.gpu_hit_rate[GPU] == pytest.approx(1.0 - table.rows / lookups)  # fits: cold misses only
    on_gpu = CostModel(problem).evaluate([GPU] * 4, [1], 1)
    assert on_gpu.runtime is not None and on_gpu.runtime.table.place == "gpu"
    probe = fitted.measurements.query(f"kind == 'probe' and resource == '{GPU}' and peer == ''").iloc[0]
    assert (
        probe["rows"] > 0 and probe["calls"] == 24 - PROBE_WARMUP
    )  # its tier's fetched rows, steady batches
    shown = Plan.from_evaluation(problem, on_gpu, "manual").table()
    assert "GPU memory (all rows)" in shown and "(parameter server)" not in shown
