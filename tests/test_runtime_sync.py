"""Sync mode on a real local Ray: the pipeline trains exactly like the one-process reference trainer,
whatever the number of PS shards or the stage split, and its stages land on their resource types."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import local_job

from heterps_ray.config import JobConfig
from heterps_ray.costmodel.plan import load_plan
from heterps_ray.errors import ConfigError
from heterps_ray.models import build_model
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import SUMMARY_FILE, train
from heterps_ray.runtime.loop import CHUNK_STEPS, steady_rate
from heterps_ray.runtime.reference import ReferenceTrainer

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "configs" / "plans"
MODEL = {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]}  # layers: embedding, fc1, fc2, logit
STEPS = 100
BATCH = 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("runtime_sync") / "data"
    synthesize(path, 10_000, seed=3, rows_per_part=3_000)  # 9,000 train rows: 140 batches of 64
    return path


def make_job(dataset: Path, output: Path, **changes) -> JobConfig:
    changes.setdefault("optimizer", {"dense_lr": 0.003})
    model = changes.pop("model", MODEL)
    return local_job("sync-test", model, dataset, output, seed=5, **changes)


@pytest.fixture(scope="module")
def reference(dataset):
    from heterps_ray.data.dataset import Dataset

    job = make_job(dataset, dataset.parent / "unused")
    trainer = ReferenceTrainer(build_model(job.model), job.optimizer, seed=job.seed)
    history = trainer.fit(Dataset(dataset), BATCH, steps=STEPS, progress=False)
    eval_batch = Dataset(dataset).load("eval")
    return {"losses": history["loss"], "metrics": trainer.evaluate(eval_batch), "eval": eval_batch}


@pytest.fixture(scope="module")
def three_stage_run(ray_local, dataset, tmp_path_factory):
    """`heterps train` of a 3-stage plan (data/embedding on cpu_small, fc1-fc2 on cpu_big, logit on
    cpu_small), 2 PS shards, 2 micro-batches per batch (GPipe); returns its run_summary.json."""
    from heterps_ray.cli import main

    output = tmp_path_factory.mktemp("three_stage")
    job_file = output / "job.yaml"
    job_file.write_text(make_job(dataset, output / "run").model_dump_json())  # JSON is YAML
    plan = str(PLANS / "small_three_stage.json")
    assert main(["train", str(job_file), "--plan", plan, "--steps", str(STEPS), "--no-progress"]) == 0
    return json.loads((output / "run" / SUMMARY_FILE).read_text()), output / "run", job_file


def test_sync_three_stages_match_reference_losses_and_auc(three_stage_run, reference):
    summary, _, _ = three_stage_run
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * BATCH and summary["ps_shards"] == 2
    losses = np.array(summary["losses"])
    diff = np.abs(losses - np.array(reference["losses"]))
    print(f"max |loss - reference loss| over {STEPS} steps: {diff.max():.2e}")
    assert diff.max() < 1e-4
    assert losses[-20:].mean() < losses[:20].mean()  # it actually learns
    print(f"AUC pipeline {summary['auc']:.6f} reference {reference['metrics']['auc']:.6f}")
    assert abs(summary["auc"] - reference["metrics"]["auc"]) < 1e-3
    assert abs(summary["logloss"] - reference["metrics"]["logloss"]) < 1e-3
    assert summary["eval_rows"] == len(reference["eval"]["label"])
    assert [s["layers"] for s in summary["stages"]] == [["embedding"], ["fc1", "fc2"], ["logit"]]
    assert all(0 < s["busy"] <= 1.0 + 1e-6 for s in summary["stages"])
    assert summary["throughput"] > 0 and summary["seconds"] > 0


def test_steady_rate_leaves_the_warm_up_chunk_out(three_stage_run):
    summary, _, _ = three_stage_run
    chunks = summary["extra"]["chunks"]
    # 20 batches in the first chunk, then chunks of about CHUNK_SECONDS (at least 20 batches)
    assert chunks[0][0] == CHUNK_STEPS * BATCH and sum(c[0] for c in chunks) == STEPS * BATCH
    assert all(c[0] >= CHUNK_STEPS * BATCH for c in chunks[:-1])
    later = chunks[1:]
    if len(chunks) >= 3:
        assert summary["steady_throughput"] == pytest.approx(sum(c[0] for c in later) / sum(c[1] for c in later))
    else:
        assert summary["steady_throughput"] is None
    assert summary["throughput"] == pytest.approx(summary["samples"] / summary["seconds"])
    assert steady_rate([(640, 1.0), (640, 0.5)]) is None  # too short to tell warm-up from steady
    assert steady_rate([(640, 4.0), (640, 0.5), (1280, 0.5)]) == pytest.approx(1920.0)


def test_saved_model_predicts_like_the_run(three_stage_run, reference):
    summary, output, _ = three_stage_run
    ckpt = load_checkpoint(output / "model")
    for f in (output / "model").rglob("*.npz"):
        np.load(f, allow_pickle=False).close()  # plain arrays, no pickle inside
    from heterps_ray.runtime.evaluation import evaluate_logits

    metrics = evaluate_logits(reference["eval"]["label"], ckpt.predict(reference["eval"]))
    assert metrics["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    assert metrics["logloss"] == pytest.approx(summary["logloss"], abs=1e-6)


def test_stages_land_on_their_resource_types(three_stage_run):
    summary, _, _ = three_stage_run
    by_role = {}
    for p in summary["placement"]:
        by_role.setdefault((p["role"], p.get("stage")), []).append(p)
    (data,) = by_role[("data", 0)]
    (fc,) = by_role[("stage", 1)]
    (tail,) = by_role[("stage", 2)]
    assert data["resources"].get("cpu_small") == 1.0 and data["torch_threads"] == 1
    assert (
        fc["resources"].get("cpu_big") == 1.0
        and fc["resources"].get("CPU") == 0.5
        and fc["torch_threads"] == 2
    )
    assert tail["resources"].get("cpu_small") == 1.0 and tail["torch_threads"] == 1
    # one DataWorker, no replicas: the 2 PS shards live in the DataWorker's process (ps_hosting: auto)
    assert ("ps", None) not in by_role and data["hosted_shards"] == 2
    assert len(summary["ps"]) == 2 and all(s["pushes"] == STEPS for s in summary["ps"])
    assert len({data["pid"], fc["pid"], tail["pid"]}) == 3  # separate processes
    assert {p["omp_wait_policy"] for p in summary["placement"]} == {"PASSIVE"}  # the types' runtime_env


@pytest.mark.parametrize("num_shards", [1, 4])
def test_shard_count_and_stage_split_leave_the_model_unchanged(
    ray_local, dataset, tmp_path, three_stage_run, num_shards
):
    """1 or 4 shards on a 2-stage split with 1 or 4 micro-batches = the 2-shard 3-stage model."""
    _, base_output, _ = three_stage_run
    job = make_job(
        dataset, tmp_path, runtime={"ps_shards": num_shards, "micro_batches": 1 if num_shards == 1 else 4}
    )
    summary = train(job, load_plan(PLANS / "small_two_stage.json"), steps=STEPS, progress=False)
    assert summary.ps_shards == num_shards and len(summary.ps) == num_shards
    base, other = load_checkpoint(base_output / "model"), load_checkpoint(tmp_path / "model")
    base_sparse, other_sparse = base.table.state(), other.table.state()
    np.testing.assert_array_equal(base_sparse["keys"], other_sparse["keys"])
    sparse_diff = np.abs(base_sparse["weights"] - other_sparse["weights"]).max()
    dense_diff = max(
        (a - b).abs().max().item() for a, b in zip(base.net.parameters(), other.net.parameters(), strict=True)
    )
    print(f"{num_shards} shards vs 2: max |sparse diff| {sparse_diff:.1e}, max |dense diff| {dense_diff:.1e}")
    assert sparse_diff < 1e-5 and dense_diff < 1e-5


def test_plan_mistakes_are_config_errors(dataset, tmp_path):
    plan = load_plan(PLANS / "small_three_stage.json")
    wrong_model = make_job(dataset, tmp_path, model={"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32]})
    with pytest.raises(ConfigError, match="assignment"):
        train(wrong_model, plan, steps=1, progress=False)
    with pytest.raises(ConfigError, match="1 in sync mode"):
        train(make_job(dataset, tmp_path), load_plan(PLANS / "small_async.json"), steps=1, progress=False)
    # 4 shard actors + 2 workers on cpu_small (hosted in the DataWorker, the shards would take no instance)
    too_many = make_job(dataset, tmp_path, runtime={"ps_shards": 4, "ps_hosting": "actors"})
    with pytest.raises(ConfigError, match="max_instances=4"):
        train(too_many, plan, steps=1, progress=False)


def test_output_dir_with_a_previous_run_is_refused(dataset, tmp_path):
    (tmp_path / SUMMARY_FILE).write_text("{}")
    with pytest.raises(ConfigError, match="--overwrite"):
        train(
            make_job(dataset, tmp_path), load_plan(PLANS / "small_three_stage.json"), steps=1, progress=False
        )
    assert (tmp_path / SUMMARY_FILE).read_text() == "{}"


def test_cli_refuses_a_second_run_and_a_bad_plan(three_stage_run, tmp_path, capsys):
    from heterps_ray.cli import main

    _, _, job_file = three_stage_run
    plan = PLANS / "small_three_stage.json"
    assert main(["train", str(job_file), "--plan", str(plan), "--steps", "5", "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    bad_plan = tmp_path / "bad.json"
    bad_plan.write_text(json.dumps({**json.loads(plan.read_text()), "assignment": ["cpu_small"]}))
    assert main(["train", str(job_file), "--plan", str(bad_plan), "--overwrite"]) == 2
    assert "field 'assignment': expected 4 entries" in capsys.readouterr().err


def test_the_run_is_tracked_in_tensorboard(three_stage_run):
    from heterps_ray.metrics.tracking import read_scalars

    summary, output, _ = three_stage_run
    scalars = read_scalars(output / "tensorboard")
    steps = [step for step, _ in scalars["train/loss"]]
    assert steps == sorted(steps) and steps[-1] == STEPS  # one point per chunk, up to the last batch
    assert all(v > 0 for _, v in scalars["train/samples_per_s"])
    assert {"stage0/busy_fraction", "stage1/queue_depth", "ps/rows", "ps/pull_rate"} <= set(scalars)
    assert scalars["ps/rows"][-1][1] == sum(sum(p["rows"].values()) for p in summary["ps"])
    ((_, auc),) = scalars["eval/auc"]
    assert auc == pytest.approx(summary["auc"], abs=1e-6)


def test_admission_and_ttl_train_exactly_like_the_reference(ray_local, dataset, tmp_path):
    """The job's table: section reaches the PS shards with the batch index as the table's clock: a
    sync run with admission (a key's row at its 3rd batch, zeros until then) and a TTL of 30 batches
    equals the one-process reference with the same rules, and holds fewer rows than a run without."""
    from heterps_ray.config import TableConfig
    from heterps_ray.data.dataset import Dataset

    job = make_job(dataset, tmp_path, table={"admit_after": 3, "ttl_batches": 30})
    summary = train(job, load_plan(PLANS / "small_three_stage.json"), steps=STEPS, progress=False)
    trainer = ReferenceTrainer(build_model(job.model), job.optimizer, seed=job.seed, table=job.table)
    history = trainer.fit(Dataset(dataset), BATCH, steps=STEPS, progress=False)
    assert np.abs(np.array(summary.losses) - np.array(history["loss"])).max() < 1e-4
    metrics = trainer.evaluate(Dataset(dataset).load("eval"))
    assert summary.auc == pytest.approx(metrics["auc"], abs=1e-3)
    held = sum(sum(p["rows"].values()) for p in summary.ps)
    everything = ReferenceTrainer(
        build_model(job.model), job.optimizer, seed=job.seed, table=TableConfig(admit_after=1)
    )
    everything.fit(Dataset(dataset), BATCH, steps=STEPS, progress=False)  # every key a row at first sight
    assert held == len(trainer.table) < 0.7 * len(everything.table)
