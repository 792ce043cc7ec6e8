"""Benchmark and check: the GPU tier's device key index against the CPU store, on every key of a dataset
(issue 49; BENCHMARKS.md "The device key index").

Every training batch of the dataset goes through both, with the same gradients (drawn from a seed): the
compiled CPU store (ps/_rows.c, as a PS shard holds it) pulls and pushes; the device table
(ps/device_table.py, on this machine's CPU: the same tensor code a GPU runs) dedupes, resolves, gathers
and applies in front of a hosted shard. Checked: every row the two hand out is equal, bit for bit, and at
the end the shard behind the device table holds the store's rows, weights, accumulators and admission
(the same keys admitted). Timed, per batch: the device path's steps, and two ways to look the batch's
distinct keys up on the device (the open-addressing index, and a sorted copy of the keys searched with
``torch.searchsorted``, what TorchRec's managed collisions keep), with the index's probe rounds.

    heterps data synth --rows 4000000 --shape criteo-kaggle --seed 0 -o /tmp/ck4m
    ../shared/bench/quiet.sh && .venv/bin/python benchmarks/bench_device_index.py --data /tmp/ck4m --out /tmp/index.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a dataset directory (heterps data synth)")
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--admit-after", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=0, help="device table rows (0: every row fits)")
    parser.add_argument("--batches", type=int, default=0, help="stop after this many (0: the whole split)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args(argv)

    import torch

    from heterps_ray.data.dataset import Dataset
    from heterps_ray.ps.client import PSClient
    from heterps_ray.ps.device_table import DeviceTable
    from heterps_ray.ps.shard import PSShard
    from heterps_ray.ps.spec import TableSpec
    from heterps_ray.ps.table import SparseTable

    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    spec = TableSpec(dim=args.dim, seed=3, lr=0.05, init_accumulator=0.01, admit_after=args.admit_after)
    store = SparseTable(**{k: getattr(spec, k) for k in
                           ("dim", "seed", "lr", "init_accumulator", "init_scale", "optimizer", "admit_after")})  # fmt: skip
    shard = PSShard(0, 1, {"t": spec})
    client = PSClient([shard], hosted=True)
    dataset = Dataset(args.data)
    capacity = args.capacity or dataset.num_rows("train") * 26 + 1
    table = DeviceTable(spec, cpu, capacity)
    times: dict[str, list[float]] = {k: [] for k in ("dedupe", "resolve", "gather", "apply", "store", "sorted_lookup", "index_lookup")}
    mismatched = keys_seen = 0
    rng = np.random.default_rng(7)
    started = time.perf_counter()
    for step, batch in enumerate(dataset.iter_batches("train", args.batch_size)):
        if args.batches and step >= args.batches:
            break
        keys = batch["keys"]
        grads = rng.standard_normal((keys.size, args.dim), dtype=np.float32)
        t0 = time.perf_counter()
        expected = store.pull(keys.ravel(), step=step)
        store.push(keys.ravel(), grads)
        t1 = time.perf_counter()
        deduped = table.dedupe(keys)
        t2 = time.perf_counter()
        resolved = table.resolve(deduped, client, "t", step)
        t3 = time.perf_counter()
        rows = table.gather(resolved)
        t4 = time.perf_counter()
        table.apply(resolved, torch.from_numpy(grads))
        t5 = time.perf_counter()
        mismatched += int((rows.reshape(-1, args.dim).numpy() != expected).any(axis=1).sum())
        keys_seen += keys.size
        for name, seconds in (("store", t1 - t0), ("dedupe", t2 - t1), ("resolve", t3 - t2), ("gather", t4 - t3), ("apply", t5 - t4)):
            times[name].append(seconds * 1000.0)  # fmt: skip
        if step % 20 == 0 and len(table):  # the two ways to look the distinct keys up, on the same keys
            t0 = time.perf_counter()
            table.index.lookup(deduped.unique)
            t1 = time.perf_counter()
            held, _ = table.index.items()
            ordered = held.sort().values
            t2 = time.perf_counter()
            at = torch.searchsorted(ordered, deduped.unique).clamp_(max=len(ordered) - 1)
            _ = ordered[at] == deduped.unique
            t3 = time.perf_counter()
            times["index_lookup"].append((t1 - t0) * 1000.0)
            times["sorted_lookup"].append((t3 - t2) * 1000.0)
    seconds = time.perf_counter() - started
    table.flush(client, "t")
    mine, theirs = shard.state(), store.state()
    same = {f: bool(np.array_equal(mine[f"sparse/t/{f}"], theirs[f])) for f in ("keys", "weights", "accumulators")}
    result: dict[str, Any] = {
        "data": str(args.data),
        "batches": len(times["store"]),
        "keys": keys_seen,
        "rows_admitted": {"store": len(store), "device_tier": len(table)},
        "rows_handed_out_differing": mismatched,
        "end_state_equal": same,
        "index": {"buckets": table.index.buckets, "probe_rounds": table.index._rounds, "bytes": table.index.nbytes},
        "tier": {"hit_rate": table.stats.hit_rate, "fetched": table.stats.fetched, "evicted": table.stats.evicted},
        "ms_per_batch_median": {k: round(statistics.median(v), 3) for k, v in times.items() if v},
        "seconds": round(seconds, 1),
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    equal = mismatched == 0 and all(same.values()) and len(store) == len(table)
    print("EQUAL" if equal else "DIFFERENT")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
