"""Traced runs (runtime/trace.py) and scripts/diff_traces.py: two runs of one sync job trace the same
tensors in every process, and a run that differs is caught at its first differing tensor."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_sync_job

from heterps_ray.costmodel.plan import load_plan
from heterps_ray.devices import TRACE_DIR_VAR
from heterps_ray.runtime.driver import train
from heterps_ray.runtime.trace import digest

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "configs" / "plans" / "small_three_stage.json"  # 3 stages, 2 PS shard actors
STEPS = 4
_spec = importlib.util.spec_from_file_location("diff_traces", REPO / "scripts" / "diff_traces.py")
diff_traces = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(diff_traces)


def _traced(monkeypatch, folder: Path, dataset: Path, output: Path, seed: int = 7):
    folder.mkdir()
    monkeypatch.setenv(TRACE_DIR_VAR, str(folder))
    job = tiny_sync_job("traced", dataset, output)
    job = job.model_copy(
        update={"seed": seed, "runtime": job.runtime.model_copy(update={"ps_hosting": "actors"})}
    )
    return train(job, load_plan(PLAN), steps=STEPS, progress=False)


def test_two_runs_of_a_sync_job_trace_the_same_tensors_and_another_seed_differs_at_its_first_pull(
    ray_local, tiny_dataset, tmp_path, monkeypatch, capsys
):
    first = _traced(monkeypatch, tmp_path / "a", tiny_dataset, tmp_path / "run-a")
    second = _traced(monkeypatch, tmp_path / "b", tiny_dataset, tmp_path / "run-b")
    assert first.losses == second.losses
    roles = {tuple(roles) for roles in diff_traces.load(tmp_path / "a")}
    assert roles == {("data worker 0", "stage 0"), ("stage 1",), ("stage 2",), ("driver",)}
    events = [
        json.loads(line)
        for path in (tmp_path / "a").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    per_kind = {(e["where"], e["event"]) for e in events}
    assert {("data worker 0", "pull"), ("data worker 0", "push"), ("stage 0", "forward"), ("stage 1", "backward"),
            ("stage 1", "step"), ("stage 2", "loss"), ("driver", "losses")} <= per_kind  # fmt: skip
    capsys.readouterr()
    assert diff_traces.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "differs" not in capsys.readouterr().out

    # another seed: the same embedding rows, other dense weights, so stage 1's first forward is where
    # it parts (its input is still equal), and the gradient stage 0 gets back is where stage 0 does
    _traced(monkeypatch, tmp_path / "c", tiny_dataset, tmp_path / "run-c", seed=8)
    capsys.readouterr()
    assert diff_traces.main([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    blocks = {b.split(":")[0]: b for b in re.split(r"\n(?=\S)", capsys.readouterr().out.strip())}
    assert blocks["stage 1"].startswith("stage 1: differs at event 0: stage 1 forward, 4 of 5 tensors differ")
    assert "\n    0.0:" not in blocks["stage 1"]  # the input
    assert re.match(
        r"data worker 0 \+ stage 0: differs at event \d+: stage 0 backward", blocks["data worker 0 + stage 0"]
    )


def test_diff_traces_refuses_a_folder_without_traces(tmp_path):
    with pytest.raises(SystemExit, match="no trace files"):
        diff_traces.main([str(tmp_path), str(tmp_path)])


def test_a_digest_is_of_the_bytes_whatever_holds_them():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert (
        digest(values)[:3]
        == digest(torch.from_numpy(values))[:3]
        == digest(torch.from_numpy(values.T.copy()).T)[:3]
    )
    assert digest(values)[0] != digest(values + np.float32(1e-7))[0]
    bf16 = digest(torch.ones(3, dtype=torch.bfloat16))  # numpy has no bf16: hashed as raw bytes
    assert bf16[1:3] == [[3], "bfloat16"]
