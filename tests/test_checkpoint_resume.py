"""Checkpoints that survive crashes and a sync run that resumes exactly: atomic writes, a SHA-256
manifest that catches truncated or corrupted files, periodic checkpoints on a real local Ray, and
`heterps train --resume` giving the same model and losses as an uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_BATCH, TINY_MODEL, tiny_sync_job

from heterps_ray.config import JobConfig
from heterps_ray.costmodel.plan import load_plan
from heterps_ray.errors import DataError
from heterps_ray.ps.atomic import Member, read_npz, write_npz_atomic, write_npz_streamed
from heterps_ray.runtime.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST,
    begin_training_checkpoint,
    commit_training_checkpoint,
    latest_training_checkpoint,
    load_checkpoint,
    verify_manifest,
    write_manifest,
)
from heterps_ray.runtime.driver import SUMMARY_FILE, train

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "configs" / "plans" / "small_three_stage.json"  # 3 stages, 2 PS shards
MODEL, BATCH = TINY_MODEL, TINY_BATCH
TOTAL, STOP = 12, 6  # batches of the whole run, and where the interrupted run stops


class _Unconvertible:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("disk full, say")


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.npz"
    write_npz_atomic(path, {"w": np.arange(4.0)})
    with pytest.raises(RuntimeError, match="disk full"):
        write_npz_atomic(path, {"w": _Unconvertible()})
    np.testing.assert_array_equal(read_npz(path)["w"], np.arange(4.0))
    assert [p.name for p in tmp_path.iterdir()] == ["state.npz"]


def test_a_streamed_npz_keeps_empty_arrays_of_any_shape(tmp_path):
    """A table whose waiting keys were all evicted snapshots (0, 2) counters: an empty member of more
    than one axis is written (a memoryview cannot cast a zero in its shape) and read back as it was."""
    arrays = {"none": np.zeros((0, 2), np.uint32), "wide": np.zeros((3, 0), np.float32), "rows": np.arange(6.0).reshape(3, 2)}
    members = [Member(name, a.dtype, a.shape, [a]) for name, a in arrays.items()]
    write_npz_streamed(tmp_path / "s.npz", members)
    back = read_npz(tmp_path / "s.npz")
    for name, a in arrays.items():
        assert back[name].shape == a.shape and back[name].dtype == a.dtype
        np.testing.assert_array_equal(back[name], a)


def test_object_arrays_are_refused_rather_than_pickled(tmp_path):
    with pytest.raises(ValueError, match="Python objects"):
        write_npz_atomic(tmp_path / "x.npz", {"x": np.array([{"a": 1}], dtype=object)})
    assert not list(tmp_path.iterdir())


def test_truncated_or_flipped_npz_is_a_data_error_naming_the_file(tmp_path):
    path = tmp_path / "shard.npz"
    write_npz_atomic(path, {"keys": np.arange(1000, dtype=np.int64)})
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    with pytest.raises(DataError, match="shard.npz"):
        read_npz(path)
    path.write_bytes(original)
    _flip_byte(path, len(original) - 30)  # inside the zip's central directory
    with pytest.raises(DataError, match="shard.npz"):
        read_npz(path)


def _fake_checkpoint(output: Path, step: int) -> Path:
    tmp = begin_training_checkpoint(output, step)
    write_npz_atomic(tmp / "ps-shard-00000.npz", {"w": np.full(64, float(step))})
    return commit_training_checkpoint(tmp, output, step, {"samples": step * BATCH, "losses": [], "plan": {}})


def test_manifest_catches_corruption_and_resume_falls_back_to_an_older_checkpoint(tmp_path):
    for step in (4, 8, 12):
        _fake_checkpoint(tmp_path, step)
    kept = sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir())
    assert kept == ["step-00000008", "step-00000012"]  # the newest two, no temporaries left
    newest = tmp_path / CHECKPOINTS_DIR / "step-00000012"
    shard = newest / "ps-shard-00000.npz"
    before = shard.read_bytes()
    _flip_byte(shard, 100)
    with pytest.raises(DataError, match="ps-shard-00000.npz.*SHA-256"):
        verify_manifest(newest)
    directory, manifest, skipped = latest_training_checkpoint(tmp_path)
    assert directory.name == "step-00000008" and manifest["step"] == 8 and manifest["samples"] == 8 * BATCH
    assert len(skipped) == 1 and "step-00000012" in skipped[0]
    assert shard.stat().st_size == len(before)  # verifying rewrote nothing
    (tmp_path / CHECKPOINTS_DIR / "step-00000008" / "ps-shard-00000.npz").write_bytes(b"PK\x03")
    with pytest.raises(DataError, match="no valid checkpoint"):
        latest_training_checkpoint(tmp_path)


def _model_dir(directory: Path) -> Path:
    """A tiny honest model directory (two embedding shards), written by save_checkpoint."""
    from heterps_ray.config import ModelConfig
    from heterps_ray.models import build_model
    from heterps_ray.runtime.checkpoint import save_checkpoint

    config = ModelConfig(**MODEL)
    spec = build_model(config)
    net = spec.build(0, spec.num_layers, 0)
    dense = {
        f"{spec.layers[int(k.split('.')[1])].name}.{k.split('.', 2)[2]}": v.numpy()
        for k, v in net.state_dict().items()
    }
    dim = spec.embedding_dim
    shards = [
        {"keys": np.array(keys, np.int64), "weights": np.full((len(keys), dim), 0.5, np.float32),
         "accumulators": np.full((len(keys), dim), 0.1, np.float32)}
        for keys in ([1, 3], [2])
    ]  # fmt: skip
    settings = {"lr": 0.05, "init_accumulator": 0.1, "init_scale": 0.01}

    def write_sparse(table, paths):
        for path, state in zip(paths, shards, strict=True):
            write_npz_atomic(path, state)
        return [len(state["keys"]) for state in shards]

    return save_checkpoint(
        directory, config, spec, 0, dense, {"embedding": len(shards)}, write_sparse, settings
    )


def _name_in_model_json(model: Path, name: str) -> None:
    """Make model.json's first embedding file `name`; the manifest is rewritten so that it still verifies."""
    meta = json.loads((model / "model.json").read_text())
    meta["tables"]["embedding"]["files"][0] = name
    (model / "model.json").write_text(json.dumps(meta))
    write_manifest(model, {})


def test_files_named_in_model_json_stay_inside_the_model_directory(tmp_path, capsys):
    from heterps_ray.cli import main

    model = _model_dir(tmp_path / "run" / "model")
    assert sorted(load_checkpoint(model).table.state()["keys"]) == [1, 2, 3]  # the honest model loads
    outside = tmp_path / "stolen.npz"
    write_npz_atomic(outside, read_npz(model / "sparse" / "embedding-shard-00000-of-00002.npz"))
    field = r"model.json: field 'tables.embedding.files\[0\]': expected a file inside"
    for name, why in [(str(outside), "an absolute path"), ("../../stolen.npz", "climbs out with '..'"),
                      ("sparse/../../../stolen.npz", "climbs out")]:  # fmt: skip
        _name_in_model_json(model, name)
        with pytest.raises(DataError, match=f"{field}.*{why}"):
            load_checkpoint(model)
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "export")]) == 2
    assert "field 'tables.embedding.files[0]'" in capsys.readouterr().err
    # A symlink out of the directory: refused by the manifest (it lists the link) and, without one, by model.json.
    shutil.rmtree(model)
    model = _model_dir(model)
    link = model / "sparse" / "embedding-shard-00001-of-00002.npz"
    link.unlink()
    link.symlink_to(outside)
    write_manifest(model, {})
    with pytest.raises(DataError, match=r"manifest.json: field 'files'.*outside the directory"):
        load_checkpoint(model)
    (model / MANIFEST).unlink()
    field = r"model.json: field 'tables.embedding.files\[1\]'"
    with pytest.raises(DataError, match=f"{field}.*outside the directory"):
        load_checkpoint(model)


def test_files_listed_in_a_manifest_stay_inside_the_checkpoint(tmp_path):
    step = _fake_checkpoint(tmp_path, 4)
    manifest = json.loads((step / MANIFEST).read_text())
    digest = manifest["files"].pop("ps-shard-00000.npz")
    (tmp_path / "ps-shard-00000.npz").write_bytes((step / "ps-shard-00000.npz").read_bytes())
    manifest["files"]["../../ps-shard-00000.npz"] = digest  # the same bytes, one level up
    (step / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"manifest.json: field 'files'.*'\.\./\.\./ps-shard-00000.npz'"):
        verify_manifest(step)
    with pytest.raises(DataError, match="no valid checkpoint"):
        latest_training_checkpoint(tmp_path)  # the only checkpoint is refused, not trusted


# -- on a real local Ray -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tiny_dataset) -> Path:
    return tiny_dataset  # 1,800 train rows: 28 batches of 64


def _model_arrays(run_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    ckpt = load_checkpoint(run_dir / "model")
    dense = {k: v.detach().numpy() for k, v in ckpt.net.state_dict().items()}
    state = ckpt.table.state()
    order = np.argsort(state["keys"])  # the rows' arrays in key order; waiting keys and the clock as they are
    return dense, {k: v if k.startswith("candidate_") or not v.ndim else v[order] for k, v in state.items()}


@pytest.mark.slow
def test_stopped_and_resumed_run_equals_an_uninterrupted_run(
    ray_local, dataset, undisturbed_tiny_run, tmp_path
):
    from conftest import UNDISTURBED_STEPS

    from heterps_ray.cli import main

    plan = load_plan(PLAN)
    whole, whole_dir = undisturbed_tiny_run  # this job under PLAN, TOTAL batches uninterrupted
    assert UNDISTURBED_STEPS == TOTAL

    run_dir = tmp_path / "resumed"
    first = train(_job(dataset, run_dir, checkpoint_every=STOP), plan, steps=STOP, progress=False)
    assert first.extra["checkpoints"] == [str(run_dir / CHECKPOINTS_DIR / f"step-{STOP:08d}")]
    manifest = json.loads((run_dir / CHECKPOINTS_DIR / f"step-{STOP:08d}" / MANIFEST).read_text())
    assert manifest["step"] == STOP and manifest["samples"] == STOP * BATCH
    assert sorted(manifest["files"]) == [
        "data-000.npz",
        "ps-shard-00000.npz",
        "ps-shard-00001.npz",
        "stage1-replica000.npz",
        "stage2-replica000.npz",
    ]
    assert any(
        k.endswith("/exp_avg_sq")
        for k in read_npz(run_dir / CHECKPOINTS_DIR / f"step-{STOP:08d}" / "stage1-replica000.npz")
    )

    # a previous run is refused without --resume, and the refusal destroys nothing
    job_file = tmp_path / "job.yaml"
    job_file.write_text(_job(dataset, run_dir, checkpoint_every=STOP).model_dump_json())
    argv = ["train", str(job_file), "--plan", str(PLAN), "--steps", str(TOTAL), "--no-progress"]
    assert main(argv) == 2
    assert (run_dir / CHECKPOINTS_DIR / f"step-{STOP:08d}" / MANIFEST).exists()

    assert main([*argv, "--resume"]) == 0
    resumed = json.loads((run_dir / SUMMARY_FILE).read_text())
    assert resumed["steps"] == TOTAL and resumed["samples"] == TOTAL * BATCH
    assert resumed["extra"]["resumed_from"]["step"] == STOP
    np.testing.assert_array_equal(resumed["losses"], whole.losses)
    assert len(whole.losses) == TOTAL

    dense_a, sparse_a = _model_arrays(whole_dir)
    dense_b, sparse_b = _model_arrays(run_dir)
    assert dense_a.keys() == dense_b.keys()
    for name in dense_a:
        np.testing.assert_array_equal(dense_b[name], dense_a[name], err_msg=name)
    np.testing.assert_array_equal(sparse_b["keys"], sparse_a["keys"])
    np.testing.assert_array_equal(sparse_b["weights"], sparse_a["weights"])
    np.testing.assert_array_equal(sparse_b["accumulators"], sparse_a["accumulators"])
    np.testing.assert_array_equal(sparse_b["candidate_keys"], sparse_a["candidate_keys"])  # admission's waiting keys
    kept = sorted(p.name for p in (run_dir / CHECKPOINTS_DIR).iterdir())
    assert kept == [f"step-{STOP:08d}", f"step-{TOTAL:08d}"]

    # a corrupted model file is a DataError naming it, and loading destroys nothing
    dense_file = run_dir / "model" / "dense.npz"
    _flip_byte(dense_file, 200)
    with pytest.raises(DataError, match="dense.npz"):
        load_checkpoint(run_dir / "model")
    assert dense_file.exists() and (run_dir / "model" / MANIFEST).exists()


def _lose_shard_snapshot(checkpoint: Path) -> None:
    """What a PS shard snapshot written to a node's own disk looks like to the driver: absent, and
    so never hashed into the manifest's `files` (the shard's own report still lists it)."""
    (checkpoint / "ps-shard-00001.npz").unlink()
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    del manifest["files"]["ps-shard-00001.npz"]
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_missing_a_shard_snapshot_falls_back_or_is_refused(ray_local, dataset, tmp_path, capsys):
    """Never resume on empty or partial tables: the newest complete checkpoint, else exit 2 naming the
    missing snapshot and the node that wrote it."""
    from heterps_ray.cli import main

    run_dir = tmp_path / "run"
    job = _job(dataset, run_dir, checkpoint_every=STOP // 2)
    first = train(job, load_plan(PLAN), steps=STOP, progress=False)
    older, newest = (Path(p) for p in first.extra["checkpoints"][-2:])
    shards = json.loads((newest / MANIFEST).read_text())["shards"]
    assert [s["file"] for s in shards] == ["ps-shard-00000.npz", "ps-shard-00001.npz"]
    assert all(
        s["node"] == ray_local.get_runtime_context().get_node_id() and len(s["sha256"]) == 64 for s in shards
    )
    _lose_shard_snapshot(newest)

    resumed = train(job, load_plan(PLAN), steps=TOTAL, progress=False, resume=True)
    assert resumed.extra["resumed_from"]["checkpoint"] == str(older)
    (why,) = resumed.extra["resumed_from"]["skipped"]
    assert "ps-shard-00001.npz: PS shard snapshot missing, written by node" in why

    for checkpoint in sorted((run_dir / CHECKPOINTS_DIR).glob("step-*")):
        _lose_shard_snapshot(checkpoint)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(job.model_dump_json())
    argv = ["train", str(job_file), "--plan", str(PLAN), "--steps", str(TOTAL), "--no-progress", "--resume"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "no valid checkpoint" in err
        and "ps-shard-00001.npz: PS shard snapshot missing, written by node" in err
    )


def test_resume_of_a_directory_without_a_checkpoint_exits_2(ray_local, dataset, tmp_path, capsys):
    from heterps_ray.cli import main

    job_file = tmp_path / "job.yaml"
    job_file.write_text(_job(dataset, tmp_path / "empty").model_dump_json())
    code = main(["train", str(job_file), "--plan", str(PLAN), "--steps", "2", "--no-progress", "--resume"])
    assert code == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert not (tmp_path / "empty" / SUMMARY_FILE).exists()


def _job(dataset: Path, output: Path, checkpoint_every: int = 0) -> JobConfig:
    return tiny_sync_job("resume-test", dataset, output, checkpoint_every)
