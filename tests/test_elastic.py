"""Elastic training: a run resumes from a checkpoint under a different plan (other stage split, other
PS shard count) with the same model as an undisturbed run, and `heterps run` on a real two-node
`ray start` cluster re-plans and finishes when the node holding a resource type is stopped mid-run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
from helpers import TINY_BATCH, TINY_MODEL, free_ports, tiny_sync_job

from heterps_ray.config import JobConfig
from heterps_ray.costmodel import load_problem
from heterps_ray.errors import InfeasibleError
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import train
from heterps_ray.runtime.elastic import change_reason, restrict_problem
from heterps_ray.scheduling.plan import Plan, load_plan

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "configs" / "plans"
SCRIPT = REPO / "scripts" / "ray_cluster.sh"
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
    local = load_problem(REPO / "benchmarks" / "costmodel_validation_problem.yaml")
    assert local.hosts and set(local.hosts[0].types) == {"cpu_small", "cpu_big"}
    alone = restrict_problem(local, ["cpu_small"])
    assert alone.hosts is not None and list(alone.hosts[0].types) == ["cpu_small"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("elastic") / "data"
    synthesize(path, 2_000, seed=11, rows_per_part=1_000)
    return path


def test_resume_under_another_plan_and_shard_count_equals_an_undisturbed_run(ray_local, dataset, tmp_path):
    three_stages = load_plan(PLANS / "small_three_stage.json")  # 3 stages, 2 PS shards
    raw = load_plan(PLANS / "small_two_stage.json").to_dict()  # 2 stages on cpu_big
    raw["ps_shards"] = 3
    two_stages = Plan.from_dict(raw)
    whole = train(_job(dataset, tmp_path / "whole"), three_stages, steps=TOTAL, progress=False)
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
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=0, atol=1e-6)
    a, b = load_checkpoint(tmp_path / "whole" / "model"), load_checkpoint(run_dir / "model")
    for name, value in a.net.state_dict().items():
        np.testing.assert_allclose(b.net.state_dict()[name].numpy(), value.numpy(), rtol=0, atol=1e-6)
    sa, sb = a.table.state(), b.table.state()
    np.testing.assert_array_equal(sb["keys"], sa["keys"])
    np.testing.assert_allclose(sb["weights"], sa["weights"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(sb["accumulators"], sa["accumulators"], rtol=0, atol=1e-6)


# -- a real second node that leaves ---------------------------------------------------------------


def _stop_node(ray_tmp: str) -> int:
    """End the processes of the node whose temp dir is `ray_tmp`, and their children (never `ray
    stop`, which ends every Ray on the machine). Returns how many there were."""
    marks = (f"{ray_tmp}/session_", f"--temp-dir={ray_tmp}", f"--temp-dir {ray_tmp}")
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.NoSuchProcess:
            continue
        if any(m in cmd for m in marks) and p.pid != os.getpid():
            roots.append(p)
    procs = {}
    for r in roots:
        try:
            procs.update({c.pid: c for c in [r, *r.children(recursive=True)]})
        except psutil.NoSuchProcess:
            continue
    for p in procs.values():  # SIGKILL: the node crashes, as a lost machine would
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(procs.values()), timeout=10)
    return len(procs)


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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_heterps_run_replans_when_the_node_of_a_type_is_stopped_mid_run():
    head_tmp = tempfile.mkdtemp(prefix="hps_h_", dir="/tmp")  # short: Ray's socket paths live under it
    node_tmp = tempfile.mkdtemp(prefix="hps_w_", dir="/tmp")
    work = Path(tempfile.mkdtemp(prefix="hps_elastic_"))
    head_port, dashboard_port, *agent_ports = free_ports(6)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMP=head_tmp, HEAD_PORT=str(head_port), DASHBOARD_PORT=str(dashboard_port), NUM_CPUS="2")
    env["RAY_AUTH_MODE"] = "token"  # the head keeps token authentication on; the node and driver use it
    job_cluster, head_cluster = _cluster_files(work)
    steps = 1200
    job = {
        "name": "elastic-run",
        "model": {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]},
        "cluster": str(job_cluster),
        "data": {"path": str(work / "data"), "synth_rows": 50_000},
        "batch_size": 32,
        "samples": 1_000_000,
        "throughput_min": 50,
        "mode": "sync",
        "scheduler": "exact",
        "output_dir": str(work / "out"),
        "seed": 0,
        "runtime": {"checkpoint_every": 10, "micro_batches": 1, "max_in_flight": 1},
    }
    # 45,000 train rows: 1,406 batches of 32, so the run is still training when the node goes.
    (work / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    out = work / "out"
    runner = None
    try:
        started = subprocess.run(
            [str(SCRIPT), "start", str(head_cluster)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert started.returncode == 0, started.stdout + started.stderr
        node = subprocess.run(
            [
                str(REPO / ".venv" / "bin" / "ray"),
                "start",
                "--address",
                f"127.0.0.1:{head_port}",
                "--node-ip-address",
                "127.0.0.1",
                "--num-cpus",
                "1",
                "--resources",
                json.dumps({"cpu_big": 2}),
                "--temp-dir",
                node_tmp,
                "--dashboard-agent-listen-port",
                str(agent_ports[0]),
                "--dashboard-agent-grpc-port",
                str(agent_ports[1]),
                "--runtime-env-agent-port",
                str(agent_ports[2]),
                "--metrics-export-port",
                str(agent_ports[3]),
                "--disable-usage-stats",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert node.returncode == 0, node.stdout + node.stderr
        runner = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "heterps_ray",
                "run",
                str(work / "job.yaml"),
                "--address",
                f"127.0.0.1:{head_port}",
                "--steps",
                str(steps),
                "--quick-profile",
                "--no-progress",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 600
        while not list((out / "checkpoints").glob("step-*")) and runner.poll() is None:
            assert time.monotonic() < deadline, "training never wrote a checkpoint"
            time.sleep(0.2)
        assert runner.poll() is None, runner.communicate()[0]
        first_plan = json.loads((out / "plan.json").read_text())
        assert "cpu_big" in first_plan["assignment"], first_plan  # else stopping the node changes nothing
        assert _stop_node(node_tmp) > 0
        text, _ = runner.communicate(timeout=600)
        assert runner.returncode == 0, text
        report = json.loads((out / "run_report.json").read_text())
        assert len(report["replans"]) == 1, text
        (replan,) = report["replans"]
        assert "cpu_big" in replan["reason"] and replan["types_now"] == ["cpu_small"]
        assert "cpu_big" in replan["old_plan"] and "cpu_big" not in replan["new_plan"]
        assert replan["checkpoint"] is not None and "re-plan:" in text
        summary = json.loads((out / "run_summary.json").read_text())
        assert summary["steps"] == steps and summary["extra"]["batches_applied"] == steps
        assert summary["extra"]["batches_lost"] == 0 and summary["extra"]["batches_duplicated"] == 0
        assert all(s["type"] == "cpu_small" for s in summary["stages"])
        assert 0.5 < report["auc"] < 1.0 and report["achieved_throughput"] > 0
    finally:
        if runner is not None and runner.poll() is None:
            runner.kill()
        _stop_node(node_tmp)
        subprocess.run([str(SCRIPT), "stop"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(head_tmp, ignore_errors=True)
        shutil.rmtree(node_tmp, ignore_errors=True)


def _job(dataset: Path, output: Path, checkpoint_every: int = 0) -> JobConfig:
    return tiny_sync_job("elastic-test", dataset, output, checkpoint_every)
