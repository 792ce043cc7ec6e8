"""Faults on a real local Ray: a PS shard, a DataWorker or a StageWorker is killed mid-training (by
`ray.kill` or by SIGKILL of its worker process); the driver re-creates it, rolls back to the newest
checkpoint and replays. Sync mode ends with the same model as an undisturbed run and every batch
applied exactly once on every PS shard; async mode reports the updates the restore discarded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
from fault_injection import ActorKiller, PhaseKiller
from helpers import local_job

from heterps_ray.config import JobConfig
from heterps_ray.costmodel.plan import Plan, load_plan
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import RunSummary, train
from heterps_ray.runtime.faults import TooManyFaults

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "configs" / "plans"
MODEL = {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]}
BATCH = 64
STEPS, EVERY = 16, 4  # batches per run, and the checkpoint interval
KILL_AFTER = 6  # batches the PS has applied when the killer strikes: mid-chunk, after checkpoint 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("faults") / "data"
    synthesize(path, 2_400, seed=5, rows_per_part=1_200)  # 2,160 train rows: 33 batches of 64
    return path


def make_job(dataset: Path, output: Path, mode: str = "sync", **runtime) -> JobConfig:
    return local_job(
        f"faults-{mode}", MODEL, dataset, output, mode=mode, runtime={"checkpoint_every": EVERY, **runtime}
    )


def _killer(kind: str, method: str) -> ActorKiller:
    """Kills one actor mid-chunk, once a PS shard has applied KILL_AFTER pushes."""
    return ActorKiller(kind, method, KILL_AFTER, timeout_s=120)


def _model(summary: RunSummary) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    ckpt = load_checkpoint(Path(summary.output_dir) / "model")
    dense = {k: v.detach().numpy() for k, v in ckpt.net.state_dict().items()}
    state = ckpt.table.state()
    return dense, state


@pytest.fixture(scope="module")
def undisturbed(ray_local, dataset, tmp_path_factory) -> RunSummary:
    out = tmp_path_factory.mktemp("undisturbed")
    return train(
        make_job(dataset, out), load_plan(PLANS / "small_three_stage.json"), steps=STEPS, progress=False
    )


@pytest.mark.parametrize(
    "kind,method",
    [
        ("ps_shard", "ray.kill"),
        ("data_worker", "ray.kill"),
        ("stage_worker", "sigkill"),
        # each kind's other kill method is in the phase test below: every (kind, method) once
    ],
)
def test_sync_run_survives_a_killed_actor_with_every_batch_applied_once(
    ray_local, dataset, tmp_path, undisturbed, kind, method
):
    killer = _killer(kind, method)
    plan = load_plan(PLANS / "small_three_stage.json")  # 3 stages, 2 PS shards
    # shards as actors to kill one; else hosted in the DataWorker (and killed with it)
    job = make_job(dataset, tmp_path, ps_hosting="actors" if kind == "ps_shard" else "auto")
    summary = train(job, plan, steps=STEPS, progress=False, on_chunk=killer)

    assert killer.killed_at is not None and killer.killed_at < STEPS
    assert summary.steps == STEPS and summary.samples == STEPS * BATCH
    extra = summary.extra
    assert (extra["batches_applied"], extra["batches_lost"], extra["batches_duplicated"]) == (STEPS, 0, 0)
    (fault,) = extra["faults"]
    (actor,) = fault["actors"]
    assert actor["kind"] == kind and actor["replica"] == 0
    assert actor["how"] == ("killed by ray.kill" if method == "ray.kill" else "its worker process died")
    assert fault["rolled_back_to"] % EVERY == 0 and fault["rolled_back_to"] <= fault["step"]
    assert fault["recovery_s"] > 0 and fault["batches_replayed"] >= 0
    assert extra["restarts"] == 1

    np.testing.assert_array_equal(summary.losses, undisturbed.losses)
    assert summary.auc == undisturbed.auc
    _same_model(summary, undisturbed)


def _same_model(summary: RunSummary, undisturbed: RunSummary) -> None:
    """The trained model of `summary` equals the undisturbed run's, dense and sparse, bit for bit."""
    dense_a, sparse_a = _model(undisturbed)
    dense_b, sparse_b = _model(summary)
    for name in dense_a:
        np.testing.assert_array_equal(dense_b[name], dense_a[name], err_msg=name)
    np.testing.assert_array_equal(sparse_b["keys"], sparse_a["keys"])
    for key in ("weights", "accumulators"):
        np.testing.assert_array_equal(sparse_b[key], sparse_a[key], err_msg=key)


@pytest.mark.parametrize(
    "kind,point,method",
    [
        # after the last batch: evaluation and saving talk to the actors too
        ("data_worker", "evaluate", "sigkill"),
        ("stage_worker", "save", "ray.kill"),
        # inside a checkpoint while training
        ("ps_shard", "checkpoint", "sigkill"),
    ],
)
def test_an_actor_dying_in_any_phase_ends_the_run_as_an_undisturbed_one(
    ray_local, dataset, tmp_path, undisturbed, kind, point, method
):
    """A fault in evaluation, in saving or mid-checkpoint: the actor is replaced, every actor rolls back
    to the trained state made durable after the last batch (or the checkpoint before), the phase is done
    again, and the run ends with the AUC, logloss and model an undisturbed run gives."""
    at = EVERY if point == "checkpoint" else STEPS  # armed at a chunk boundary before the phase
    killer = PhaseKiller(kind, point, method, at=at, flag_dir=str(tmp_path))
    job = make_job(dataset, tmp_path / "out", ps_hosting="actors" if kind == "ps_shard" else "auto")
    summary = train(
        job, load_plan(PLANS / "small_three_stage.json"), steps=STEPS, progress=False, on_chunk=killer
    )

    assert killer.armed_at == at
    (fault,) = summary.extra["faults"]
    assert fault["phase"] == ("train" if point == "checkpoint" else point)
    assert [(a["kind"], a["replica"]) for a in fault["actors"]] == [(kind, 0)]
    if point != "checkpoint":  # after the last batch: rolled back to the trained state, nothing replayed
        assert fault["rolled_back_to"] == STEPS and fault["batches_replayed"] == 0
    extra = summary.extra
    assert (extra["batches_applied"], extra["batches_lost"], extra["batches_duplicated"]) == (STEPS, 0, 0)
    assert (summary.auc, summary.logloss) == (undisturbed.auc, undisturbed.logloss)
    np.testing.assert_array_equal(summary.losses, undisturbed.losses)
    _same_model(summary, undisturbed)


def test_a_fault_before_any_checkpoint_replays_from_the_start(ray_local, dataset, tmp_path, undisturbed):
    # No checkpoints: chunks of 20 batches, and the killer strikes during the second chunk.
    killer = _killer("stage_worker", "ray.kill")
    job = make_job(dataset, tmp_path, checkpoint_every=0)
    steps = 24
    summary = train(
        job, load_plan(PLANS / "small_three_stage.json"), steps=steps, progress=False, on_chunk=killer
    )
    (fault,) = summary.extra["faults"]
    assert fault["recovery_point"] == "start" and fault["rolled_back_to"] == 0
    assert fault["batches_replayed"] >= 20
    assert (summary.extra["batches_applied"], summary.extra["batches_lost"]) == (steps, 0)
    assert summary.extra["batches_duplicated"] == 0
    np.testing.assert_array_equal(summary.losses[:STEPS], undisturbed.losses)


class _KillBetweenChunks:
    """An ``on_chunk`` hook: at the first chunk boundary from `step` on, SIGKILL DataWorker 0's process
    (it hosts the PS shards) and return once it is gone, as when its node goes away: the driver's next
    calls between chunks (the PS stats it tracks) find the actor dead."""

    def __init__(self, step: int):
        self.step, self.killed_at = step, None

    def __call__(self, live) -> None:
        if self.killed_at is not None or live.step < self.step:
            return
        process = psutil.Process(ray.get(live.data_workers[0].describe.remote())["pid"])
        process.kill()
        psutil.wait_procs([process], timeout=30)
        self.killed_at = live.step


def test_an_actor_dying_between_chunks_is_recovered_not_an_error_of_the_run(
    ray_local, dataset, tmp_path, undisturbed
):
    """The elastic test once saw its node go away while the driver asked the hosted PS for stats."""
    killer = _KillBetweenChunks(step=2 * EVERY)
    summary = train(
        make_job(dataset, tmp_path), load_plan(PLANS / "small_three_stage.json"), steps=STEPS,
        progress=False, on_chunk=killer,
    )  # fmt: skip
    assert killer.killed_at == 2 * EVERY
    (fault,) = summary.extra["faults"]
    assert [a["kind"] for a in fault["actors"]] == ["data_worker"]
    assert fault["step"] == fault["rolled_back_to"] == 2 * EVERY and fault["batches_replayed"] == 0
    extra = summary.extra
    assert (extra["batches_applied"], extra["batches_lost"], extra["batches_duplicated"]) == (STEPS, 0, 0)
    np.testing.assert_array_equal(summary.losses, undisturbed.losses)


def test_more_deaths_than_max_restarts_fail_with_a_clear_error(ray_local, dataset, tmp_path):
    killer = _killer("ps_shard", "ray.kill")
    job = make_job(dataset, tmp_path, max_restarts=0, ps_hosting="actors")
    with pytest.raises(TooManyFaults, match=r"max_restarts=0.*ps_shard"):
        train(job, load_plan(PLANS / "small_three_stage.json"), steps=STEPS, progress=False, on_chunk=killer)


def _async_plan() -> Plan:
    raw = load_plan(PLANS / "small_async.json").to_dict()
    raw["ps_shards"] = 2
    return Plan.from_dict(raw)


@pytest.mark.slow
def test_async_run_restores_the_ps_snapshot_and_counts_lost_updates(ray_local, dataset, tmp_path):
    runtime = {"max_staleness": 0, "micro_batches": 1}
    steps = 30
    calm = train(
        make_job(dataset, tmp_path / "calm", "async", **runtime), _async_plan(), steps=steps, progress=False
    )
    killer = _killer("ps_shard", "sigkill")
    job = make_job(dataset, tmp_path / "faulted", "async", **runtime)
    summary = train(job, _async_plan(), steps=steps, progress=False, on_chunk=killer)

    assert summary.steps == steps
    (fault,) = summary.extra["faults"]
    assert fault["actors"][0]["kind"] == "ps_shard"
    # one sparse update per batch here; batches still in flight at the kill had not pushed yet
    assert 0 <= fault["updates_lost"] <= fault["batches_replayed"]
    assert fault["updates_lost"] + fault["batches_replayed"] > 0
    assert fault["rolled_back_to"] % EVERY == 0
    assert fault["recovery_point"].startswith(str(tmp_path / "faulted" / "checkpoints" / "step-"))
    assert abs(summary.auc - calm.auc) < 0.01, (summary.auc, calm.auc)
