"""GPU types fail loudly on this GPU-less machine (issue 28): a cuda type must ask for GPUs, an actor of
one that finds no GPU stops `heterps profile`, `train` and `run` with exit 2 naming the type and the
node, and a cluster that declares more GPU instances than it has GPUs neither hangs nor crashes.

The session Ray (conftest.py) declares 2 GPUs and 2 units of `gpu_t4` that no CUDA device backs."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import TINY_MODEL

from heterps_ray.cli import main
from heterps_ray.config import load_cluster
from heterps_ray.devices import CUDA_AS_CPU_VAR, DeviceError, claim_device, gpu_shortfall
from heterps_ray.profiling.profiler import actor_counts

REPO = Path(__file__).resolve().parents[1]
GPU_TYPE = "gpu_t4"  # declared by the session Ray (conftest.py) with 2 GPUs and no CUDA behind them

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: cuda types work here")


def _gpu_type(**overrides: Any) -> dict[str, Any]:
    return {
        "name": GPU_TYPE,
        "device": "cuda",
        "price_per_hour": 0.526,
        "max_instances": 1,
        "ray_resources": {"CPU": 0.25},
        "num_gpus": 1,
        **overrides,
    }


def _job(tmp_path: Path, types: list[dict[str, Any]], data: Path | None = None, **extra: Any) -> Path:
    job = {
        "name": "gpu-job",
        "model": {**TINY_MODEL, "hidden": [8]},
        "cluster": {"name": "with-gpu", "resource_types": types},
        "data": {"path": str(data or tmp_path / "no-data-yet")},
        "batch_size": 64,
        "samples": 10_000,
        "throughput_min": 0,
        "scheduler": "exact",
        "output_dir": str(tmp_path / "out"),
        **extra,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


# -- at config load ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_gpus", [0, None], ids=["zero", "unset"])
def test_cuda_type_without_num_gpus_is_refused_at_load(tmp_path, capsys, num_gpus):
    gpu = _gpu_type(num_gpus=num_gpus) if num_gpus is not None else _gpu_type()
    if num_gpus is None:
        del gpu["num_gpus"]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"name": "c", "resource_types": [gpu]}))
    err = _exit_2(["check", str(_job_with(tmp_path, cluster))], capsys)
    assert "cluster.yaml" in err and "resource_types.0.num_gpus" in err and "cuda" in err, err


def _job_with(tmp_path: Path, cluster: Path) -> Path:
    path = _job(tmp_path, [])
    job = yaml.safe_load(path.read_text())
    job["cluster"] = str(cluster)
    path.write_text(yaml.safe_dump(job))
    return path


def test_bad_gpu_precision_is_refused_at_load(tmp_path, capsys):
    job = _job(tmp_path, [_gpu_type()], runtime={"gpu_precision": "fp16"})
    err = _exit_2(["check", str(job)], capsys)
    assert "runtime.gpu_precision" in err and "'fp32', 'tf32' or 'bf16'" in err, err


# -- the device an actor claims ------------------------------------------------------------------


@needs_no_cuda
def test_claim_device_never_falls_back_to_the_cpu(monkeypatch):
    monkeypatch.delenv(CUDA_AS_CPU_VAR, raising=False)
    assert claim_device("cpu_small", "cpu").type == "cpu"
    with pytest.raises(DeviceError) as info:
        claim_device(GPU_TYPE, "cuda", node="n1 (10.0.0.1)")
    text = str(info.value)
    assert f"'{GPU_TYPE}'" in text and "n1 (10.0.0.1)" in text, text
    assert "torch.cuda.is_available()=False" in text and "CUDA_VISIBLE_DEVICES" in text, text
    assert info.value.exit_code == 2
    again = pickle.loads(pickle.dumps(info.value))  # raised in an actor, pickled to the driver
    assert str(again) == text and again.type_name == GPU_TYPE
    monkeypatch.setenv(CUDA_AS_CPU_VAR, "1")  # the one explicit mapping, for tests
    assert claim_device(GPU_TYPE, "cuda").type == "cpu"


def test_gpu_demand_is_counted_against_the_cluster_gpus(tmp_path):
    path = tmp_path / "cluster.yaml"
    gpu = _gpu_type(max_instances=8)
    path.write_text(yaml.safe_dump({"name": "c", "resource_types": [gpu]}))
    cluster = load_cluster(path)
    assert gpu_shortfall({GPU_TYPE: 2}, cluster, have=2.0) is None
    short = gpu_shortfall({GPU_TYPE: 3}, cluster, have=2.0)
    assert short is not None and "3 GPUs" in short and "has 2" in short, short
    gpu_node = {"Alive": True, "Resources": {GPU_TYPE: 8.0, "GPU": 1.0, "CPU": 4.0}}
    rtype = cluster.type(GPU_TYPE)
    assert actor_counts([rtype], [gpu_node]) == {GPU_TYPE: 1}  # one GPU: one profiling actor, no wait
    assert actor_counts([rtype], [{**gpu_node, "Resources": {**gpu_node["Resources"], "GPU": 2.0}}]) == {
        GPU_TYPE: 2
    }


# -- on the session Ray: exit 2 naming the type and the node --------------------------------------


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("devices") / "data"
    synthesize(path, 600, seed=1)
    return path


def _names_type_and_node(err: str, ray: Any) -> None:
    node = ray.get_runtime_context().get_node_id()[:12]
    assert f"resource type '{GPU_TYPE}' (device: cuda) found no GPU on node {node}" in err, err
    assert "torch.cuda.is_available()=False" in err, err


@needs_no_cuda
def test_profile_with_a_cuda_type_and_no_gpu_exits_2_naming_type_and_node(
    ray_local, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(CUDA_AS_CPU_VAR, raising=False)
    job = _job(tmp_path, [_gpu_type()])
    err = _exit_2(["profile", str(job), "-o", str(tmp_path / "p.yaml"), "--quick", "--no-progress"], capsys)
    _names_type_and_node(err, ray_local)
    assert not (tmp_path / "p.yaml").exists()


@needs_no_cuda
def test_train_with_a_cuda_stage_and_no_gpu_exits_2_naming_type_and_node(
    ray_local, tiny_data, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(CUDA_AS_CPU_VAR, raising=False)
    cpu = load_cluster(REPO / "configs" / "clusters" / "local.yaml").resource_types[0].model_dump()
    job = _job(tmp_path, [cpu, _gpu_type()], tiny_data)
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "assignment": ["cpu_small", GPU_TYPE, GPU_TYPE],
                "stages": [
                    {"layers": ["embedding"], "type": "cpu_small", "replicas": 1},
                    {"layers": ["fc1", "logit"], "type": GPU_TYPE, "replicas": 1},
                ],
                "ps_shards": 1,
                "ps_type": "cpu_small",
                "throughput": None,
                "cost": None,
                "cost_rate": 0.6,
                "feasible": True,
                "scheduler": "manual",
                "seconds": 0.0,
            }
        )
    )
    err = _exit_2(["train", str(job), "--plan", str(plan), "--steps", "2", "--no-progress"], capsys)
    _names_type_and_node(err, ray_local)


@needs_no_cuda
def test_run_with_a_cuda_type_and_no_gpu_exits_2_naming_type_and_node(
    ray_local, tiny_data, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(CUDA_AS_CPU_VAR, raising=False)
    job = _job(tmp_path, [_gpu_type()], tiny_data)
    err = _exit_2(["run", str(job), "--quick-profile", "--steps", "2", "--no-progress"], capsys)
    _names_type_and_node(err, ray_local)


def test_gpu_type_asking_more_gpus_than_the_cluster_has_is_refused_before_any_wait(
    ray_local, tmp_path, capsys
):
    job = _job(tmp_path, [_gpu_type(num_gpus=4)])  # the session Ray has 2
    err = _exit_2(["profile", str(job), "-o", str(tmp_path / "p.yaml"), "--quick", "--no-progress"], capsys)
    assert f"cluster.resource_types.{GPU_TYPE}.num_gpus" in err and "2 GPUs in all" in err, err


def test_profile_with_more_gpu_instances_than_gpus_neither_hangs_nor_crashes(
    ray_local, tmp_path, capsys, monkeypatch
):
    """8 instances of 2 GPUs each declared, 2 GPUs there: one profiling actor (the cuda type mapped to
    the CPU by the explicit test flag), and the problem says what the actor really computed on."""
    monkeypatch.setenv(CUDA_AS_CPU_VAR, "1")
    job = _job(tmp_path, [_gpu_type(max_instances=8, num_gpus=2)])
    out = tmp_path / "p.yaml"
    argv = ["profile", str(job), "-o", str(out), "--quick", "--batch-sizes", "16,32", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    problem = yaml.safe_load(out.read_text())
    assert [r["device"] for r in problem["resources"]] == ["cpu"]  # measured, not the configured cuda
    assert f"one actor of ['{GPU_TYPE}']" in problem["notes"]


def test_a_batch_size_that_runs_out_of_gpu_memory_is_skipped_not_fatal():
    """The profiling actor's own logic, in-process: the item that ran out of memory comes back None (the
    profiler records it as an "oom" row and a note), the others are timed."""
    from heterps_ray.profiling_host import LayerProfiler

    class SmallGpu(LayerProfiler):  # a GPU whose memory holds batches of 32 at most
        def _step(self, index: int, batch_size: int) -> tuple[float, float, float, float | None]:
            if batch_size > 32:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super()._step(index, batch_size)

    profiler = SmallGpu({**TINY_MODEL, "hidden": [8]}, 0, 1, "cpu", "cpu_small")
    timed = profiler.time_layers([(1, 16), (1, 64), (2, 32)], 1, 0)
    assert timed[1] is None
    for result in (timed[0], timed[2]):
        assert result is not None
        forward, backward, copies, peak = result
        assert forward > 0 and backward > 0 and 0 <= copies < forward + backward and peak is None
