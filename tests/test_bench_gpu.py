"""benchmarks/bench_gpu.py tiny on the CPU (the cuda type on the CPU under the explicit test flag): the plain
loop with its table on the "GPU" and on the CPU, and heterps' plan through its GPU tier, side by side;
the JSON carries each system's rate, the ratios, the model's error and where the table lived."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_bench_runs_tiny_with_heterps_table_in_the_gpu_tier(tmp_path):
    out = tmp_path / "bench_gpu.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), "--tiny", "--rounds", "2",
           "--batch-sizes", "64", "--workdir", str(tmp_path), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "HETERPS_CUDA_AS_CPU": "1", "RAY_ADDRESS": ""}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    runs = results["runs"]
    # alternating: round 0 in order, round 1 reversed
    assert [r["system"] for r in runs] == [
        "plain_gpu",
        "heterps",
        "plain_cpu",
        "plain_cpu",
        "heterps",
        "plain_gpu",
    ]
    heterps = [r for r in runs if r["system"] == "heterps"]
    assert (
        heterps[0]["profiled"] and not heterps[1]["profiled"]
    )  # the second run plans on the first's profile
    for run in heterps:
        assert run["plan"].startswith("embedding..logit@h200x1"), run["plan"]  # one stage, on the GPU type
        table = run["table"]
        assert table["tier"] == "gpu" and "GPU memory" in table["place"], table
        # every row held: fetched once (its first lookups the misses), none evicted
        assert table["misses"] >= table["fetched"] > 0 and table["evicted"] == 0, table
        assert 0.5 < table["hit_rate"] < 1.0, table
        assert run["samples"] > 0 and run["predicted"] > 0
        # where the DataWorker's batches went: its training thread's time by phase, within its training
        (phases,) = run["data_phases_s"]
        assert {"read", "pull", "compute", "push", "step"} <= set(phases), phases
        assert 0 < sum(phases.values()) <= run["train_seconds"] * 1.05 + 0.05, (phases, run["train_seconds"])
        # every thread's CPU a batch, and a few batches' ops split into device work and host work
        (threads,) = run["threads_cpu_ms_per_batch"]
        assert threads["training"] > 0, threads
        (ops,) = run["ops_per_batch"]
        assert ops["aten_ops"] > 20 and ops["data_dependent_ops"] >= 1, ops  # the one wait: the keys it lacks
        assert ops["aten_ms"] > 0 and ops["host_ms"] > 0 and ops["wall_ms"] > ops["aten_ms"], ops
    row = results["summary"]["64"]
    assert set(row["median"]) == {"plain_gpu", "plain_cpu", "heterps"}
    assert row["heterps_over_plain_gpu"] > 0 and row["heterps_over_plain_cpu"] > 0
    assert "heterps_over_plain_gpu" in done.stdout
    where = row["where"]
    assert set(where["step_ms"]) == {"plain_gpu", "plain_cpu", "heterps"}
    assert 0 < where["host_ms"] and 0 < where["host_over_plain_step"], where
    assert "host work a GPU would not take over" in done.stdout
