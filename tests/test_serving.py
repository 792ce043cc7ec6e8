"""`heterps export` and `heterps predict` on a model trained by the real runtime: the scores reproduce
the run's own evaluation, and the exported dense net, loaded with plain torch, gives the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import tiny_sync_job

from heterps_ray.cli import main
from heterps_ray.costmodel.plan import load_plan
from heterps_ray.data.dataset import Dataset
from heterps_ray.errors import DataError
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import SUMMARY_FILE, train
from heterps_ray.serving.export import DENSE_FILE, EMBEDDINGS_FILE, MANIFEST
from heterps_ray.serving.predict import predict

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "configs" / "plans" / "small_two_stage.json"


@pytest.fixture(scope="module")
def trained(ray_local, tmp_path_factory) -> tuple[Path, Path, dict]:
    """A tiny sync run (2 stages, its own evaluation on the eval split); returns (output_dir, data, summary)."""
    from heterps_ray.data.synth import synthesize

    root = tmp_path_factory.mktemp("serving")
    data = root / "data"
    synthesize(data, 4_000, seed=11, rows_per_part=1_000)
    job = tiny_sync_job("serving-test", data, root / "run")
    train(job, load_plan(PLAN), steps=40, progress=False)
    return root / "run", data, json.loads((root / "run" / SUMMARY_FILE).read_text())


def test_predictions_on_the_eval_split_give_the_runs_own_auc(trained, tmp_path):
    output_dir, data, summary = trained
    scores = tmp_path / "eval_scores.parquet"
    result = predict(output_dir, data, scores, splits=["eval"], batch_rows=97, actors=1)
    table = pq.read_table(scores)
    assert table.num_rows == Dataset(data).num_rows("eval") == summary["eval_rows"] == result["rows"]
    assert table.column_names == ["split", "label", "logit", "probability"]
    np.testing.assert_array_equal(table.column("label").to_numpy(), Dataset(data).load("eval")["label"])
    assert abs(result["metrics"]["eval"]["auc"] - summary["auc"]) < 1e-4
    assert abs(result["metrics"]["eval"]["logloss"] - summary["logloss"]) < 1e-4
    prob = table.column("probability").to_numpy()
    np.testing.assert_allclose(prob, 1 / (1 + np.exp(-table.column("logit").to_numpy())), rtol=1e-5)


def test_cli_predict_scores_every_row_and_unlabelled_parquet(trained, tmp_path, capsys):
    output_dir, data, summary = trained
    scores = tmp_path / "all.parquet"
    assert main(["predict", str(output_dir), "--data", str(data), "--output", str(scores)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {scores}: 4000 rows (train 3600, eval 400)" in printed and "eval AUC" in printed
    table = pq.read_table(scores)
    assert table.column("split").to_pylist() == ["train"] * 3600 + ["eval"] * 400
    # The same rows without labels, as plain Parquet (no dataset directory): the same logits.
    raw = pq.read_table(Dataset(data).files("eval")).drop_columns(["label"])
    pq.write_table(raw, tmp_path / "unlabelled.parquet")
    result = predict(output_dir, tmp_path / "unlabelled.parquet", tmp_path / "u.parquet")
    unlabelled = pq.read_table(tmp_path / "u.parquet")
    assert result["splits"] == {"all": 400} and result["metrics"] == {}
    assert np.isnan(unlabelled.column("label").to_numpy()).all()
    np.testing.assert_allclose(
        unlabelled.column("logit").to_numpy(), table.column("logit").to_numpy()[3600:], rtol=1e-6, atol=1e-7
    )


def test_exported_dense_net_and_rows_loaded_with_plain_torch_give_the_same_logits(trained, tmp_path):
    output_dir, data, _ = trained
    out = tmp_path / "export"
    assert main(["export", str(output_dir), "--output", str(out)]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["model"]["name"] == "ctr_dnn" and manifest["embedding_dim"] == 4
    assert set(manifest["files"]) == {DENSE_FILE, EMBEDDINGS_FILE}
    assert "siphash24" in manifest["feature_hashing"]["sparse"]["key"]

    # What a serving stack does, with torch and pyarrow only: look the keys up, unseen keys get what the
    # manifest's rule says (the default table admits a key at its 2nd batch: zeros), run the TorchScript net.
    net = torch.jit.load(str(out / DENSE_FILE))
    rows = pq.read_table(out / EMBEDDINGS_FILE)
    assert rows.schema.field("vector").type == pa.list_(pa.float32(), 4)
    assert rows.num_rows == manifest["embeddings"]["rows"] > 0
    table = dict(zip(rows.column("key").to_numpy(), rows.column("vector").to_numpy(zero_copy_only=False), strict=True))
    batch = Dataset(data).load("eval")
    keys = batch["keys"].ravel()
    unseen = np.array([k not in table for k in keys])
    assert unseen.any() and not unseen.all()  # eval rows carry keys the training never saw
    assert manifest["unseen_keys"]["rule"].startswith("zeros") and manifest["unseen_keys"]["admit_after"] == 2
    emb = np.zeros((len(keys), 4), np.float32)
    emb[~unseen] = np.stack([table[k] for k in keys[~unseen]])
    with torch.no_grad():
        logits = net(torch.from_numpy(batch["dense"]), torch.from_numpy(emb).view(len(batch["label"]), -1, 4))
    expected = load_checkpoint(output_dir / "model").predict(batch)
    np.testing.assert_allclose(logits.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_missing_model_or_data_exits_2(trained, tmp_path, capsys):
    output_dir, data, _ = trained
    assert main(["predict", str(tmp_path), "--data", str(data), "--output", str(tmp_path / "x.parquet")]) == 2
    assert f"{tmp_path}: no trained model" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nope"), "--output", str(tmp_path / "e")]) == 2
    assert "no trained model" in capsys.readouterr().err
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        predict(output_dir, tmp_path / "bad.parquet", tmp_path / "y.parquet")
    assert not (tmp_path / "y.parquet").exists()


def test_unseen_key_rule_of_an_export_is_what_training_gave_such_keys():
    from heterps_ray.ps.table import SparseTable, initial_rows
    from heterps_ray.serving.export import _unseen_rule

    plain = _unseen_rule(SparseTable(4, seed=3, init_scale=0.02))
    assert plain["implementation"] == "heterps_ray.ps.table.initial_rows" and plain["seed"] == 3
    np.testing.assert_array_equal(
        SparseTable(4, seed=3, init_scale=0.02).pull(np.array([9]), create=False),
        initial_rows(np.array([9]), 4, plain["seed"], plain["init_scale"]),
    )
    admitting = SparseTable(4, seed=3, admit_after=2)
    rule = _unseen_rule(admitting)
    assert rule["rule"].startswith("zeros") and rule["admit_after"] == 2
    np.testing.assert_array_equal(admitting.pull(np.array([9]), create=False), np.zeros((1, 4), np.float32))
