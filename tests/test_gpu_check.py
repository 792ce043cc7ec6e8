"""scripts/gpu_check.py, the check a GPU machine runs as it is (issue 28), run here by its CPU half:
the `cuda` type mapped to the CPU by the explicit test flag only. The GPU half itself needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _run(tmp_path: Path, *flags: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HETERPS_CUDA_AS_CPU", None)
    env.pop("RAY_ADDRESS", None)  # its own embedded Ray, as on a fresh GPU machine
    out = tmp_path / "gpu_check.json"
    argv = [sys.executable, str(SCRIPT), *flags, "--workdir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    return done, (json.loads(out.read_text()) if out.exists() else {})


def _passed(report: dict) -> set[str]:
    return {c["check"] for c in report["checks"] if c["passed"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the check runs on it")
def test_without_cuda_the_check_refuses_to_run_on_the_cpu(tmp_path):
    done, report = _run(tmp_path, "--no-ray")
    assert done.returncode == 2, done.stderr
    assert "CUDA is not visible" in done.stderr and "torch.cuda.is_available()=False" in done.stderr
    assert report == {}


def test_no_ray_half_runs_stage_compute_reference_and_timing_without_ray(tmp_path):
    """--no-ray makes `import ray` fail in the script's process: this half needs no Ray at all."""
    done, report = _run(tmp_path, "--cpu-half", "--no-ray", "--steps", "12", "--batch-size", "64")
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["passed"] and not report["ray"] and "ray_checks" not in report
    assert {
        "in-process profiler timing",
        "in-process dense net on cpu: losses equal the CPU reference's",
    } <= _passed(report)
    layers = report["in_process"]["layers"]
    assert {r["layer"] for r in layers} == {"embedding", "fc1", "fc2", "logit", "(whole model)"}
    assert all(r["copy_ms"] >= 0 and r["peak_mb"] is None for r in layers)  # the CPU: no GPU memory


@pytest.mark.slow
def test_cpu_half_passes_every_check(tmp_path):
    """The whole check, Ray included, with the cuda type on the CPU: what CI can run of it."""
    done, report = _run(tmp_path, "--cpu-half", "--steps", "12", "--batch-size", "64")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert report["passed"] and report["mode"].startswith("cpu-half")
    names = _passed(report)
    for expected in (
        "3-stage sync plan, dense stages on the cuda type: losses equal the CPU reference's",
        "3-stage sync plan, dense stages on the cuda type: AUC equals the CPU reference's",
        "run summary records each stage's real device",
        "checkpointed and resumed run equals the uninterrupted one",
        "export of the resumed run",
        "async plan with a replicated GPU stage",
        "one-stage plan on the cuda type, table in its memory: losses equal the CPU reference's",
        "the table lived in the GPU's memory",
        "its rows equal those of the same plan with the rows on the CPU",
        "a table over the GPU budget trains through the cache to the same model",
        "checkpointed and resumed with the table in GPU memory equals the uninterrupted run",
        "profile of the GPU type",
        "per-call split of a GPU stage call",
    ):
        assert expected in names, (expected, report["checks"])
    split = report["ray_checks"]["call_split"]
    assert split["call_ms"] >= split["ray_ms"] >= 0 and split["peak_mb"] is None
    assert report["ray_checks"]["profile"]["device"] == "cpu"  # measured: the flag's CPU, not "cuda"
