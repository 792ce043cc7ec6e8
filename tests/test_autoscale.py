"""`heterps run` on an autoscaling cluster: Ray's own autoscaler with its fake multi-node provider
(tests/helpers.py LocalAutoscalingCluster; one worker node type per resource type, each from 0 nodes)
stands in for KubeRay. The run asks for exactly the nodes its actors need, trains as on the embedded
cluster, gives them back; a type whose launch never completes is re-planned around."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, LocalAutoscalingCluster, tiny_sync_job

from heterps_ray.cli import main
from heterps_ray.closedloop.autoscale import actor_bundle, plan_bundles, profile_bundles
from heterps_ray.costmodel import load_problem, problem_from_dict
from heterps_ray.costmodel.plan import Plan, load_plan

CLUSTER = REPO / "configs" / "clusters" / "local.yaml"
PLANS = REPO / "configs" / "plans"
IDLE_MINUTES = 0.1  # the fake cluster's idle timeout: a node with no actor goes after 6 s
# a fake node the provider can never start: its object store is larger than any machine, so each
# launch fails before a raylet runs (pending in the autoscaler's report, the node never joins)
NEVER_STARTS = {"cpu_big": {"resources": {"CPU": 1, "cpu_big": 1, "object_store_memory": 10**15}}}


def test_bundles_are_the_actors_a_plan_starts():
    job = tiny_sync_job("bundles", Path("/nonexistent"), Path("/nonexistent"))
    small, big = actor_bundle(job.cluster, "cpu_small"), actor_bundle(job.cluster, "cpu_big")
    assert small == {"CPU": 0.25, "cpu_small": 1.0} and big == {"CPU": 0.5, "cpu_big": 1.0}
    assert profile_bundles(job.cluster) == [small, big]
    two = load_plan(PLANS / "small_two_stage.json")  # single replicas: the PS lives in DataWorker 0
    assert plan_bundles(job, two, None) == [actor_bundle(job.cluster, s.type) for s in two.stages]
    raw = two.to_dict()
    raw["stages"][1]["replicas"] = 2  # a replicated stage: every shard is an actor of the PS type
    replicated = Plan.from_dict(raw)
    assert plan_bundles(job, replicated, None) == [
        actor_bundle(job.cluster, two.stages[0].type),
        *[actor_bundle(job.cluster, two.stages[1].type)] * 2,
        *[small] * replicated.ps_shards,
    ]


def _split_problem(folder: Path) -> Path:
    """The local profiled problem (benchmarks/validate_costmodel/) on TINY_MODEL's layers (no fc3, fc4), the embedding 50x
    slower on cpu_big and the dense layers 50x slower on cpu_small: the cheapest plan is embedding@cpu_small | fc1..logit@cpu_big, one
    actor of each (the PS in the DataWorker), so the run needs one node of each type."""
    data = load_problem(REPO / "benchmarks" / "validate_costmodel" / "costmodel_validation_problem.yaml")
    data = data.to_dict()
    data["layers"] = [layer for layer in data["layers"] if layer["name"] not in ("fc3", "fc4")]
    for layer in data["layers"]:
        slow = layer["time_ms"]["cpu_big" if layer["name"] == "embedding" else "cpu_small"]
        slow["fixed"] *= 50
        slow["per_sample"] *= 50
    data["hosts"] = None  # the fake nodes are machines of their own
    return problem_from_dict(data).save(folder / "split_problem.yaml")


def _job_file(folder: Path, name: str, timeout_s: float, autoscale: bool = True) -> Path:
    from heterps_ray.data.synth import synthesize

    data = folder / "data"
    if not data.exists():
        synthesize(data, 2_000, seed=11, rows_per_part=1_000)
    job = tiny_sync_job(name, data, folder / name).model_dump(mode="json")
    job["cluster"]["autoscale"] = {"enabled": autoscale, "node_timeout_s": timeout_s}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


# Polls ray.nodes() every 0.5 s until its stdin closes; prints the most nodes of each type seen at once.
_POLLER = """
import json, sys, threading, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
most = {}
while not done.is_set():
    now = {}
    for n in ray.nodes():
        if n["Alive"]:
            for name in n["Resources"]:
                if name in ("cpu_small", "cpu_big"):
                    now[name] = now.get(name, 0) + 1
    most = {k: max(most.get(k, 0), now.get(k, 0)) for k in {*most, *now}}
    time.sleep(0.5)
print(json.dumps(most))
"""


def _run_on(cluster: LocalAutoscalingCluster, job: Path, problem: Path, steps: int) -> tuple[str, dict]:
    """`heterps run JOB --problem P --address HEAD` on `cluster`; (its output, the most nodes of each
    type seen at once while it ran)."""
    poller = subprocess.Popen(
        [sys.executable, "-c", _POLLER, cluster.address], cwd=REPO, env=cluster.env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        run = subprocess.run(
            [sys.executable, "-m", "heterps_ray", "run", str(job), "--problem", str(problem), "--address",
             cluster.address, "--steps", str(steps), "--no-progress"],
            cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        most, _ = poller.communicate("", timeout=60)
    finally:
        if poller.poll() is None:
            poller.kill()
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout, json.loads(most.strip().splitlines()[-1])


def _wait_gone(cluster: LocalAutoscalingCluster, within_s: float) -> float:
    """Seconds until no node of a resource type is left (the autoscaler released them)."""
    t0 = time.monotonic()
    while cluster.nodes_by_type():
        assert time.monotonic() - t0 < within_s, f"nodes still up: {cluster.nodes_by_type()}"
        time.sleep(2)
    return time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_gets_exactly_the_nodes_of_its_plan_trains_as_embedded_and_gives_them_back(ray_local, tmp_path):
    problem = _split_problem(tmp_path)
    job = _job_file(tmp_path, "autoscaled", timeout_s=240)
    steps = 20
    plain = _job_file(tmp_path, "embedded", timeout_s=240, autoscale=False)
    with LocalAutoscalingCluster(CLUSTER, idle_timeout_minutes=IDLE_MINUTES) as cluster:
        assert cluster.nodes_by_type() == {}  # the head alone
        text, most = _run_on(cluster, job, problem, steps)
        ended = time.monotonic()
        # the same plan on the embedded cluster (every type declared: the session's Ray), same data and
        # seed, run while the autoscaler's idle timeout counts down on the nodes the run gave back
        assert (
            main(["run", str(plain), "--problem", str(problem), "--steps", str(steps), "--no-progress"]) == 0
        )
        _wait_gone(cluster, within_s=120)
        gone_after = time.monotonic() - ended
    report = json.loads((tmp_path / "autoscaled" / "run_report.json").read_text())
    assert report["plan"] == "embedding..embedding@cpu_smallx1 | fc1..logit@cpu_bigx1 | ps x1", report["plan"]
    assert most == {"cpu_small": 1, "cpu_big": 1}, (most, text)  # one node per actor, no more
    (wait,) = report["node_requests"]
    assert wait["purpose"] == "plan" and wait["missing"] == []
    assert wait["requested"] == {"cpu_small": 1.0, "cpu_big": 1.0}
    assert sorted(t for j in wait["joined"] for t in j["types"]) == ["cpu_big", "cpu_small"]
    assert report["node_wait_s"] == pytest.approx(wait["seconds"]) and report["node_wait_s"] > 0
    assert report["node_wait_cost"] == pytest.approx(
        sum(h * {"cpu_small": 0.10, "cpu_big": 0.34}[t] for t, h in wait["node_hours"].items()), abs=1e-6
    )
    assert "nodes: + cpu_" in text and "joined after" in text and report["replans"] == []
    print(text, f"nodes released {gone_after:.0f} s after the run")
    same = json.loads((tmp_path / "embedded" / "run_report.json").read_text())
    assert same["plan"] == report["plan"] and same["node_requests"] == []
    assert abs(report["auc"] - same["auc"]) < 1e-3, (report["auc"], same["auc"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_type_whose_launch_never_completes_is_replanned_around(tmp_path):
    """The PS type keeps one node up (min_workers 1, as the rendered configs keep ps.min_shards), cpu_big's
    launches fail: after node_timeout_s the run re-plans on cpu_small alone and trains."""
    problem = _split_problem(tmp_path)
    # the standing cpu_small node is up before the run starts: only cpu_big is awaited, and it never
    # comes, so any timeout shows the re-plan; a short one keeps the test short
    timeout_s = 5.0
    job = _job_file(tmp_path, "never", timeout_s=timeout_s)
    types = {"cpu_small": {"min_workers": 1}, **NEVER_STARTS}
    with LocalAutoscalingCluster(CLUSTER, idle_timeout_minutes=IDLE_MINUTES, node_types=types) as cluster:
        deadline = time.monotonic() + 300
        while cluster.nodes_by_type() != {"cpu_small": 1}:  # the PS type's standing node
            assert time.monotonic() < deadline, cluster.nodes_by_type()
            time.sleep(2)
        text, most = _run_on(cluster, job, problem, steps=20)
    report = json.loads((tmp_path / "never" / "run_report.json").read_text())
    assert most == {"cpu_small": 1}, (most, text)  # cpu_big never joined
    first, again = report["node_requests"]
    assert first["missing"] == ["cpu_big"] and first["seconds"] >= timeout_s
    assert again["missing"] == [] and again["requested"] == {"cpu_small": 1.0}
    (replan,) = report["replans"]
    assert f"['cpu_big'] of the plan did not arrive within {timeout_s:.0f} s" in replan["reason"]
    assert "cpu_big" in replan["old_plan"] and "cpu_big" not in replan["new_plan"]
    assert replan["types_now"] == ["cpu_small"] and "cpu_big" not in report["plan"]
    assert f"did not arrive within {timeout_s:.0f} s" in text and report["auc"] is not None
    summary = json.loads((tmp_path / "never" / "run_summary.json").read_text())
    assert summary["steps"] == 20 and all(s["type"] == "cpu_small" for s in summary["stages"])
    print(text)
