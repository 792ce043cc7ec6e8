"""`heterps run --resume` (closedloop/state.py): a `heterps run` killed after a checkpoint continues with
what it had decided and ends with the model an uninterrupted run gives; a run killed before any
checkpoint restarts from step 0 with the same plan; a changed job, or an output_dir without a run, is
refused (exit 2); `--resume auto` starts a run where there is none. Nothing is deleted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import TINY_MODEL

from heterps_ray.cli import main
from heterps_ray.closedloop import REPORT_FILE, run_job
from heterps_ray.closedloop.state import STATE_FILE
from heterps_ray.config import load_job
from heterps_ray.runtime.checkpoint import CHECKPOINTS_DIR, load_checkpoint

REPO = Path(__file__).resolve().parents[1]
EVERY = 40  # batches between checkpoints
EPOCHS = 3  # 3 x 281 batches of 64 over 18,000 train rows: long enough to be killed mid-run


def _problem(folder: Path) -> Path:
    """A hand-priced problem of the tiny ctr_dnn on the local types: one stage on cpu_small is cheapest."""
    layer = lambda name, rows=0: {  # noqa: E731
        "name": name,
        "out_bytes_per_sample": 64,
        "sparse_rows_per_sample": rows,
        "parallel_fraction": 0.5,
        "time_ms": {
            "cpu_small": {"fixed": 0.5, "per_sample": 0.01},
            "cpu_big": {"fixed": 0.5, "per_sample": 0.008},
        },
    }
    problem = {
        "name": "tiny ctr_dnn on local-two-cpu (hand-priced)",
        "batch_size": 64,
        "samples": 100_000,
        "throughput_min": 0,
        "input_bytes_per_sample": 160,
        "resources": [
            {
                "name": "cpu_small",
                "device": "cpu",
                "price_per_hour": 0.2,
                "max_instances": 1,
                "bandwidth_gbps": 10,
            },
            {
                "name": "cpu_big",
                "device": "cpu",
                "price_per_hour": 0.5,
                "max_instances": 1,
                "bandwidth_gbps": 10,
            },
        ],
        "ps": {"resource": "cpu_small", "rows_per_second_per_shard": 2.0e6, "min_shards": 1},
        "layers": [layer("embedding", 26), layer("fc1"), layer("fc2"), layer("logit")],
    }
    path = folder / "problem.yaml"
    path.write_text(yaml.safe_dump(problem))
    return path


def _job_file(folder: Path, data: Path, out: Path, **changes) -> Path:
    job = {
        "name": "resume",
        "model": TINY_MODEL,
        "cluster": str(REPO / "configs" / "clusters" / "local.yaml"),
        "data": {"path": str(data), "synth_rows": 20_000},
        "batch_size": 64,
        "samples": 100_000,
        "throughput_min": 0,
        "mode": "sync",
        "scheduler": "exact",
        "seed": 11,
        "output_dir": str(out),
        "runtime": {"epochs": EPOCHS, "checkpoint_every": EVERY, "micro_batches": 2, "max_in_flight": 2},
    }
    job.update(changes)
    path = folder / f"job-{out.name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="module")
def setting(ray_local, tmp_path_factory):
    """The problem, the dataset and an uninterrupted run of the job: (folder, problem, data, report)."""
    folder = tmp_path_factory.mktemp("resume")
    problem, data = _problem(folder), folder / "data"
    job = load_job(_job_file(folder, data, folder / "calm"))
    report = run_job(job, progress=False, problem_file=problem)
    return folder, problem, data, report


def _model(out: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    ckpt = load_checkpoint(out / "model")
    return {k: v.detach().numpy() for k, v in ckpt.net.state_dict().items()}, ckpt.table.state()


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_model(setting, tmp_path):
    folder, problem, data, calm = setting
    out = tmp_path / "killed"
    job_file = _job_file(tmp_path, data, out)
    # `heterps run` in a process of its own (its own embedded Ray), SIGKILLed with all its processes
    # once its first checkpoint is complete: a preempted head node
    proc = subprocess.Popen(
        [sys.executable, "-m", "heterps_ray", "run", str(job_file), "--problem", str(problem), "--no-progress"],
        cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list((out / CHECKPOINTS_DIR).glob("step-*/manifest.json")):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (out / REPORT_FILE).exists()  # killed mid-run
    state = json.loads((out / STATE_FILE).read_text())
    assert not state["finished"]

    report = run_job(load_job(job_file), resume="yes", progress=False)

    summary = json.loads((out / "run_summary.json").read_text())
    assert (
        summary["extra"]["resumed_from"]["step"] % EVERY == 0 and summary["extra"]["resumed_from"]["step"] > 0
    )
    assert (report.auc, report.logloss) == (calm.auc, calm.logloss)
    calm_summary = json.loads((folder / "calm" / "run_summary.json").read_text())
    np.testing.assert_array_equal(summary["losses"], calm_summary["losses"])
    (dense_a, sparse_a), (dense_b, sparse_b) = _model(folder / "calm"), _model(out)
    for name in dense_a:
        np.testing.assert_array_equal(dense_b[name], dense_a[name], err_msg=name)
    np.testing.assert_array_equal(sparse_b["keys"], sparse_a["keys"])
    np.testing.assert_array_equal(sparse_b["weights"], sparse_a["weights"])
    assert json.loads((out / STATE_FILE).read_text())["finished"]
    # a second --resume finds the run finished: nothing to do, the report is the same
    again = run_job(load_job(job_file), resume="auto", progress=False)
    assert again.auc == report.auc


def test_a_run_killed_before_any_checkpoint_resumes_from_step_zero_with_its_plan(setting, tmp_path):
    folder, problem, data, calm = setting
    out = tmp_path / "early"
    job_file = _job_file(tmp_path, data, out)
    # what a driver killed after planning, before its first checkpoint, leaves: the problem, the plan and
    # the run state (those the uninterrupted run of this same job wrote, moved to `out`), and a
    # checkpoint directory half written
    out.mkdir()
    for name in ("problem.yaml", "plan.json", STATE_FILE):
        text = (folder / "calm" / name).read_text().replace(str(folder / "calm"), str(out))
        (out / name).write_text(text)
    state = json.loads((out / STATE_FILE).read_text())
    state["finished"] = False
    (out / STATE_FILE).write_text(json.dumps(state))
    (out / CHECKPOINTS_DIR / ".step-00000040.abc.tmp").mkdir(parents=True)

    report = run_job(load_job(job_file), resume="yes", progress=False)

    assert report.plan == calm.plan
    assert "resumed_from" not in json.loads((out / "run_summary.json").read_text())["extra"]
    assert (report.auc, report.logloss) == (calm.auc, calm.logloss)
    assert not list((out / CHECKPOINTS_DIR).glob(".step-*.tmp"))  # the leftover was cleaned


def test_resume_refuses_a_changed_job_and_an_output_dir_without_a_run(setting, tmp_path, capsys):
    folder, problem, data, calm = setting
    out = folder / "calm"
    changed = _job_file(tmp_path, data, out, batch_size=128, seed=12)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["run", str(changed), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "batch_size, seed" in err and "changed since" in err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing deleted

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["run", str(_job_file(tmp_path, data, empty)), "--resume", "--no-progress"]) == 2
    assert "nothing of a run" in capsys.readouterr().err


def test_resume_auto_starts_a_run_where_there_is_none(setting, tmp_path):
    folder, problem, data, calm = setting
    out = tmp_path / "auto"
    report = run_job(
        load_job(_job_file(tmp_path, data, out)), resume="auto", progress=False, problem_file=problem
    )
    assert (report.auc, report.logloss) == (calm.auc, calm.logloss)
    assert json.loads((out / STATE_FILE).read_text())["finished"]
