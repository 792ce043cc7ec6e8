"""The actor set (runtime/actors.py) when its start fails part way (issue 41): whichever actor cannot
start (a PS shard, a StageWorker, a DataWorker), `heterps train` exits 2 with that actor's error, no
traceback, and the actors started before it are ended; a plan asking for GPUs that the Ray cluster
lacks is refused the same way, before any actor starts.

The in-process cases run on the session Ray (conftest.py: the local cluster's types, and `gpu_t4` with
2 GPUs that no CUDA device backs); the GPU-less one starts its own Ray, as a user's `heterps train` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import TINY_MODEL

from heterps_ray.cli import main
from heterps_ray.config import load_cluster, load_job
from heterps_ray.costmodel.table_memory import estimate_table
from heterps_ray.devices import CUDA_AS_CPU_VAR
from heterps_ray.models import build_model
from heterps_ray.runtime.actors import ActorSet
from heterps_ray.runtime.pipeline import StageSpec

REPO = Path(__file__).resolve().parents[1]
GPU_TYPE = "gpu_t4"  # declared by the session Ray with 2 GPUs and no CUDA behind them
# Ray takes 1, 2, 4 or 8 TPUs an actor: a type asking for 3 is refused when its first actor starts
RAY_REFUSES = "The number of requested 'TPU' was set to 3.0 which is not a supported chip configuration"

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: cuda types work here")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("actors") / "data"
    synthesize(path, 600, seed=1)
    return path


def _local_type(name: str, **changes: Any) -> dict[str, Any]:
    types = {t.name: t for t in load_cluster(REPO / "configs" / "clusters" / "local.yaml").resource_types}
    return {**types[name].model_dump(), **changes}


def _gpu_type() -> dict[str, Any]:
    return {
        "name": GPU_TYPE,
        "device": "cuda",
        "price_per_hour": 0.526,
        "max_instances": 1,
        "ray_resources": {"CPU": 0.25},
        "num_gpus": 1,
    }


def _job(folder: Path, data: Path, types: list[dict[str, Any]], ps_type: str) -> Path:
    """A sync CTR-DNN job whose PS shards are actors (not hosted in the DataWorker) on `ps_type`."""
    job = {
        "name": "actor-start",
        "model": TINY_MODEL,  # layers: embedding, fc1, fc2, logit
        "cluster": {"name": "start", "resource_types": types, "ps": {"resource": ps_type}},
        "data": {"path": str(data)},
        "batch_size": 64,
        "samples": 10_000,
        "throughput_min": 0,
        "mode": "sync",
        "output_dir": str(folder / "out"),
        "runtime": {"ps_hosting": "actors"},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _plan(folder: Path, first: str, rest: str, ps_type: str) -> Path:
    """embedding on `first` (its DataWorker), fc1 fc2 logit on `rest` (a StageWorker), 1 PS shard."""
    plan = {
        "assignment": [first, rest, rest, rest],
        "stages": [
            {"layers": ["embedding"], "type": first, "replicas": 1},
            {"layers": ["fc1", "fc2", "logit"], "type": rest, "replicas": 1},
        ],
        "ps_shards": 1,
        "ps_type": ps_type,
        "throughput": None,
        "cost": None,
        "cost_rate": 0.6,
        "feasible": True,
        "scheduler": "manual",
        "seconds": 0.0,
    }
    path = folder / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def _exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "zip()" not in err, err
    return err


def _units_back(ray: Any, name: str, before: float, hold_s: float = 5.0) -> bool:
    """Whether the actors of type `name` that the failed start left are ended: its free units are back
    to `before` and stay there for `hold_s` (a leaked actor, placed a moment later, takes one for good)."""
    deadline, since = time.monotonic() + 20.0, time.monotonic()
    while time.monotonic() < deadline:
        if ray.available_resources().get(name, 0.0) < before:
            since = time.monotonic()
        elif time.monotonic() - since >= hold_s:
            return True
        time.sleep(0.2)
    return False


def test_a_set_that_never_started_walks_and_shuts_down_as_empty(data, tmp_path):
    """The reported crash: a check before start() fails, and the clean-up's walk of the set raised
    `zip() argument 2 is shorter than argument 1` over the check's error."""
    job = load_job(_job(tmp_path, data, [_local_type("cpu_small"), _local_type("cpu_big")], "cpu_small"))
    model = build_model(job.model)
    stages = [
        StageSpec(0, 0, 1, "cpu_small", 1, ("embedding",)),
        StageSpec(1, 1, 4, "cpu_big", 1, ("fc1", "fc2", "logit")),
    ]
    files = sorted((data / "split=train").glob("*.parquet"))
    actors = ActorSet(job, model, stages, 1, files, estimate_table(job, model.embedding_dim))
    assert actors.all_actors() == [] and actors.trained_actors() == {}
    actors.shutdown()  # nothing to end, and no error
    actors.shutdown(keep_warm=True)


@pytest.mark.parametrize(
    ("kind", "first", "rest", "ps_type", "bad", "started_before"),
    [
        # the PS shards start first: nothing before them
        ("ps_shard", "cpu_big", "cpu_big", "cpu_small", "cpu_small", None),
        # then the StageWorkers: the PS shard (cpu_small) was started
        ("stage_worker", "cpu_small", "cpu_big", "cpu_small", "cpu_big", "cpu_small"),
        # the DataWorkers last: the PS shard and the StageWorker (both cpu_small) were started
        ("data_worker", "cpu_big", "cpu_small", "cpu_small", "cpu_big", "cpu_small"),
    ],
)
def test_an_actor_ray_refuses_stops_train_with_exit_2_and_ends_the_ones_started(
    ray_local, data, tmp_path, capsys, kind, first, rest, ps_type, bad, started_before
):
    types = [
        _local_type("cpu_small"),
        _local_type("cpu_big"),
    ]
    for t in types:
        if t["name"] == bad:
            t["ray_resources"] = {**t["ray_resources"], "TPU": 3}
    job = _job(tmp_path, data, types, ps_type)
    plan = _plan(tmp_path, first, rest, ps_type)
    before = ray_local.available_resources().get("cpu_small", 0.0)
    err = _exit_2(["train", str(job), "--plan", str(plan), "--steps", "2", "--no-progress"], capsys)
    assert f"field 'cluster.resource_types.{bad}.ray_resources': expected amounts Ray accepts" in err, err
    assert RAY_REFUSES in err and "'TPU': 3.0" in err, err
    if started_before is not None:
        assert _units_back(ray_local, started_before, before), ray_local.available_resources()
    assert not (tmp_path / "out" / "run_summary.json").exists()


@needs_no_cuda
def test_a_data_worker_whose_constructor_raises_stops_train_with_exit_2(
    ray_local, data, tmp_path, capsys, monkeypatch
):
    """Stage 0 on a cuda type with no CUDA behind it: the DataWorker's constructor raises DeviceError
    while the PS shard and the StageWorker (cpu_small) are up; the run exits 2 with the DeviceError."""
    monkeypatch.delenv(CUDA_AS_CPU_VAR, raising=False)
    job = _job(tmp_path, data, [_local_type("cpu_small"), _gpu_type()], "cpu_small")
    plan = _plan(tmp_path, GPU_TYPE, "cpu_small", "cpu_small")
    before = ray_local.available_resources().get("cpu_small", 0.0)
    err = _exit_2(["train", str(job), "--plan", str(plan), "--steps", "2", "--no-progress"], capsys)
    node = ray_local.get_runtime_context().get_node_id()[:12]
    assert f"resource type '{GPU_TYPE}' (device: cuda) found no GPU on node {node}" in err, err
    assert _units_back(ray_local, "cpu_small", before), ray_local.available_resources()


@needs_no_cuda
def test_train_of_a_cuda_stage_on_a_ray_without_gpus_exits_2_with_the_gpu_count(data, tmp_path):
    """The reported case, as a user runs it: `heterps train` starts its own Ray on this GPU-less
    machine (no HETERPS_CUDA_AS_CPU), the plan's second stage is on a cuda type."""
    job = _job(tmp_path, data, [_local_type("cpu_small"), _gpu_type()], "cpu_small")
    plan = _plan(tmp_path, "cpu_small", GPU_TYPE, "cpu_small")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(CUDA_AS_CPU_VAR, None)
    env.pop("RAY_ADDRESS", None)  # its own embedded Ray, with the machine's GPUs: none
    argv = [sys.executable, "-m", "heterps_ray", "train", str(job), "--plan", str(plan), "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "zip()" not in done.stderr, done.stderr[-3000:]
    assert (
        f"{plan}: field 'stages': expected a plan whose GPUs the Ray cluster has (the plan's actors ask "
        f"for 1 GPUs ({GPU_TYPE}: 1) and the Ray cluster has 0)"
    ) in done.stderr, done.stderr[-3000:]
