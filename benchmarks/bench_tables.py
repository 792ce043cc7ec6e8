"""Benchmark: the memory and speed of a SparseTable (BENCHMARKS.md "Tables").

Each case is a fresh Python process (so its resident memory is the table's): it fills a table of
`rows` new keys through pull calls of 512x26 random 64-bit keys (a batch of Criteo-shaped data whose
keys are all new), in-process, with no capacity hint, then times pulls plus pushes of 512x26 new
keys on the full table. It reports

* steady bytes per row: (resident memory after filling - before) / rows, against the payload (key,
  weights, optimizer state) and the issue's bound, payload + 24 B/row;
* peak bytes per row: the high-water mark of resident memory while filling (reset before it), and
  its ratio to steady (bound 1.3);
* creation rate: rows / the seconds spent in the filling pulls (bound 2M rows/s; with
  ``--admit-after n`` each batch is pulled n times, so its keys are admitted);
* pull + push of 512x26 new keys on the full table: median ms over `--calls` calls (bound 2 ms),
  both with duplicates left to the table (``unique=False``, as the reference trainer calls it) and
  with keys already de-duplicated (``unique=True``, as a PS client calls a shard).

Speed figures need a quiet machine (``../shared/bench/quiet.sh`` first); memory figures do not.

    .venv/bin/python benchmarks/bench_tables.py                          # 1M, 10M, 30M rows x dim 9, 16
    .venv/bin/python benchmarks/bench_tables.py --rows 1e6 10e6 --dims 16 --result /tmp/tables.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BATCH_KEYS = 512 * 26  # one batch of Criteo-shaped data: 512 samples x 26 slots
OVERHEAD_BOUND = 24  # B/row over the payload (the bound)
PEAK_BOUND = 1.3  # peak / steady while growing
RATE_BOUND = 2e6  # rows created per second
LATENCY_BOUND_MS = 2.0  # one pull + push of a batch of new keys


def _memory_kb() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: writing 5 to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def run_case(rows: int, dim: int, optimizer: str, calls: int, table_args: dict[str, Any]) -> dict[str, Any]:
    """One case, in this process (meant to be a fresh one)."""
    import numpy as np

    from heterps_ray.ps.row_bytes import row_bytes
    from heterps_ray.ps.table import SparseTable

    rng = np.random.default_rng(0)
    batches = -(-rows // BATCH_KEYS)
    table = SparseTable(dim, seed=0, optimizer=optimizer, **table_args)
    rng.integers(-(2**63), 2**63 - 1, BATCH_KEYS, dtype=np.int64)  # warm the generator
    before_kb, _ = _memory_kb()
    _reset_peak()
    fill_s = fill_cpu_s = 0.0
    for b in range(batches):
        n = min(BATCH_KEYS, rows - b * BATCH_KEYS)
        keys = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(table.admit_after):  # with admission, a key gets its row at its n-th call
            table.pull(keys)
        fill_s += time.perf_counter() - t0
        fill_cpu_s += time.process_time() - c0
    after_kb, peak_kb = _memory_kb()
    held = len(table)
    grads = rng.standard_normal((BATCH_KEYS, dim)).astype(np.float32)
    latency: dict[str, float] = {}
    latency_cpu: dict[str, float] = {}
    for unique in (False, True):
        times, cpu = [], []
        for _ in range(calls):
            keys = rng.integers(-(2**63), 2**63 - 1, BATCH_KEYS, dtype=np.int64)
            if unique:
                keys = np.unique(keys)  # as a PS client sends them (its cost is the client's)
            t0, c0 = time.perf_counter(), time.process_time()
            table.pull(keys, unique=unique)
            table.push(keys, grads[: len(keys)], unique=unique)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        latency["unique" if unique else "raw"] = 1e3 * statistics.median(times)
        latency_cpu["unique" if unique else "raw"] = 1e3 * statistics.median(cpu)
    payload = row_bytes(dim, optimizer)
    steady = (after_kb - before_kb) * 1024 / held
    peak = (peak_kb - before_kb) * 1024 / held
    return {
        "rows": held,
        "dim": dim,
        "optimizer": optimizer,
        "table": table_args,
        "payload_b_per_row": payload,
        "steady_b_per_row": round(steady, 1),
        "peak_b_per_row": round(peak, 1),
        "peak_over_steady": round(peak / steady, 3),
        "table_nbytes_b_per_row": round(table.nbytes / held, 1),
        "create_rows_per_s": round(rows / fill_s),
        "pull_push_ms": {k: round(v, 3) for k, v in latency.items()},
        # CPU time of this process: what the wall figures read on a quiet machine (a shared one
        # inflates the wall figures by the time others hold the cores)
        "create_rows_per_cpu_s": round(rows / fill_cpu_s),
        "pull_push_cpu_ms": {k: round(v, 3) for k, v in latency_cpu.items()},
        "within": {
            "steady": steady <= payload + OVERHEAD_BOUND,
            "peak": peak <= PEAK_BOUND * steady,
            "rate": rows / fill_s >= RATE_BOUND,
            "latency": latency["raw"] <= LATENCY_BOUND_MS,
        },
    }


def _fresh(rows: int, dim: int, optimizer: str, calls: int, table_args: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", json.dumps([rows, dim, optimizer, calls, table_args])]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"case {rows} rows, dim {dim} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print(results: list[dict[str, Any]]) -> None:
    print(
        f"{'rows':>11} {'dim':>3} {'optimizer':>15} {'payload B':>9} {'steady B':>8} {'peak B':>7} "
        f"{'peak/st':>7} {'create/s':>10} {'pull+push ms':>12} {'(unique)':>8} {'cpu: create/s':>13} "
        f"{'pull+push ms':>12}"
    )
    for r in results:
        ms = r["pull_push_ms"]
        print(
            f"{r['rows']:>11,} {r['dim']:>3} {r['optimizer']:>15} {r['payload_b_per_row']:>9} "
            f"{r['steady_b_per_row']:>8.1f} {r['peak_b_per_row']:>7.1f} {r['peak_over_steady']:>7.2f} "
            f"{r['create_rows_per_s'] / 1e6:>9.2f}M {ms['raw']:>12.2f} {ms['unique']:>8.2f} "
            f"{r['create_rows_per_cpu_s'] / 1e6:>12.2f}M {r['pull_push_cpu_ms']['raw']:>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", type=float, default=[1e6, 10e6, 30e6])
    parser.add_argument("--dims", nargs="*", type=int, default=[9, 16])
    parser.add_argument("--optimizers", nargs="*", default=["adagrad"], help="adagrad, rowwise_adagrad")
    parser.add_argument("--calls", type=int, default=50, help="timed pull+push calls on the full table")
    parser.add_argument("--admit-after", type=int, default=1)
    parser.add_argument("--ttl", type=int, default=0)
    parser.add_argument("--max-rows", type=int, default=0)
    parser.add_argument("--result", type=Path, default=REPO / "benchmarks" / "bench_tables" / "tables.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = parser.parse_args()
    if args.one:
        rows, dim, optimizer, calls, table_args = json.loads(args.one)
        print(json.dumps(run_case(rows, dim, optimizer, calls, table_args)))
        return
    table_args = {"admit_after": args.admit_after, "ttl": args.ttl, "max_rows": args.max_rows}
    table_args = {k: v for k, v in table_args.items() if v not in (0, 1)}
    results = []
    for rows in args.rows:
        for dim in args.dims:
            for optimizer in args.optimizers:
                results.append(_fresh(int(rows), dim, optimizer, args.calls, table_args))
                _print(results[-1:])
    print()
    _print(results)
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written {args.result}")


if __name__ == "__main__":
    main()
