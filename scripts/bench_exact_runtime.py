"""Time `exact` on generated production-size problems, with and without a runtime section (DESIGN.md
§3b) as the profiler writes one (generator.with_runtime_section: async, 4 micro-batches, PS shards as
actors, call_ms 2 on CPU types and 1 on GPUs).

    python scripts/bench_exact_runtime.py --sizes 20x3 40x4 60x5 120x8 --seeds 2 --time-limit-s 120
    python scripts/bench_exact_runtime.py --catalogue gpu_cloud --sizes 60x5 120x8 --seeds 2 --time-limit-s 30

With `--catalogue gpu_cloud` (issue 40) the problems come with their own runtime section, the table's place
priced in it; the base model is the same problem without it.

Per size: max and median seconds of exact on each model, whether each answer is proven (a level walk
that ran into --time-limit-s is not), and how many ILPs it solved. Rows as JSON with --output. Wall
times on a shared machine are rough.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from heterps_ray.scheduling.exact import level_search, runtime_plan
from heterps_ray.scheduling.generator import generate_problem, with_runtime_section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["20x3", "40x4", "60x5", "120x8"], help="LAYERSxTYPES")
    parser.add_argument("--seeds", type=int, default=2, help="problems per size (seeds 0..n-1)")
    parser.add_argument("--time-limit-s", type=float, default=120.0, help="per problem, runtime model")
    parser.add_argument("--output", default=None, help="rows as JSON")
    parser.add_argument(
        "--catalogue", default="wide", choices=["wide", "gpu_cloud"], help="generator catalogue"
    )
    args = parser.parse_args(argv)
    rows = []
    for size in args.sizes:
        L, T = (int(x) for x in size.split("x"))
        for seed in range(args.seeds):
            problem = generate_problem(seed, num_layers=(L, L), num_types=(T, T), catalogue=args.catalogue)
            if problem.runtime is None:
                base, runtime = problem, with_runtime_section(problem)
            else:
                base, runtime = problem.model_copy(update={"runtime": None}), problem
            started = time.perf_counter()
            plan = level_search(base)
            base_s = time.perf_counter() - started
            started = time.perf_counter()
            true = runtime_plan(runtime, time_limit_s=args.time_limit_s)
            true_s = time.perf_counter() - started
            proof = true.extra["proof"]
            row = {
                "size": size, "seed": seed, "base_s": base_s, "base_feasible": plan.feasible,
                "runtime_s": true_s, "runtime_feasible": true.feasible, "runtime_proven": proof["proven"],
                "ilp_solves": proof["ilp_solves"], "stop": proof["stop"],
                "base_cost": plan.cost if plan.feasible else None, "runtime_cost": true.cost if true.feasible else None,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print("| size | problems | base model: median s | max s | runtime terms: median s | max s | proven |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        mine = [r for r in rows if r["size"] == size]
        base, true = [r["base_s"] for r in mine], [r["runtime_s"] for r in mine]
        print(
            f"| {size} | {len(mine)} | {statistics.median(base):.2f} | {max(base):.2f} | "
            f"{statistics.median(true):.2f} | {max(true):.2f} | {sum(r['runtime_proven'] for r in mine)}/{len(mine)} |"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
