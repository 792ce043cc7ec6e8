"""Benchmark: what the default checkpoint policy costs training (issue "a run is never lost").

Two parts, both on this machine, quiet (run it behind ../shared/bench/quiet.sh):

1. **Quickstart size, side by side.** CTR-DNN (dim 9, FC 512-256-128-32, batch 512) on the quickstart's
   200k synthetic rows, the one-stage plan on cpu_small (configs/plans/quickstart.json), trained for
   `--seconds` per run with checkpoints by time at each interval of `--intervals` (0: none while training,
   the baseline), alternating the settings over `--rounds` rounds. Reported per setting: the median steady
   samples/s, its ratio to the baseline, the checkpoints written and their median seconds.
2. **A table of `--table-rows` rows** (default 10M, dim 9): a PS shard filled through pulls of 512x26 new
   keys, then snapshot (what a checkpoint writes per shard) and restored, timed; the stall it costs at
   the default interval is snapshot seconds / (interval + snapshot seconds).
3. **Incremental checkpoints** (`--incremental-rows`, default 0: skipped; dim `--incremental-dim`, 16): a
   PS shard of that many rows, its full snapshot, then deltas after pushes to 1% and then 10% of its rows
   (each delta holds the rows touched since the one before), each as a checkpoint writes it (npz, SHA-256,
   fsync), timed and sized; then the full snapshot restored alone, and the chain full + 1% + 10% restored.

    ../shared/bench/quiet.sh && .venv/bin/python benchmarks/bench_checkpoints.py --seconds 60 --rounds 2
    .venv/bin/python benchmarks/bench_checkpoints.py --skip-train --table-rows 0 --incremental-rows 10000000 \
        --output benchmarks/bench_checkpoints/incremental_checkpoints.json

Results: benchmarks/bench_checkpoints/checkpoints.json; the tables in BENCHMARKS.md "Reliability" and
"Incremental checkpoints".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _train_run(job_file: Path, interval: float, seconds: float, out: Path) -> dict[str, Any]:
    from heterps_ray.config import load_job
    from heterps_ray.costmodel.plan import load_plan
    from heterps_ray.runtime.driver import train

    job = load_job(
        job_file,
        {
            "output_dir": str(out),
            "runtime.checkpoint_interval_s": interval,
            "runtime.epochs": 100,
        },
    )
    probe = load_plan(REPO / "configs" / "plans" / "quickstart.json")
    # batches for about `seconds` at ~30k samples/s, the one-stage rate here
    steps = int(seconds * 30_000 / job.batch_size)
    summary = train(job, probe, steps=steps, progress=False, overwrite=True)
    written = [s for s in summary.extra["checkpoint_seconds"]]
    return {
        "interval_s": interval,
        "steady": summary.steady_throughput,
        "seconds": summary.seconds,
        # the last is the checkpoint after the last batch, outside the training loop's rate
        "checkpoints_in_loop": len(written) - 1,
        "checkpoint_s": written,
    }


def _table_part(rows: int, dim: int, work: Path) -> dict[str, Any]:
    from heterps_ray.ps.shard import PSShard
    from heterps_ray.ps.spec import TableSpec

    shard = PSShard(0, 1, {"embedding": TableSpec(dim=dim)})
    rng = np.random.default_rng(0)
    batch = 512 * 26
    t0 = time.perf_counter()
    made = 0
    while made < rows:
        keys = rng.integers(1, 1 << 62, size=min(batch, rows - made), dtype=np.int64)
        shard.pull("embedding", keys)
        made += len(keys)
    fill_s = time.perf_counter() - t0
    path = work / "ps-shard-00000.npz"
    t0 = time.perf_counter()
    report = shard.snapshot(str(path))
    snapshot_s = time.perf_counter() - t0
    del shard
    gc.collect()
    fresh = PSShard(0, 1, {"embedding": TableSpec(dim=dim)})
    t0 = time.perf_counter()
    fresh.restore(str(path))
    restore_s = time.perf_counter() - t0
    return {
        "rows": rows,
        "dim": dim,
        "fill_s": fill_s,
        "snapshot_s": snapshot_s,
        "restore_s": restore_s,
        "bytes": report["bytes"],
    }


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _incremental_part(rows: int, dim: int, work: Path, shares: list[float]) -> dict[str, Any]:
    from heterps_ray.ps.shard import PSShard
    from heterps_ray.ps.spec import TableSpec

    spec = {"embedding": TableSpec(dim=dim)}
    shard = PSShard(0, 1, spec)
    rng = np.random.default_rng(0)
    keys = rng.integers(1, 1 << 62, size=rows, dtype=np.int64)
    batch = 512 * 26
    for start in range(0, rows, batch):
        shard.pull("embedding", keys[start : start + batch])
    out: dict[str, Any] = {"rows": shard.stats()["rows"]["embedding"], "dim": dim, "snapshots": []}

    def snapshot(shard: PSShard, name: str, delta: bool) -> str:
        path = work / f"{name}.npz"
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: what writing it adds at its peak
        rss = _status_bytes("VmRSS")
        t0 = time.perf_counter()
        report = shard.snapshot(str(path), delta=delta)
        seconds = time.perf_counter() - t0
        added = _status_bytes("VmHWM") - rss
        shard.snapshot_durable()  # the checkpoint committed: the next delta is relative to it
        out["snapshots"].append(
            {"name": name, "seconds": seconds, "bytes": report["bytes"], "peak_added": added}
        )
        print(
            f"{name}: {report['bytes'] / 1e6:,.1f} MB in {seconds:.3f} s, "
            f"peak +{added / 1e6:,.1f} MB over the process",
            flush=True,
        )
        return str(path)

    chain = [snapshot(shard, "full", False)]
    for share in shares:
        touched = rng.choice(keys, size=int(share * rows), replace=False)
        for start in range(0, len(touched), batch):  # a training step's pull and push
            part = touched[start : start + batch]
            shard.pull("embedding", part)
            shard.push("embedding", part, rng.standard_normal((len(part), dim)).astype(np.float32))
        chain.append(snapshot(shard, f"delta-{share:.0%}", True))
    probe = rng.choice(keys, size=100_000, replace=False)
    expected = shard.pull("embedding", probe, create=False)
    del shard
    gc.collect()
    # alternating, three each: the first restore of a process also pays for its first page faults
    for name, links in [("full", chain[:1]), ("chain", chain)] * 3:
        fresh = PSShard(0, 1, spec)
        t0 = time.perf_counter()
        fresh.restore_chain(links)
        out.setdefault(f"restore_{name}_s", []).append(time.perf_counter() - t0)
        print(f"restore {name} ({len(links)} files): {out[f'restore_{name}_s'][-1]:.2f} s", flush=True)
        # the chain rebuilds the shard: the same rows as before it was dropped
        assert fresh.stats()["rows"]["embedding"] == out["rows"]
        if name == "chain":
            assert np.array_equal(fresh.pull("embedding", probe, create=False), expected)
        del fresh
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="training seconds per run")
    parser.add_argument("--intervals", default="0,300,10", help="checkpoint_interval_s settings (0 first)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--table-rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=9)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--incremental-rows", type=int, default=0)
    parser.add_argument("--incremental-dim", type=int, default=16)
    parser.add_argument(
        "--incremental-shares", default="0.01,0.10", help="rows touched before each delta (a chain)"
    )
    parser.add_argument(
        "--output", type=Path, default=REPO / "benchmarks" / "bench_checkpoints" / "checkpoints.json"
    )
    args = parser.parse_args()

    results: dict[str, Any] = {"load_before": os.getloadavg()[0], "runs": [], "table": None}
    work = Path(tempfile.mkdtemp(prefix="heterps-bench-ckpt-"))
    if not args.skip_train:
        import ray

        from heterps_ray.cluster import connect
        from heterps_ray.config import load_job

        job_file = REPO / "configs" / "jobs" / "quickstart.yaml"
        job = load_job(job_file, {"output_dir": str(work / "probe")})
        connect(job.cluster, None)
        from heterps_ray.data.dataset import prepare_dataset

        prepare_dataset(job.data, seed=job.seed)
        intervals = [float(x) for x in args.intervals.split(",")]
        for rnd in range(args.rounds):
            for interval in intervals:
                run = _train_run(job_file, interval, args.seconds, work / f"run-{interval:g}")
                run["round"] = rnd
                results["runs"].append(run)
                print(
                    f"round {rnd} interval {interval:g}s: {run['steady']:,.0f} samples/s, "
                    f"{run['checkpoints_in_loop']} checkpoints in the loop, {run['checkpoint_s']}",
                    flush=True,
                )
        ray.shutdown()
        base = statistics.median(r["steady"] for r in results["runs"] if r["interval_s"] == 0)
        print(
            "\n| checkpoint_interval_s | steady samples/s (median) | vs none | checkpoints in loop | s each |"
        )
        print("|---:|---:|---:|---:|---:|")
        for interval in intervals:
            runs = [r for r in results["runs"] if r["interval_s"] == interval]
            rate = statistics.median(r["steady"] for r in runs)
            each = [s for r in runs for s in r["checkpoint_s"]]
            print(
                f"| {interval:g} | {rate:,.0f} | {rate / base:.3f} | "
                f"{statistics.median(r['checkpoints_in_loop'] for r in runs):g} | {statistics.median(each):.2f} |"
            )
    if args.table_rows:
        table = _table_part(args.table_rows, args.dim, work)
        results["table"] = table
        stall = table["snapshot_s"] / (300.0 + table["snapshot_s"])
        print(
            f"\ntable of {table['rows']:,} rows, dim {table['dim']}: snapshot {table['snapshot_s']:.1f} s "
            f"({table['bytes'] / 1e9:.2f} GB), restore {table['restore_s']:.1f} s; at the default 300 s "
            f"interval a checkpoint stalls training {stall:.1%}"
        )
    if args.incremental_rows:
        inc = _incremental_part(
            args.incremental_rows,
            args.incremental_dim,
            work,
            [float(x) for x in args.incremental_shares.split(",")],
        )
        results["incremental"] = inc
        full = inc["snapshots"][0]
        print("\n| snapshot | bytes | seconds | size vs full | time vs full |")
        print("|---|---:|---:|---:|---:|")
        for snap in inc["snapshots"]:
            print(
                f"| {snap['name']} | {snap['bytes'] / 1e6:,.1f} MB | {snap['seconds']:.3f} | "
                f"{full['bytes'] / snap['bytes']:.1f}x smaller | {full['seconds'] / snap['seconds']:.1f}x faster |"
            )
        print(
            f"restore (alternating, median of 3): full {statistics.median(inc['restore_full_s']):.2f} s, "
            f"chain {'+'.join(snap['name'] for snap in inc['snapshots'])} "
            f"{statistics.median(inc['restore_chain_s']):.2f} s"
        )
    results["load_after"] = os.getloadavg()[0]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
