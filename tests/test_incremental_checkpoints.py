"""Incremental checkpoints (runtime.checkpoint_full_every): a full PS snapshot every K checkpoints and
only the changed rows and removed keys between; a run resumed from a chain equals the uninterrupted
run, a damaged or missing link is refused (resuming falls back to the newest chain that verifies),
retention keeps every link a kept checkpoint needs, and a chain restores onto another shard count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_sync_job

from heterps_ray.costmodel.plan import load_plan
from heterps_ray.errors import DataError
from heterps_ray.ps.atomic import read_npz
from heterps_ray.ps.shard import PSShard
from heterps_ray.ps.spec import TableSpec
from heterps_ray.runtime.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST,
    latest_training_checkpoint,
    load_checkpoint,
    verify_manifest,
)
from heterps_ray.runtime.driver import train

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "configs" / "plans" / "small_three_stage.json"  # 3 stages, 2 PS shards
TOTAL, STOP, EVERY = 12, 6, 2  # batches of the whole run, where the first part stops, checkpoint period


def _step(run: Path, step: int) -> Path:
    return run / CHECKPOINTS_DIR / f"step-{step:08d}"


def _manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / MANIFEST).read_text())


def _train_some(shard: PSShard, rng: np.random.Generator, steps: range, vocab: int = 600) -> None:
    for step in steps:
        keys = rng.integers(0, vocab, 64)
        shard.pull("e", keys, step=step)
        shard.push("e", keys, rng.standard_normal((64, 4)).astype(np.float32))


@pytest.mark.parametrize(
    "spec",
    [TableSpec(dim=4), TableSpec(dim=4, ttl=4), TableSpec(dim=4, admit_after=2, ttl=5)],
    ids=["plain", "ttl", "admission-ttl"],
)
def test_a_chain_of_deltas_rebuilds_the_shard_exactly(tmp_path, spec):
    """Rows pushed, rows expired (TTL: removed keys) and keys waiting for admission all replay; a
    snapshot whose checkpoint never commits leaves its changes to the next delta."""
    rng = np.random.default_rng(3)
    shard = PSShard(0, 1, {"e": spec})
    _train_some(shard, rng, range(1, 9))
    links = []
    for i in range(4):
        path = str(tmp_path / f"link-{i}.npz")
        report = shard.snapshot(path, delta=i > 0)
        assert report["kind"] == ("delta" if i else "full")
        if i == 2:  # this checkpoint failed to commit: not a link, and its rows stay pending
            _train_some(shard, rng, range(9 + 4 * i, 13 + 4 * i))
            continue
        shard.snapshot_durable()
        links.append(path)
        _train_some(shard, rng, range(9 + 4 * i, 13 + 4 * i))
    rebuilt = PSShard(0, 1, {"e": spec})
    # a final delta on top of the chain: the rebuilt shard equals the live one, row for row (the rows
    # of the snapshot that never committed are in the delta after it)
    final = str(tmp_path / "final.npz")
    shard.snapshot(final, delta=True)
    rebuilt.restore_chain([*links, final])
    live, again = shard.state(), rebuilt.state()
    assert live.keys() == again.keys()
    for name in live:
        np.testing.assert_array_equal(again[name], live[name], err_msg=name)
    delta = read_npz(final)
    if spec.ttl:
        assert len(delta["sparse/e/removed_keys"]) > 0  # expired rows are carried as removals
    if spec.admit_after > 1:
        assert "sparse/e/candidate_keys" in delta and "sparse/e/candidate_removed_keys" in delta


def test_a_delta_of_few_changed_rows_is_small_and_a_chain_is_refused_out_of_order(tmp_path):
    shard = PSShard(0, 1, {"e": TableSpec(dim=8)})
    shard.pull("e", np.arange(20_000))
    full = tmp_path / "full.npz"
    shard.snapshot(str(full))
    shard.snapshot_durable()
    shard.push("e", np.arange(100), np.ones((100, 8), np.float32))
    delta = tmp_path / "delta.npz"
    shard.snapshot(str(delta), delta=True)
    assert len(read_npz(delta)["sparse/e/keys"]) == 100
    assert delta.stat().st_size * 50 < full.stat().st_size
    with pytest.raises(DataError, match="delta.npz: not a snapshot of PS shard 0/1"):
        PSShard(0, 1, {"e": TableSpec(dim=8)}).restore_chain([str(delta)])
    with pytest.raises(ValueError, match="needs an earlier snapshot"):
        PSShard(0, 1, {"e": TableSpec(dim=8)}).snapshot(str(tmp_path / "x.npz"), delta=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("incremental") / "data"
    synthesize(path, 2_000, seed=5, rows_per_part=1_000)
    return path


def _job(
    dataset: Path,
    output: Path,
    full_every: int,
    keep: int = 2,
    ps_shards: int | None = None,
    hosting="auto",
    delta_max_share: float = 1.0,  # a tiny run changes most rows between checkpoints: deltas all the same
):
    job = tiny_sync_job("incremental-test", dataset, output, EVERY)
    runtime = {
        "checkpoint_full_every": full_every,
        "checkpoint_delta_max_share": delta_max_share,
        "checkpoint_keep": keep,
        "ps_shards": ps_shards,
        "ps_hosting": hosting,
    }
    return job.model_copy(update={"runtime": job.runtime.model_copy(update=runtime)})


def _final_model(run: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    ckpt = load_checkpoint(run / "model")
    return {k: v.detach().numpy() for k, v in ckpt.net.state_dict().items()}, ckpt.table.state()


def _assert_same_model(a: Path, b: Path) -> None:
    dense_a, rows_a = _final_model(a)
    dense_b, rows_b = _final_model(b)
    assert dense_a.keys() == dense_b.keys()
    for name in dense_a:
        np.testing.assert_array_equal(dense_b[name], dense_a[name], err_msg=name)
    np.testing.assert_array_equal(rows_b["keys"], rows_a["keys"])
    for name in ("weights", "accumulators"):
        np.testing.assert_array_equal(rows_b[name], rows_a[name], err_msg=name)


def _one_stage_plan(tmp_path: Path) -> Path:
    """small_three_stage's layers in one stage: one DataWorker, its PS shards hosted in its process."""
    plan = json.loads(PLAN.read_text())
    plan["stages"] = [
        {**plan["stages"][0], "layers": [layer for s in plan["stages"] for layer in s["layers"]]}
    ]
    plan["assignment"] = [plan["stages"][0]["type"]] * len(plan["assignment"])
    path = tmp_path / "one_stage.json"
    path.write_text(json.dumps(plan))
    return path


@pytest.fixture(scope="module")
def whole(ray_local, dataset, tmp_path_factory):
    """The uninterrupted run, every checkpoint full (kept, to compare a chain's rebuild with), its PS
    shards hosted in the DataWorker."""
    out = tmp_path_factory.mktemp("whole")
    return train(_job(dataset, out, full_every=1, keep=10), load_plan(PLAN), steps=TOTAL, progress=False)


def test_a_run_resumed_from_a_chain_equals_the_uninterrupted_run(ray_local, dataset, tmp_path, whole):
    plan = load_plan(PLAN)
    whole_dir = Path(whole.output_dir)
    run = tmp_path / "chain"
    train(_job(dataset, run, full_every=3, hosting="actors"), plan, steps=STOP, progress=False)
    # retention: the newest two, and the full checkpoint they build on
    assert sorted(p.name for p in (run / CHECKPOINTS_DIR).iterdir()) == [f"step-{s:08d}" for s in (2, 4, 6)]
    newest = _manifest(_step(run, STOP))
    assert newest["kind"] == "delta" and [link["id"] for link in newest["chain"]] == [
        "step-00000002",
        "step-00000004",
    ]
    assert [s["kind"] for s in newest["shards"]] == ["delta", "delta"]
    # each shard rebuilt from the chain holds exactly the rows of the uninterrupted run's full snapshot
    spec = TableSpec(dim=4, seed=7, lr=0.05, init_accumulator=0.1)
    for i in range(2):
        shard = PSShard(i, 2, {"embedding": spec})
        shard.restore_chain([str(_step(run, s) / f"ps-shard-{i:05d}.npz") for s in (2, 4, 6)])
        full = PSShard(i, 2, {"embedding": spec})
        full.restore(str(_step(whole_dir, STOP) / f"ps-shard-{i:05d}.npz"))
        rebuilt, uninterrupted = shard.state(), full.state()
        for name in ("keys", "weights", "accumulators"):
            np.testing.assert_array_equal(
                rebuilt[f"sparse/embedding/{name}"], uninterrupted[f"sparse/embedding/{name}"], name
            )
        assert (_step(run, STOP) / f"ps-shard-{i:05d}.npz").stat().st_size < (
            _step(whole_dir, STOP) / f"ps-shard-{i:05d}.npz"
        ).stat().st_size
    saved = tmp_path / "chain-at-6"
    shutil.copytree(run, saved)

    resumed = train(
        _job(dataset, run, full_every=3, hosting="actors"), plan, steps=TOTAL, progress=False, resume=True
    )
    assert resumed.extra["resumed_from"]["step"] == STOP
    np.testing.assert_array_equal(resumed.losses, whole.losses)
    _assert_same_model(whole_dir, run)
    # the restored chain (2, 4, 6) held 3 = checkpoint_full_every links: step 8 starts a new one, and
    # once the newest two build on it, the old chain is removed
    assert _manifest(_step(run, 8))["kind"] == "full"
    assert [link["id"] for link in _manifest(_step(run, TOTAL))["chain"]] == [
        "step-00000008",
        "step-00000010",
    ]
    assert sorted(p.name for p in (run / CHECKPOINTS_DIR).iterdir()) == [f"step-{s:08d}" for s in (8, 10, 12)]

    # onto another plan and shard count (one stage, 3 shards hosted in the DataWorker): re-sharded
    moved = train(
        _job(dataset, saved, full_every=10, ps_shards=3),
        load_plan(_one_stage_plan(tmp_path)),
        steps=TOTAL,
        progress=False,
        resume=True,
    )
    assert moved.extra["resumed_from"]["plan_changed"] and moved.ps_shards == 3
    np.testing.assert_array_equal(moved.losses, whole.losses)
    dense_a, rows_a = _final_model(whole_dir)
    dense_b, rows_b = _final_model(saved)
    np.testing.assert_array_equal(rows_b["keys"], rows_a["keys"])
    np.testing.assert_array_equal(rows_b["weights"], rows_a["weights"])
    # after a re-shard nothing of the old chain applies: the next checkpoint is full
    assert _manifest(_step(saved, STOP + EVERY))["kind"] == "full"


def test_a_checkpoint_most_of_whose_rows_changed_is_written_full(ray_local, dataset, tmp_path):
    """With the default ``checkpoint_delta_max_share`` (10%), a checkpoint due as a delta whose shards
    changed more than that share of their rows (a tiny run changes most) is a full one."""
    from heterps_ray.config import RuntimeConfig

    run = tmp_path / "shares"
    default = RuntimeConfig.model_fields["checkpoint_delta_max_share"].default
    job = _job(dataset, run, full_every=3, keep=3, delta_max_share=default)
    train(job, load_plan(_one_stage_plan(tmp_path)), steps=6, progress=False)
    kinds = [_manifest(_step(run, s))["kind"] for s in (2, 4, 6)]
    assert kinds == ["full", "full", "full"]
    assert all(not _manifest(_step(run, s))["chain"] for s in (2, 4, 6))


def _fake_chain(root: Path, steps: list[int]) -> None:
    """Checkpoints whose manifests chain like a run's (written by the same functions a run uses)."""
    from heterps_ray.runtime.checkpoint import (
        begin_training_checkpoint,
        chain_links,
        commit_training_checkpoint,
    )

    previous: Path | None = None
    for step in steps:
        tmp = begin_training_checkpoint(root, step)
        (tmp / "ps-shard-00000.npz").write_bytes(f"rows of {step}".encode())
        chain = chain_links(previous) if previous is not None else []
        info = {"samples": step, "losses": [], "kind": "delta" if chain else "full", "chain": chain}
        previous = commit_training_checkpoint(tmp, root, step, info, keep=2)


def test_a_damaged_or_missing_link_is_refused_and_resuming_falls_back(tmp_path):
    _fake_chain(tmp_path, [2, 4, 6, 8])
    checkpoints = tmp_path / CHECKPOINTS_DIR
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-{s:08d}" for s in (2, 4, 6, 8)]
    (checkpoints / "step-00000006" / "ps-shard-00000.npz").write_bytes(b"flipped")
    with pytest.raises(DataError, match="step-00000006/ps-shard-00000.npz: SHA-256 differs"):
        verify_manifest(checkpoints / "step-00000008")
    directory, _, skipped = latest_training_checkpoint(tmp_path)
    assert directory.name == "step-00000004" and len(skipped) == 2

    shutil.rmtree(checkpoints / "step-00000002")  # the full snapshot of the chain
    with pytest.raises(
        DataError,
        match="no valid checkpoint.*step-00000002: link 1 of the chain of step-00000008 \\(full\\) is missing",
    ):
        latest_training_checkpoint(tmp_path)


def test_a_bad_checkpoint_full_every_exits_2_naming_the_field(tmp_path, capsys):
    from heterps_ray.cli import main

    job = json.loads(tiny_sync_job("bad", tmp_path / "data", tmp_path / "out").model_dump_json())
    for bad in (0, 2.5, "often"):
        job["runtime"]["checkpoint_full_every"] = bad
        (tmp_path / "job.yaml").write_text(json.dumps(job))
        assert main(["train", str(tmp_path / "job.yaml"), "--plan", str(PLAN)]) == 2
        err = capsys.readouterr().err
        assert "field 'runtime.checkpoint_full_every'" in err and "Traceback" not in err


def test_a_shard_dying_inside_a_delta_checkpoint_rolls_back_to_the_chain_before(
    ray_local, dataset, tmp_path, whole
):
    """The PS shard dies writing the delta of step 6: that checkpoint never commits, every actor rolls
    back to step 4 (a delta on step 2), and the run ends as the uninterrupted one."""
    from fault_injection import PhaseKiller

    killer = PhaseKiller("ps_shard", "checkpoint", "sigkill", at=4, flag_dir=str(tmp_path))
    job = _job(dataset, tmp_path / "run", full_every=10, hosting="actors")
    summary = train(job, load_plan(PLAN), steps=TOTAL, progress=False, on_chunk=killer)
    (fault,) = summary.extra["faults"]
    assert fault["rolled_back_to"] == 4 and fault["recovery_point"].endswith("step-00000004")
    np.testing.assert_array_equal(summary.losses, whole.losses)
    _assert_same_model(Path(whole.output_dir), tmp_path / "run")
    assert [link["id"] for link in _manifest(_step(tmp_path / "run", TOTAL))["chain"]] == [
        f"step-{s:08d}" for s in (2, 4, 6, 8, 10)
    ]
