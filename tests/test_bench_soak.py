"""The soak benchmark's measure of each fault (benchmarks/bench_soak.py), on progress records written as
its child writes them: one per chunk boundary, and an "armed" one where an actor was armed to die."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_soak import measure_faults  # noqa: E402

STEP_S = 0.01  # undisturbed seconds a batch: a chunk of 100 batches takes 1 s


def _chunk(t: float, step: int, pid: int = 1) -> dict:
    return {"t": t, "step": step, "pid": pid}


def test_each_fault_is_measured_from_where_the_run_stood_rollback_or_not():
    progress = [
        *(_chunk(float(i), 100 * i) for i in range(4)),  # 0..300
        {"t": 3.0, "step": 300, "armed": "data_worker"},
        _chunk(7.0, 200),  # dead in the next chunk: rolled back to a checkpoint at 200
        _chunk(8.0, 300),
        _chunk(9.0, 400),  # past 300 again: 6 s, of which 1 s is the batches 300..400
        *(_chunk(float(t), 100 * (t - 5)) for t in range(10, 13)),  # 500..700
        {"t": 12.0, "step": 700, "armed": "stage_worker"},
        _chunk(15.5, 800),  # a checkpoint at 700: rolled back by nothing, the recovery in one chunk
        _chunk(16.5, 900),
        _chunk(30.0, 800, pid=2),  # the driver, killed after 900, resumed from a checkpoint at 800
        _chunk(31.0, 900, pid=2),
        _chunk(32.0, 1000, pid=2),
    ]
    faults = [
        {"kind": "data_worker", "t": 2.5, "step": 300},
        {"kind": "stage_worker", "t": 11.5, "step": 700},
        {"kind": "driver", "t": 17.0, "step": 900},
        {"kind": "ps_shard", "t": 32.5, "step": 1000},  # the run ended before it was armed
    ]
    measure_faults(faults, progress, STEP_S)
    lost = [f["lost_s"] for f in faults]
    assert lost == [5.0, 2.5, 14.5, None]
    assert [f["from_step"] for f in faults] == [300, 700, 900, None]
    assert [f["went_back_to"] for f in faults] == [200, 700, 800, None]
