"""RunTracker: scalars written as TensorBoard event files read back by TensorBoard's own reader."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from helpers import REPO, tiny_sync_job

from heterps_ray.errors import ConfigError
from heterps_ray.metrics.tracking import TENSORBOARD_DIR, RunTracker, read_scalars

PLANS = REPO / "configs" / "plans"


def test_scalars_per_step_and_final_metrics_read_back_from_the_event_file(tmp_path):
    with RunTracker(tmp_path) as tracker:
        for step in (10, 20, 30):
            tracker.log_scalars(
                step,
                {
                    "train/loss": 1.0 / step,
                    "train/samples_per_s": 1000.0 * step,
                    "stage0/busy_fraction": 0.5,
                    "stage1/queue_depth": step % 3,
                    "ps/rows": 100 * step,
                    "ps/pull_rate": float("nan"),  # not measured at this step: skipped, not written
                },
            )
        tracker.log_final({"eval/auc": 0.7658, "eval/logloss": 0.4755})
    assert list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    scalars = read_scalars(tmp_path / TENSORBOARD_DIR)
    assert set(scalars) == {
        "train/loss", "train/samples_per_s", "stage0/busy_fraction", "stage1/queue_depth", "ps/rows",
        "eval/auc", "eval/logloss",
    }  # fmt: skip
    assert [s for s, _ in scalars["train/loss"]] == [10, 20, 30]
    assert [v for _, v in scalars["train/samples_per_s"]] == [10_000.0, 20_000.0, 30_000.0]
    assert [v for _, v in scalars["stage1/queue_depth"]] == [1.0, 2.0, 0.0]
    ((step, auc),) = scalars["eval/auc"]
    assert step == 30 and math.isclose(auc, 0.7658, rel_tol=1e-6)


def test_a_second_run_in_another_directory_keeps_its_own_events(tmp_path):
    for name, loss in (("a", 0.5), ("b", 0.4)):
        with RunTracker(tmp_path / name) as tracker:
            tracker.log_scalars(1, {"train/loss": loss})
    assert read_scalars(tmp_path / "a" / TENSORBOARD_DIR)["train/loss"] == [(1, 0.5)]
    assert read_scalars(tmp_path / "b" / TENSORBOARD_DIR)["train/loss"] == [(1, pytest.approx(0.4))]


def test_negative_step_is_refused(tmp_path):
    with RunTracker(tmp_path) as tracker, pytest.raises(ConfigError, match="step"):
        tracker.log_scalars(-1, {"train/loss": 0.5})


def test_mlflow_asked_but_not_installed_tracks_to_tensorboard_only(tmp_path, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` meets without the package
    with RunTracker(tmp_path, mlflow=True) as tracker:
        tracker.log_final({"eval/auc": 0.75})
    assert "mlflow is not installed" in caplog.text
    assert read_scalars(tmp_path / TENSORBOARD_DIR)["eval/auc"] == [(0, pytest.approx(0.75))]


def _mlflow_store(tmp_path, monkeypatch):
    """MLflow (mlflow-skinny, the test extra) tracking to a file store of the test's own."""
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store opt-in
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    return mlflow


def test_mlflow_when_asked_and_installed(tmp_path, monkeypatch):
    mlflow = _mlflow_store(tmp_path, monkeypatch)
    with RunTracker(tmp_path, mlflow=True, run_name="t") as tracker:
        tracker.log_scalars(3, {"train/loss": 0.5})
        tracker.log_final({"eval/auc": 0.75})
    (run,) = mlflow.search_runs(output_format="list")
    assert run.info.run_name == "t" and run.data.metrics == {"train/loss": 0.5, "eval/auc": 0.75}


def test_a_run_with_mlflow_on_logs_what_tensorboard_and_the_summary_hold(ray_local, tmp_path, monkeypatch):
    """`runtime.mlflow: true`: every per-chunk scalar and the final AUC and logloss land in MLflow at the
    steps and values of the TensorBoard events and of run_summary.json."""
    from mlflow.tracking import MlflowClient

    from heterps_ray.config import JobConfig
    from heterps_ray.costmodel.plan import load_plan
    from heterps_ray.data.synth import synthesize
    from heterps_ray.runtime.driver import train

    mlflow = _mlflow_store(tmp_path, monkeypatch)
    synthesize(tmp_path / "data", 2_000, seed=13, rows_per_part=1_000)
    raw = tiny_sync_job("mlflow-run", tmp_path / "data", tmp_path / "out").model_dump()
    raw["runtime"].update(mlflow=True, checkpoint_every=0)
    summary = train(
        JobConfig.model_validate(raw), load_plan(PLANS / "small_three_stage.json"), steps=24, progress=False
    )
    (run,) = mlflow.search_runs(output_format="list")
    assert run.info.run_name == "mlflow-run" and run.info.status == "FINISHED"
    events = read_scalars(tmp_path / "out" / TENSORBOARD_DIR)
    assert {"train/loss", "train/samples_per_s", "ps/rows", "stage1/busy_fraction", "eval/auc"} <= set(events)
    assert set(run.data.metrics) == set(events)
    client = MlflowClient()
    for tag, points in events.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
        assert [s for s, _ in history] == [s for s, _ in points], tag
        np.testing.assert_allclose([v for _, v in history], [v for _, v in points], rtol=1e-6, err_msg=tag)
    assert run.data.metrics["eval/auc"] == pytest.approx(summary.auc, rel=1e-12)
    assert run.data.metrics["eval/logloss"] == pytest.approx(summary.logloss, rel=1e-12)
    assert client.get_metric_history(run.info.run_id, "eval/auc")[0].step == summary.steps


def test_a_run_summary_becomes_per_step_and_final_scalars(tmp_path):
    """The tags a finished run gives, from a RunSummary as the driver writes it (run_summary.json)."""
    import json

    from heterps_ray.runtime.driver import RunSummary

    summary = RunSummary(
        job="t", mode="sync", model="ctr_dnn", plan={}, ps_shards=2, steps=4, samples=256, seconds=2.0,
        throughput=128.0, losses=[0.7, 0.6, 0.5, 0.45], auc=0.71, logloss=0.52, eval_rows=100, placement=[],
        stages=[{"index": 0, "busy": 0.25, "replica_stats": [{"peak_pending": 0}]},
                {"index": 1, "busy": 0.5, "replica_stats": [{"peak_pending": 2}, {"peak_pending": 3}]}],
        ps=[{"rows": {"embedding": 10}, "keys_pulled": 300, "keys_pushed": 200},
            {"rows": {"embedding": 12}, "keys_pulled": 100, "keys_pushed": 100}],
        extra={"chunks": [[128, 1.0], [128, 0.5]]},
    )  # fmt: skip
    with RunTracker(tmp_path) as tracker:
        tracker.log_summary(json.loads(summary.to_json()))
    scalars = read_scalars(tmp_path / TENSORBOARD_DIR)
    assert [(s, round(v, 6)) for s, v in scalars["train/loss"]] == [(1, 0.7), (2, 0.6), (3, 0.5), (4, 0.45)]
    assert scalars["train/samples_per_s"] == [(2, 128.0), (4, 256.0)]
    assert scalars["stage1/busy_fraction"] == [(4, 0.5)] and scalars["stage1/queue_depth"] == [(4, 3.0)]
    assert scalars["ps/rows"] == [(4, 22.0)]
    assert scalars["ps/pull_rate"] == [(4, 200.0)] and scalars["ps/push_rate"] == [(4, 150.0)]
    assert scalars["eval/auc"] == [(4, pytest.approx(0.71))]
