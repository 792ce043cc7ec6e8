"""Warm actors (runtime/warm.py): a run's actors are reconfigured for the next run in the same driver,
and a reused actor carries nothing of the last run: plan B trained on plan A's actors is exactly plan B
trained on fresh ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import ray
import yaml
from helpers import TINY_MODEL, local_job, tiny_sync_job

from heterps_ray.cli import main
from heterps_ray.closedloop import REPORT_FILE
from heterps_ray.closedloop.probes import WarmHosts
from heterps_ray.config import load_cluster
from heterps_ray.costmodel import problem_from_dict
from heterps_ray.costmodel.plan import Plan, load_plan
from heterps_ray.profiling.placement import start_profiling
from heterps_ray.runtime import loop, warm
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import train
from heterps_ray.runtime.loop import LiveActors

REPO = Path(__file__).resolve().parents[1]
STEPS = 60


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("warm") / "data"
    synthesize(path, 6_000, seed=4, rows_per_part=2_000)
    return path


def _plan_b() -> Plan:
    """Two stages (embedding on cpu_small, the rest on cpu_big): the types of plan A's first two stages."""
    raw = load_plan(REPO / "configs" / "plans" / "small_two_stage.json").to_dict()
    raw["stages"][0]["type"] = "cpu_small"
    raw["assignment"] = ["cpu_small", "cpu_big", "cpu_big", "cpu_big"]
    return Plan.from_dict(raw)


def test_plan_b_on_plan_a_s_warm_actors_trains_exactly_plan_b_on_fresh_ones(ray_local, dataset, tmp_path):
    plan_a = load_plan(REPO / "configs" / "plans" / "small_three_stage.json")  # cpu_small, cpu_big, cpu_small
    plan_b = _plan_b()
    job_b = tiny_sync_job("warm-b", dataset, tmp_path / "fresh", checkpoint_every=20)

    warm.release_idle()
    before = warm.counts()
    fresh = train(job_b, plan_b, steps=STEPS, progress=False)
    assert warm.counts()["reused"] == before["reused"]  # nothing idle: every actor new

    warm.release_idle()
    armed: list[str] = []

    def arm_every_actor(live: LiveActors) -> None:
        """Plan A's actors are told to die when they next save the model, which plan A never does."""
        if not armed:
            for actor in [*live.data_workers, *(w for r in live.stage_workers for w in r)]:
                actor.arm_fault.remote("save")
                armed.append("save")

    # another seed and data order than plan B's: whatever it left in an actor would change B's model
    job_a = tiny_sync_job("warm-a", dataset, tmp_path / "a").model_copy(update={"seed": 99})
    train(job_a, plan_a, steps=STEPS, progress=False, on_chunk=arm_every_actor, save=False)
    assert armed

    before = warm.counts()
    job_again = tiny_sync_job("warm-b", dataset, tmp_path / "again", checkpoint_every=20)
    again = train(job_again, plan_b, steps=STEPS, progress=False)
    used = {k: warm.counts()[k] - before[k] for k in before}
    assert used == {"reused": 2, "started": 0}  # plan A's DataWorker (cpu_small) and cpu_big stage

    # no armed fault, table row, optimizer state or RNG state came along
    assert again.extra["faults"] == [] and again.extra["checkpoints"] and again.extra["restarts"] == 0
    assert again.losses == fresh.losses and again.auc == fresh.auc
    a, b = load_checkpoint(tmp_path / "fresh" / "model"), load_checkpoint(tmp_path / "again" / "model")
    for name, value in a.net.state_dict().items():
        np.testing.assert_array_equal(b.net.state_dict()[name].numpy(), value.numpy())
    sa, sb = a.table.state(), b.table.state()
    for key in ("keys", "weights", "accumulators"):
        np.testing.assert_array_equal(sb[key], sa[key])

    # the profile's hosts (blank runtime actors that timed layers and messages): plan B on them is plan B
    warm.release_idle()
    hosts, cluster = WarmHosts(), job_b.cluster
    groups = {t.name: hosts.start(t, 2) for t in cluster.resource_types}
    for name, group in groups.items():
        start_profiling(group, cluster.type(name), TINY_MODEL, 5, timeout_s=60)
        ray.get(
            [group[0].time_layers.remote([(0, 32), (1, 32)], 1, 5), group[0].send.remote(group[1], 4096, 2)]
        )
        hosts.release(cluster.type(name), group, reuse=True)
    before = warm.counts()
    profiled = train(
        tiny_sync_job("warm-b", dataset, tmp_path / "profiled", checkpoint_every=20),
        plan_b,
        steps=STEPS,
        progress=False,
    )
    assert {k: warm.counts()[k] - before[k] for k in before} == {"reused": 2, "started": 0}
    assert profiled.losses == fresh.losses and profiled.auc == fresh.auc
    c = load_checkpoint(tmp_path / "profiled" / "model")
    for name, value in a.net.state_dict().items():
        np.testing.assert_array_equal(c.net.state_dict()[name].numpy(), value.numpy())


def test_idle_actors_make_room_for_a_plan_that_needs_their_slots(ray_local, dataset, tmp_path):
    """cpu_big has 2 units: two idle cpu_big actors of another kind are killed for a plan that needs
    both units, instead of leaving its actors unplaced."""
    warm.release_idle()
    two_big = load_plan(REPO / "configs" / "plans" / "small_two_stage.json")  # DataWorker + stage on cpu_big
    train(tiny_sync_job("warm-big", dataset, tmp_path / "big"), two_big, steps=10, progress=False)
    raw = two_big.to_dict()  # now both cpu_big units as stage replicas: async, two replicas of stage 1
    raw["stages"][0]["type"] = "cpu_small"
    raw["stages"][1]["replicas"] = 2
    raw["assignment"] = ["cpu_small", "cpu_big", "cpu_big", "cpu_big"]
    job = tiny_sync_job("warm-replicas", dataset, tmp_path / "replicas").model_copy(update={"mode": "async"})
    summary = train(job, Plan.from_dict(raw), steps=10, progress=False)
    assert [s["type"] for s in summary.stages] == ["cpu_small", "cpu_big"] and summary.steps == 10
    warm.release_idle()


def _optimistic_problem(folder: Path) -> Path:
    """The tiny model's four layers priced near-free on both types, cpu_big at 100x cpu_small's price
    and the PS unlimited: one stage on cpu_small promises any floor and is the cheapest plan; once it
    missed and the model was refit on it, one stage on cpu_big is the plan that still promises it."""
    names = ["embedding", "fc1", "fc2", "logit"]
    free = {"fixed": 0.001, "per_sample": 1e-6}
    data = {
        "name": "tiny, optimistic",
        "batch_size": 64,
        "samples": 1e6,
        "throughput_min": 0,
        "input_bytes_per_sample": 100,
        "resources": [
            {"name": "cpu_small", "price_per_hour": 0.1, "max_instances": 4, "bandwidth_gbps": 10},
            {"name": "cpu_big", "price_per_hour": 10.0, "max_instances": 2, "bandwidth_gbps": 10},
        ],
        "ps": {"resource": "cpu_small", "min_shards": 1},
        "layers": [
            {"name": n, "out_bytes_per_sample": 64, "sparse_rows_per_sample": 26 if n == "embedding" else 0,
             "parallel_fraction": 1.0, "time_ms": {"cpu_small": free, "cpu_big": free}}
            for n in names
        ],
    }  # fmt: skip
    return problem_from_dict(data).save(folder / "optimistic.yaml")


def test_a_replan_onto_a_type_already_up_reconfigures_its_actor_and_reports_its_first_batch(
    ray_local, dataset, tmp_path, monkeypatch, capsys
):
    """`heterps run` holds its warm actors (warm.hold) from the profile to its last re-plan: the
    closed loop misses its floor on one stage on cpu_small and re-plans onto one stage on cpu_big,
    whose DataWorker the profile left up, so the re-plan reconfigures it and starts no process, and
    says how soon it trained again. Idle actors here expire after 1 s (not 20): without the hold the
    cpu_big one would be gone before the re-plan. The floor's window is 1 s (not 3) to keep it short."""
    hosts = WarmHosts()  # a DataWorker of each type up and idle, as the profile leaves them
    cluster = load_cluster(REPO / "configs" / "clusters" / "local.yaml")
    for name in ("cpu_small", "cpu_big"):
        hosts.release(cluster.type(name), hosts.start(cluster.type(name), 1), reuse=True)
    monkeypatch.setattr(warm, "IDLE_S", 1.0)
    monkeypatch.setattr(loop, "FLOOR_WINDOW_S", 1.0)
    job = tiny_sync_job("warm-replan", dataset, tmp_path / "out").model_dump(mode="json")
    job.update(throughput_min=1e6, scheduler="exact", runtime={**job["runtime"], "epochs": 200})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))

    before = warm.counts()
    problem = _optimistic_problem(tmp_path)
    code = main(["run", str(tmp_path / "job.yaml"), "--problem", str(problem), "--no-progress"])
    used = {k: warm.counts()[k] - before[k] for k in before}

    printed = capsys.readouterr()
    assert code == 3, printed.err[-3000:]  # no plan keeps 1M samples/s here: the loop gave up
    attempts = json.loads((tmp_path / "out" / REPORT_FILE).read_text())["floor_attempts"]
    assert attempts[0]["old_plan"].startswith("embedding..logit@cpu_small"), attempts[0]
    assert attempts[0]["new_plan"].startswith("embedding..logit@cpu_big"), attempts[0]
    assert attempts[1]["old_plan"] == attempts[0]["new_plan"]  # the re-plan trained
    assert used == {"reused": 2, "started": 0}  # cpu_small's DataWorker, then cpu_big's: no new process
    restart = attempts[0]["restart"]
    assert 0 <= restart["replan_s"] <= restart["ready_s"] < restart["first_batch_s"], restart
    assert f"re-plan: first batch {restart['first_batch_s']:.1f} s after the decision" in printed.out
    assert f"re-plans    first batch {restart['first_batch_s']:.1f} s after the decision" in printed.out


def test_an_idle_actor_whose_threads_spin_gives_its_core_back(ray_local, dataset, tmp_path):
    """A sync job's actors spin between parallel regions (omp_wait_policy auto: active), but a warm
    actor left idle must not keep a core: a cpu_big actor spinning after its last work took a core from
    the probe or run on another type (BENCHMARKS.md "Idle actors spun")."""
    import time

    import psutil

    from heterps_ray.config import ModelConfig
    from heterps_ray.models import build_model

    # sync, one micro-batch a batch: the job's types spin
    job = local_job("spin", TINY_MODEL, dataset, tmp_path, runtime={"micro_batches": 1})
    rtype = job.cluster.type("cpu_big")
    assert rtype.wait_policy == "active" and rtype.torch_threads == 2
    model = {"name": "ctr_dnn", "embedding_dim": 9, "hidden": [512, 256]}  # matmuls that use both threads
    whole = build_model(ModelConfig(**model)).num_layers
    hosts = WarmHosts()
    group = hosts.start(rtype, 1)
    try:
        (info,) = start_profiling(group, rtype, model, 0, 120.0)
        ray.get(group[0].time_layers.remote([(whole, 1024)] * 20, 1, 0))
        process = psutil.Process(info["pid"])
        time.sleep(0.5)  # past the spin that bridges a training loop's gaps (config.ACTIVE_SPIN_COUNT)
        before, started = sum(process.cpu_times()[:2]), time.monotonic()
        time.sleep(1.0)
        cores = (sum(process.cpu_times()[:2]) - before) / (time.monotonic() - started)
    finally:
        hosts.release(rtype, group, reuse=False)
    assert cores < 0.3, f"an idle cpu_big actor used {cores:.2f} cores"
