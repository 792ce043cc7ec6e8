"""Async mode on a real local Ray: replicas of a stage share the work (M DataWorkers : N replicas),
dense weights live on the PS with bounded staleness, and the model reaches the AUC of sync."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from heterps_ray.config import JobConfig, load_cluster
from heterps_ray.costmodel.plan import Plan, load_plan
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import train

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "configs" / "plans"
CLUSTER = REPO / "configs" / "clusters" / "local.yaml"
MODEL = {"name": "ctr_dnn", "embedding_dim": 8, "hidden": [64, 32]}  # layers: embedding, fc1, fc2, logit

# The AUC bounds (docs/DESIGN.md "Staleness") on one epoch of the quickstart's size.
AUC_ROWS = 200_000


def make_job(data: Path, output: Path, mode: str, batch_size: int, **runtime) -> JobConfig:
    return JobConfig.model_validate(
        {
            "name": f"{mode}-test",
            "model": MODEL,
            "cluster": load_cluster(CLUSTER).model_dump(),
            "data": {"path": str(data)},
            "batch_size": batch_size,
            "samples": 1_000_000,
            "throughput_min": 0,
            "mode": mode,
            "output_dir": str(output),
            "seed": 1,
            "optimizer": {"dense_lr": 0.002, "sparse_lr": 0.05},
            "runtime": {"micro_batches": 1, "max_in_flight": 4, **runtime},
        }
    )


def m_to_n_plan() -> Plan:
    """2 DataWorkers (stage 0 replicas) feeding 2 replicas of fc1-fc2 feeding one logit stage."""
    raw = load_plan(PLANS / "small_async.json").to_dict()
    raw["stages"][0]["replicas"] = 2
    return Plan.from_dict(raw)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("runtime_async") / "data"
    synthesize(path, 12_000, seed=4, rows_per_part=2_500)  # 5 train parts
    return path


def test_async_m_to_n_replicas_share_work_with_bounded_staleness(ray_local, small_data, tmp_path):
    steps, staleness = 20, 2
    job = make_job(small_data, tmp_path, "async", 64, micro_batches=2, max_staleness=staleness)
    summary = train(job, m_to_n_plan(), steps=steps, progress=False)
    micro_batches = steps * 2
    assert summary.steps == steps and len(summary.losses) == steps
    assert np.all(np.isfinite(summary.losses))
    data_stage, fc_stage, logit_stage = summary.stages
    assert data_stage["replicas"] == 2 and fc_stage["replicas"] == 2
    # round robin: each of the 2 DataWorkers did half the batches, each fc replica half the micro-batches
    assert [r["samples"] for r in data_stage["replica_stats"]] == [steps // 2 * 64] * 2
    assert [r["forward"] for r in fc_stage["replica_stats"]] == [micro_batches // 2] * 2
    assert logit_stage["replica_stats"][0]["forward"] == micro_batches
    # the replicated stage's weights live on the PS: every micro-batch's gradient reached it and the
    # replicas took fresh weights when too stale; the single logit replica keeps its weights local
    (shard,) = summary.ps
    assert shard["dense_versions"] == {"stage1": micro_batches}
    for replica in fc_stage["replica_stats"]:
        assert replica["dense_pulls"] >= 2 and replica["dense_max_lag"] <= staleness
    assert "dense_pulls" not in logit_stage["replica_stats"][0]
    assert logit_stage["replica_stats"][0]["updates"] == micro_batches
    placed = [p for p in summary.placement if p["role"] == "stage" and p["stage"] == 1]
    assert len(placed) == 2 and all(p["resources"].get("cpu_big") == 1.0 for p in placed)
    assert len({p["pid"] for p in summary.placement}) == len(summary.placement)
    # the saved model is the PS's newest weights: it predicts what the pipeline evaluated
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.runtime.evaluation import evaluate_logits

    eval_batch = Dataset(small_data).load("eval")
    metrics = evaluate_logits(eval_batch["label"], load_checkpoint(tmp_path / "model").predict(eval_batch))
    assert metrics["auc"] == pytest.approx(summary.auc, abs=1e-6)


def test_async_with_one_data_worker_and_one_replica_per_stage_trains_like_sync(
    ray_local, small_data, tmp_path
):
    """Nothing runs in parallel: async (batches_ahead 0) applies each batch before the next, as sync."""
    steps = 30
    plan = load_plan(PLANS / "small_three_stage.json")
    sync = train(make_job(small_data, tmp_path / "sync", "sync", 64), plan, steps=steps, progress=False)
    run = train(make_job(small_data, tmp_path / "async", "async", 64), plan, steps=steps, progress=False)
    np.testing.assert_allclose(run.losses, sync.losses, rtol=0, atol=1e-5)
    assert abs(run.auc - sync.auc) < 0.002


@pytest.mark.slow
@pytest.mark.parametrize("workers,replicas", [(2, 1), (1, 2)])
def test_async_with_several_data_workers_or_replicas_stays_within_0_005_auc_of_sync(
    ray_local, auc_data, workers, replicas
):
    """Several DataWorkers (sharing the PS) or replicas of the dense stage (weights on the PS): the
    only staleness is their concurrency; one epoch, the same samples as sync."""
    data, sync = auc_data
    raw = load_plan(PLANS / "small_three_stage.json").to_dict()
    raw["stages"][0]["replicas"] = workers
    raw["stages"][1]["replicas"] = replicas
    raw["ps_shards"] = 1
    out = data.parent / f"async-{workers}-{replicas}"
    run = train(
        make_job(data, out, "async", 512, micro_batches=replicas), Plan.from_dict(raw), progress=False
    )
    print(f"{workers} DataWorkers, {replicas} replicas: async AUC {run.auc:.4f}, sync {sync.auc:.4f}")
    assert run.samples == sync.samples
    assert abs(run.auc - sync.auc) < 0.005


@pytest.fixture(scope="module")
def auc_data(ray_local, tmp_path_factory) -> tuple[Path, Any]:
    """The quickstart's size (200k rows, 180k train: 351 batches of 512) and the sync run on it."""
    from heterps_ray.data.synth import synthesize

    root = tmp_path_factory.mktemp("async_auc")
    meta = synthesize(root / "data", AUC_ROWS, seed=0, rows_per_part=50_000)
    sync = train(
        make_job(root / "data", root / "sync", "sync", 512),
        load_plan(PLANS / "small_three_stage.json"),
        progress=False,
    )
    assert sync.auc > meta["achievable_auc"] - 0.05  # it really learned
    return root / "data", sync


def _one_stage_plan(shards: int) -> Plan:
    """Every layer in one cpu_small stage (one DataWorker): all dense weights local, PS shards hosted."""
    raw = load_plan(PLANS / "small_async.json").to_dict()
    raw["assignment"] = ["cpu_small"] * 4
    raw["stages"] = [{"layers": ["embedding", "fc1", "fc2", "logit"], "type": "cpu_small", "replicas": 1}]
    raw["ps_shards"] = shards
    return Plan.from_dict(raw)


@pytest.mark.slow  # six short runs (~50 s)
def test_async_resume_under_another_plan_moves_dense_state_by_layer_name(ray_local, small_data, tmp_path):
    """A re-plan in async mode: the checkpoint of a plan whose fc1..fc2 weights live on a PS shard
    (2 replicas) resumes as one stage with every weight local and 2 PS shards, and back again. The
    weights, the Adam moments and their step counts, the sparse rows and the data position carry over."""
    from heterps_ray.ps.atomic import read_npz
    from heterps_ray.runtime.checkpoint import CHECKPOINTS_DIR

    stop = 12
    replicated = load_plan(PLANS / "small_async.json")  # embedding | fc1..fc2 x2 (weights on the PS) | logit
    job = make_job(small_data, tmp_path, "async", 64, checkpoint_every=stop)
    first = train(job, replicated, steps=stop, progress=False)
    assert first.ps[0]["dense_versions"] == {"stage1": stop}
    ckpt = tmp_path / CHECKPOINTS_DIR / f"step-{stop:08d}"
    table = read_npz(ckpt / "ps-shard-00000.npz")
    logit_file = read_npz(ckpt / "stage2-replica000.npz")

    # resumed as one stage without training: the model is the checkpoint's, by layer name
    same = train(job, _one_stage_plan(2), steps=stop, progress=False, resume=True)
    assert same.extra["resumed_from"] == {
        "checkpoint": str(ckpt),
        "step": stop,
        "skipped": [],
        "plan_changed": True,
    }
    model = read_npz(tmp_path / "model" / "dense.npz")
    fc1 = [k for k in model if k.startswith("fc1.")]
    assert fc1 and all(np.array_equal(model[k], table[f"dense/stage1/param/{k}"]) for k in fc1)
    logit = [k for k in model if k.startswith("logit.")]
    assert logit and all(np.array_equal(model[k], logit_file[f"param/{k}"]) for k in logit)
    assert len(same.ps) == 2  # re-sharded 1 -> 2, every row kept
    assert sum(sum(s["rows"].values()) for s in same.ps) == sum(first.ps[0]["rows"].values())

    # trained on: the local Adam of fc1 goes on from the PS table's step, stage 0's from its own
    on = train(job, _one_stage_plan(2), steps=2 * stop, progress=False, resume=True)
    assert on.steps == 2 * stop and np.all(np.isfinite(on.losses))
    worker = read_npz(tmp_path / CHECKPOINTS_DIR / f"step-{2 * stop:08d}" / "data-000.npz")
    assert int(worker["data/batch_index"]) == 2 * stop
    steps = {k.split("/")[1].split(".")[0]: float(v) for k, v in worker.items() if k.endswith("/step")}
    assert set(steps) == {"fc1", "fc2", "logit"} and set(steps.values()) == {2.0 * stop}, steps

    # and back: fc1..fc2 on a PS shard again, its table's Adam step and weights from the local ones
    back = train(job, replicated, steps=2 * stop, progress=False, resume=True)
    assert back.ps[0]["dense_versions"] == {"stage1": 2 * stop}
    model = read_npz(tmp_path / "model" / "dense.npz")
    assert all(np.array_equal(model[k], worker[f"param/{k}"]) for k in model if not k.startswith("embedding"))

    # and onto two DataWorkers: each resumes at the fraction of the data the one had done, of its own
    # partitions (every other train file), so the epoch goes on where it was
    import pyarrow.parquet as pq

    from heterps_ray.data.dataset import Dataset

    files = sorted(Dataset(small_data).files("train"))
    batches = [
        sum(pq.ParquetFile(f).metadata.num_rows for f in files[i::n]) // 64 for n in (1, 2) for i in range(n)
    ]
    skips = [int(2 * stop / batches[0] * b) for b in batches[1:]]
    more = train(job, m_to_n_plan(), steps=3 * stop, progress=False, resume=True)
    assert (
        more.steps == 3 * stop
        and np.all(np.isfinite(more.losses))
        and more.extra["resumed_from"]["plan_changed"]
    )
    ckpt = tmp_path / CHECKPOINTS_DIR / f"step-{3 * stop:08d}"
    positions = [int(read_npz(ckpt / f"data-{i:03d}.npz")["data/batch_index"]) for i in range(2)]
    assert positions == [skip + stop // 2 for skip in skips]  # round robin: half the new batches each
