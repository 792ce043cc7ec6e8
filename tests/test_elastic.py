"""Elastic training: a run resumes from a checkpoint under a different plan (other stage split, other
PS shard count) with the same model as an undisturbed run, and `heterps run` on a real two-node
`ray start` cluster re-plans and finishes when the node holding a resource type is stopped mid-run;
on the same two-node setup a DataWorker on the second node reads the dataset from shared storage."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import TINY_BATCH, TINY_MODEL, LocalRayCluster, tiny_sync_job

from heterps_ray.closedloop.problems import restrict_problem
from heterps_ray.config import JobConfig
from heterps_ray.costmodel import load_problem
from heterps_ray.costmodel.plan import Plan, load_plan
from heterps_ray.errors import InfeasibleError
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import train
from heterps_ray.runtime.elastic import change_reason

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "configs" / "plans"
MODEL, BATCH = TINY_MODEL, TINY_BATCH
TOTAL, STOP = 12, 6


def test_change_reason_and_restricted_problem_keep_the_other_profiles():
    assert change_reason(["a", "b"], ["a", "b"], {"a", "b"}) is None
    assert "['b'] of the plan disappeared" in change_reason(["a", "b"], ["a"], {"a", "b"})
    assert "['b'] appeared" in change_reason(["a"], ["a", "b"], {"a"})
    problem = load_problem(REPO / "configs" / "problems" / "ctr_dnn_cloud.yaml")
    keep = [problem.ps_resource] + [t for t in problem.type_names if t != problem.ps_resource][:1]
    smaller = restrict_problem(problem, keep)
    assert sorted(smaller.type_names) == sorted(keep)
    assert all(set(layer.time_ms) <= set(keep) for layer in smaller.layers)
    assert len(problem.type_names) > len(keep)  # the original still has every type's profile
    with pytest.raises(InfeasibleError, match="PS resource type"):
        restrict_problem(problem, [t for t in problem.type_names if t != problem.ps_resource])
    # a profiled local problem declares the machine its types share: a type that leaves, leaves it too
    local = load_problem(REPO / "benchmarks" / "validate_costmodel" / "costmodel_validation_problem.yaml")
    assert local.hosts and set(local.hosts[0].types) == {"cpu_small", "cpu_big"}
    alone = restrict_problem(local, ["cpu_small"])
    assert alone.hosts is not None and list(alone.hosts[0].types) == ["cpu_small"]


def test_an_elastic_run_starts_without_a_declared_type_that_a_plain_command_requires(ray_local, caplog):
    """`heterps run` connects with all_types=False: a type the Ray cluster lacks now is reported (it may
    join later); every other command refuses it, and a cluster with none of the types is refused."""
    from heterps_ray.cluster import connect
    from heterps_ray.config import ClusterConfig
    from heterps_ray.errors import ConfigError

    raw = yaml.safe_load((REPO / "configs" / "clusters" / "local.yaml").read_text())
    later = {**raw["resource_types"][1], "name": "cpu_later"}  # the session's Ray does not declare it
    cluster = ClusterConfig.model_validate({**raw, "resource_types": [*raw["resource_types"], later]})
    with caplog.at_level("WARNING", logger="heterps_ray.cluster"):
        assert connect(cluster, all_types=False) is False  # Ray was running: not started here
    assert "lacks resource type(s) ['cpu_later'] now" in caplog.text
    with pytest.raises(ConfigError, match=r"it lacks \['cpu_later'\]"):
        connect(cluster)
    alone = ClusterConfig.model_validate({**raw, "resource_types": [later], "ps": {"resource": "cpu_later"}})
    with pytest.raises(ConfigError, match=r"it lacks \['cpu_later'\]"):
        connect(alone, all_types=False)


@pytest.fixture(scope="module")
def dataset(tiny_dataset) -> Path:
    return tiny_dataset


def test_resume_under_another_plan_and_shard_count_equals_an_undisturbed_run(
    ray_local, dataset, undisturbed_tiny_run, tmp_path
):
    from conftest import UNDISTURBED_STEPS

    three_stages = load_plan(PLANS / "small_three_stage.json")  # 3 stages, 2 PS shards
    raw = load_plan(PLANS / "small_two_stage.json").to_dict()  # 2 stages on cpu_big
    raw["ps_shards"] = 3
    two_stages = Plan.from_dict(raw)
    whole, whole_dir = undisturbed_tiny_run  # this job under three_stages, TOTAL batches uninterrupted
    assert UNDISTURBED_STEPS == TOTAL
    run_dir = tmp_path / "replanned"
    train(_job(dataset, run_dir, checkpoint_every=STOP), three_stages, steps=STOP, progress=False)
    resumed = train(
        _job(dataset, run_dir, checkpoint_every=STOP),
        two_stages,
        steps=TOTAL,
        progress=False,
        resume=True,
    )
    assert resumed.extra["resumed_from"]["plan_changed"] is True
    assert resumed.ps_shards == 3 and [s["type"] for s in resumed.stages] == ["cpu_big", "cpu_big"]
    extra = resumed.extra
    assert (extra["batches_applied"], extra["batches_lost"], extra["batches_duplicated"]) == (TOTAL, 0, 0)
    np.testing.assert_array_equal(resumed.losses, whole.losses)
    a, b = load_checkpoint(whole_dir / "model"), load_checkpoint(run_dir / "model")
    for name, value in a.net.state_dict().items():
        np.testing.assert_array_equal(b.net.state_dict()[name].numpy(), value.numpy())
    sa, sb = a.table.state(), b.table.state()
    np.testing.assert_array_equal(sb["keys"], sa["keys"])
    np.testing.assert_array_equal(sb["weights"], sa["weights"])
    np.testing.assert_array_equal(sb["accumulators"], sa["accumulators"])


# -- real second nodes: one that leaves, one a DataWorker reads the shared dataset on ---------------


def _cluster_files(folder: Path) -> tuple[Path, Path]:
    """The head declares only cpu_small; the job's cluster also knows cpu_big (10x cheaper), which
    only the second node has, so the first plan puts layers there."""
    base = yaml.safe_load((REPO / "configs" / "clusters" / "local.yaml").read_text())
    small, big = base["resource_types"]
    big.update(price_per_hour=0.01, torch_threads=1)
    job_cluster = {**base, "name": "elastic-two-nodes", "resource_types": [small, big]}
    head_cluster = {**base, "name": "elastic-head", "resource_types": [small]}
    (folder / "job_cluster.yaml").write_text(yaml.safe_dump(job_cluster, sort_keys=False))
    (folder / "head_cluster.yaml").write_text(yaml.safe_dump(head_cluster, sort_keys=False))
    return folder / "job_cluster.yaml", folder / "head_cluster.yaml"


def _elastic_job(work: Path, job_cluster: Path, name: str, rows: int) -> dict:
    """The job both elastic `heterps run` tests run: a tiny sync model, small batches, so it is still
    training when a node leaves or joins; checkpoints every 10 batches."""
    return {
        "name": name,
        "model": {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]},
        "cluster": str(job_cluster),
        "data": {"path": str(work / "data"), "synth_rows": rows},
        "batch_size": 32,
        "samples": 1_000_000,
        "throughput_min": 50,
        "mode": "sync",
        "scheduler": "exact",
        "output_dir": str(work / "out"),
        "seed": 0,
        "runtime": {"checkpoint_every": 10, "micro_batches": 1, "max_in_flight": 1},
    }


class _TwoNodes:
    """One `ray start` head declaring cpu_small (started once for this file's multi-node tests: a start
    and a stop cost seconds each) and, when a test needs it, a second node bringing cpu_big."""

    def __init__(self, cluster: LocalRayCluster):
        self.cluster = cluster
        self.big_node: str | None = None  # the temp dir of the live cpu_big node, if one is up

    def with_big_node(self) -> str:
        if self.big_node is None:
            self.big_node = self.cluster.add_node({"cpu_big": 2})
        return self.big_node

    def stop_big_node(self) -> int:
        """SIGKILL the cpu_big node (a lost machine); returns how many processes it had."""
        assert self.big_node is not None
        killed = self.cluster.stop_node(self.big_node)
        self.big_node = None
        return killed

    def head_alone(self) -> LocalRayCluster:
        """The cluster with no cpu_big node alive (a node stopped here is waited out of ray.nodes())."""
        if self.big_node is not None:
            self.stop_big_node()
            deadline = time.monotonic() + 120
            while "cpu_big" in self.cluster.node_ids():
                assert time.monotonic() < deadline, "the stopped cpu_big node is still alive"
                time.sleep(1)
        return self.cluster


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    _, head_cluster = _cluster_files(tmp_path_factory.mktemp("elastic_head"))
    cluster = LocalRayCluster(head_cluster)
    # The head's GCS declares a SIGKILLed node dead after 5 failed health checks 1 s apart (Ray's
    # default: 3 s apart), so the leave run's re-plan does not wait ~15 s for it; a check still waits
    # Ray's 10 s for an answer, so a node slow under load is not taken for dead.
    cluster.env.update(RAY_health_check_period_ms="1000")
    with cluster:
        yield _TwoNodes(cluster)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_heterps_run_replans_when_the_node_of_a_type_is_stopped_mid_run(two_nodes):
    work = Path(tempfile.mkdtemp(prefix="hps_elastic_"))
    job_cluster, _ = _cluster_files(work)
    steps = 1200
    job = _elastic_job(work, job_cluster, "elastic-run", 50_000)
    # 45,000 train rows: 1,406 batches of 32, so the run is still training when the node goes.
    (work / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    out = work / "out"
    runner = None
    cluster = two_nodes.cluster
    try:
        two_nodes.with_big_node()
        runner = subprocess.Popen(
            [sys.executable, "-m", "heterps_ray", "run", str(work / "job.yaml"), "--address", cluster.address,
             "--steps", str(steps), "--quick-profile", "--no-progress"],
            cwd=REPO, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while not list((out / "checkpoints").glob("step-*")) and runner.poll() is None:
            assert time.monotonic() < deadline, "training never wrote a checkpoint"
            time.sleep(0.2)
        assert runner.poll() is None, runner.communicate()[0]
        first_plan = json.loads((out / "plan.json").read_text())
        assert "cpu_big" in first_plan["assignment"], first_plan  # else stopping the node changes nothing
        assert two_nodes.stop_big_node() > 0
        text, _ = runner.communicate(timeout=600)
        assert runner.returncode == 0, text
        report = json.loads((out / "run_report.json").read_text())
        assert len(report["replans"]) == 1, text
        (replan,) = report["replans"]
        assert "cpu_big" in replan["reason"] and replan["types_now"] == ["cpu_small"]
        assert "cpu_big" in replan["old_plan"] and "cpu_big" not in replan["new_plan"]
        assert replan["checkpoint"] is not None and "re-plan:" in text
        assert 0 <= replan["restart"]["replan_s"] < replan["restart"]["first_batch_s"], replan
        assert "re-plan: first batch" in text
        summary = json.loads((out / "run_summary.json").read_text())
        assert summary["steps"] == steps and summary["extra"]["batches_applied"] == steps
        assert summary["extra"]["batches_lost"] == 0 and summary["extra"]["batches_duplicated"] == 0
        assert all(s["type"] == "cpu_small" for s in summary["stages"])
        # the floor kept after the re-plan, on the type left
        assert report["floor_met"] is True and report["achieved_throughput"] >= 0.9 * job["throughput_min"]
        # and the model an undisturbed sync run gives: the reference trainer's on the same batches
        from heterps_ray.data.dataset import Dataset
        from heterps_ray.models import build_model
        from heterps_ray.runtime.reference import ReferenceTrainer

        config = JobConfig.model_validate({**job, "cluster": yaml.safe_load(job_cluster.read_text())})
        trainer = ReferenceTrainer(build_model(config.model), config.optimizer, seed=config.seed)
        trainer.fit(Dataset(work / "data"), config.batch_size, steps=steps, progress=False)
        reference = trainer.evaluate(Dataset(work / "data").load("eval"))
        assert abs(report["auc"] - reference["auc"]) < 2e-3, (report["auc"], reference["auc"])
        assert abs(report["logloss"] - reference["logloss"]) < 2e-3
        print(text)
    finally:
        if runner is not None and runner.poll() is None:
            runner.kill()
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_heterps_run_profiles_a_type_that_joins_mid_run_and_replans_onto_it(two_nodes):
    """The run starts on the head alone (cpu_small); a second `ray start` node brings cpu_big, which the
    job's cluster declares but the start could not profile: it is profiled when it joins, the re-plan
    moves the layers onto it (10x cheaper), and the run finishes training like the reference."""
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.models import build_model
    from heterps_ray.runtime.reference import ReferenceTrainer

    work = Path(tempfile.mkdtemp(prefix="hps_join_"))
    job_cluster, _ = _cluster_files(work)
    steps = 2400
    job = _elastic_job(work, job_cluster, "join-run", 100_000)
    # 90,000 train rows: 2,812 batches of 32, so the run is still training when the node has joined.
    (work / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    out = work / "out"
    runner = None
    cluster = two_nodes.head_alone()
    try:
        try:
            runner = subprocess.Popen(
                [sys.executable, "-m", "heterps_ray", "run", str(work / "job.yaml"), "--address",
                 cluster.address, "--steps", str(steps), "--quick-profile", "--no-progress"],
                cwd=REPO, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            deadline = time.monotonic() + 600
            while not list((out / "checkpoints").glob("step-*")) and runner.poll() is None:
                assert time.monotonic() < deadline, "training never wrote a checkpoint"
                time.sleep(0.2)
            assert runner.poll() is None, runner.communicate()[0]
            first = load_problem(out / "problem.yaml")
            assert first.type_names == ["cpu_small"]  # cpu_big was not in the cluster: not profiled
            two_nodes.with_big_node()
            text, _ = runner.communicate(timeout=600)
            assert runner.returncode == 0, text
        finally:
            if runner is not None and runner.poll() is None:
                runner.kill()
        assert "lacks resource type(s) ['cpu_big'] now" in text  # said at the start, not refused
        report = json.loads((out / "run_report.json").read_text())
        assert len(report["replans"]) == 1, text
        (replan,) = report["replans"]
        assert "['cpu_big'] appeared" in replan["reason"], replan
        assert replan["types_now"] == ["cpu_small", "cpu_big"] and replan["profiled_types"] == ["cpu_big"]
        replanned = load_problem(replan["problem_file"])
        assert sorted(replanned.type_names) == ["cpu_big", "cpu_small"]
        for before, after in zip(first.layers, replanned.layers, strict=True):
            assert after.time_ms["cpu_small"] == before.time_ms["cpu_small"]  # kept as first measured
            big = after.time_ms["cpu_big"]  # measured on the node that joined
            assert big.fixed + big.per_sample * job["batch_size"] > 0, after.name
        resource = replanned.resources[replanned.type_names.index("cpu_big")]
        assert resource.price_per_hour == 0.01  # from the job's cluster config
        assert "cpu_big" in replan["new_plan"] and "cpu_big" not in replan["old_plan"]
        summary = json.loads((out / "run_summary.json").read_text())
        assert summary["steps"] == steps and summary["extra"]["batches_applied"] == steps
        assert summary["extra"]["batches_lost"] == 0 and summary["extra"]["batches_duplicated"] == 0
        assert any(s["type"] == "cpu_big" for s in summary["stages"])
        config = JobConfig.model_validate({**job, "cluster": yaml.safe_load(job_cluster.read_text())})
        trainer = ReferenceTrainer(build_model(config.model), config.optimizer, seed=config.seed)
        trainer.fit(Dataset(work / "data"), config.batch_size, steps=steps, progress=False)
        reference = trainer.evaluate(Dataset(work / "data").load("eval"))
        assert abs(report["auc"] - reference["auc"]) < 2e-3, (report["auc"], reference["auc"])
        print(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_data_worker_on_another_node_reads_the_dataset_from_shared_storage(two_nodes, dataset, tmp_path):
    """Shared storage (the local filesystem stands in for an NFS or S3 mount): the dataset and the
    output_dir are at one path every node sees; the whole model's DataWorker (its PS shards hosted in
    its process) runs on the second node, the only one with cpu_big, and trains like the reference."""
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.models import build_model
    from heterps_ray.runtime.reference import ReferenceTrainer

    steps = 20
    job = _job(dataset, tmp_path / "out", checkpoint_every=10)
    (tmp_path / "job.yaml").write_text(job.model_dump_json())  # JSON is YAML
    plan = json.loads((PLANS / "one_stage_big.json").read_text())  # the whole model on cpu_big
    layers = [layer.name for layer in build_model(job.model).layers]
    plan.update(
        assignment=["cpu_big"] * len(layers), stages=[{"layers": layers, "type": "cpu_big", "replicas": 1}]
    )
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    cluster = two_nodes.cluster
    two_nodes.with_big_node()
    trained = subprocess.run(
        [sys.executable, "-m", "heterps_ray", "train", str(tmp_path / "job.yaml"), "--plan",
         str(tmp_path / "plan.json"), "--address", cluster.address, "--steps", str(steps),
         "--no-progress"],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout + trained.stderr
    nodes = cluster.node_ids()
    (big_node,) = nodes["cpu_big"]
    assert big_node not in nodes["cpu_small"]  # a node of its own, not the head
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    (data_worker,) = [a for a in summary["placement"] if a["role"] == "data"]
    assert data_worker["node_id"] == big_node and data_worker["hosted_shards"] == 1
    assert summary["steps"] == steps and summary["extra"]["batches_applied"] == steps
    # the PS shard in that DataWorker wrote its checkpoint snapshots into the shared output_dir
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step-*/ps-shard-*.npz")) == [
        "ps-shard-00000.npz",
        "ps-shard-00000.npz",
    ]
    trainer = ReferenceTrainer(build_model(job.model), job.optimizer, seed=job.seed)
    history = trainer.fit(Dataset(dataset), job.batch_size, steps=steps, progress=False)
    reference = trainer.evaluate(Dataset(dataset).load("eval"))
    np.testing.assert_allclose(summary["losses"], history["loss"], rtol=0, atol=1e-4)
    assert abs(summary["auc"] - reference["auc"]) < 1e-3, (summary["auc"], reference["auc"])


def _job(dataset: Path, output: Path, checkpoint_every: int = 0) -> JobConfig:
    return tiny_sync_job("elastic-test", dataset, output, checkpoint_every)
