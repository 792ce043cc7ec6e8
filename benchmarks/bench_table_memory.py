"""Benchmark: the table-memory estimate the planner uses (costmodel/table_memory.py) against a real PS
shard actor's resident memory (BENCHMARKS.md "Table memory").

For each row count N it writes a dataset directory holding only a ``_meta.json`` whose 26 slots count
N/26 distinct values each, loads a job on it (configs/clusters/local.yaml, ctr_dnn at ``--dim``), and
takes the planner's estimate from it (``estimate_table``: rows x bytes per row). It then starts one
PSShard actor on a local Ray, as the runtime starts it (the job's TableSpec, the PS type's actor
options), and fills it with exactly those N distinct keys through ``pull`` calls of ``--call-keys``
keys (unique, created on sight, as a PS client calls a shard). The growth of the actor's private
resident memory (RssAnon: its heap and the row store's mappings) over what it held after a first,
empty pull (interpreter, imports, an empty table) is compared with the estimate: a growth more than
15% over it is a defect (exit 1). Its whole RSS also counts the pages of Ray's object store it
touched (the pull's arguments and results, RssShmem): that memory is the node's object store, which
the table budget reserves apart (config.OBJECT_STORE_GB), and is reported beside it.

    .venv/bin/python benchmarks/bench_table_memory.py                       # 2M and 5M rows, dim 16
    .venv/bin/python benchmarks/bench_table_memory.py --rows 2e6 5e6 10e6 --result /tmp/table_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from heterps_ray.cluster import connect  # noqa: E402
from heterps_ray.config import JobConfig, load_cluster  # noqa: E402
from heterps_ray.costmodel.table_memory import GIB, estimate_table  # noqa: E402
from heterps_ray.data.criteo import SPARSE_COLUMNS  # noqa: E402
from heterps_ray.data.layout import META_FILE  # noqa: E402
from heterps_ray.ps.shard import PSShard  # noqa: E402
from heterps_ray.ps.spec import sparse_spec  # noqa: E402
from heterps_ray.ps.table import splitmix64  # noqa: E402

TOLERANCE = 0.15  # RSS growth over the estimate beyond this is a defect (issue 27)
TABLE = "embedding"


def job_for(rows: int, dim: int, folder: Path) -> JobConfig:
    """A job on a dataset whose _meta.json counts `rows` distinct values over the 26 slots."""
    per_slot, extra = divmod(rows, len(SPARSE_COLUMNS))
    distinct = {name: per_slot + (1 if i < extra else 0) for i, name in enumerate(SPARSE_COLUMNS)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / META_FILE).write_text(json.dumps({"distinct_values": distinct}))
    return JobConfig.model_validate(
        {
            "name": "bench_table_memory",
            "model": {"name": "ctr_dnn", "embedding_dim": dim},
            "cluster": load_cluster(REPO / "configs" / "clusters" / "local.yaml").model_dump(),
            "data": {"path": str(folder)},
            "samples": 1,
            "throughput_min": 0,
            "output_dir": str(folder / "out"),
        }
    )


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon (private memory: the heap and the row store's mappings) and RssShmem (pages of
    Ray's object store the actor touched: its arguments and results) of process `pid`, KiB."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: int(status[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssShmem")}


def run_case(rows: int, dim: int, call_keys: int, folder: Path) -> dict[str, Any]:
    job = job_for(rows, dim, folder)
    estimate = estimate_table(job, dim)
    assert estimate is not None and estimate.rows == rows
    cluster = job.cluster
    options = cluster.type(cluster.ps_resource).actor_options()
    shard = (
        ray.remote(PSShard)
        .options(max_concurrency=1, **options)
        .remote(0, 1, {TABLE: sparse_spec(job, dim, 0.01)})
    )
    pid = ray.get(shard.describe.remote())["pid"]
    keys = splitmix64(np.arange(rows, dtype=np.uint64)).view(np.int64)  # distinct: splitmix64 is a bijection
    ray.get(shard.pull.remote(TABLE, keys[:0].copy(), True, True, 0))  # the call path warm, the table empty
    before = memory_kib(pid)
    started = time.perf_counter()
    for step, first in enumerate(range(0, rows, call_keys), start=1):
        ray.get(shard.pull.remote(TABLE, keys[first : first + call_keys], True, True, step))
    seconds = time.perf_counter() - started
    after = memory_kib(pid)
    stats = ray.get(shard.stats.remote())
    ray.kill(shard)
    growth = {k: (after[k] - before[k]) * 1024 for k in after}
    private = growth["RssAnon"]
    return {
        "rows": rows,
        "dim": dim,
        "rows_held": int(stats["rows"][TABLE]),
        "estimate_bytes_per_row": round(estimate.bytes_per_row, 2),
        "estimate_gib": round(estimate.total_bytes / GIB, 4),
        "private_growth_gib": round(private / GIB, 4),
        "private_bytes_per_row": round(private / rows, 2),
        "rss_bytes_per_row": round(growth["VmRSS"] / rows, 2),
        "object_store_pages_gib": round(growth["RssShmem"] / GIB, 4),
        "table_nbytes_per_row": round(stats["bytes"] / rows, 2),
        "growth_over_estimate": round(private / estimate.total_bytes, 4),
        "fill_s": round(seconds, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=float, nargs="+", default=[2e6, 5e6])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--call-keys", type=int, default=65_536, help="keys per pull call")
    parser.add_argument("--result", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    load = Path("/proc/loadavg").read_text().split()[:3]
    owns = connect(load_cluster(REPO / "configs" / "clusters" / "local.yaml"))
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, rows in enumerate(args.rows):
                result = run_case(int(rows), args.dim, args.call_keys, Path(tmp) / f"case{i}")
                results.append(result)
                print(json.dumps(result))
    finally:
        if owns:
            ray.shutdown()
    print(f"load average at the start: {' '.join(load)}")
    if args.result:
        args.result.write_text(json.dumps({"load_average": load, "cases": results}, indent=2) + "\n")
    over = [r for r in results if r["growth_over_estimate"] > 1 + TOLERANCE]
    for r in over:
        print(f"DEFECT: {r['rows']:,} rows grew the shard by {r['growth_over_estimate']:.2f}x the estimate")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
