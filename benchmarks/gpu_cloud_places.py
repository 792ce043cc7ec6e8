"""Where exact's plans put the table on the GPU-cloud suite (issue 40, scheduling/gpu_cloud.py): per problem
its table (rows, dim, the GPU kinds that hold it whole), its hosting, exact's seconds and proof, and, for a
feasible plan, the table's place (gpu, gpu_cache, ps) as the cost model prices it, stage 0's type, the
layers on each type and the shards.

    python benchmarks/gpu_cloud_places.py --seeds 0 24 --layers 20 120 --types 3 8 --time-limit-s 30
    python benchmarks/gpu_cloud_places.py --floor-fraction 0.01 0.01 --infeasible-share 0   # easy floors

One JSON row per problem on stdout; a count of the places at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from heterps_ray.costmodel import evaluate_plan
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.generator import generate_problem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs=2, type=int, default=[0, 24], metavar=("FIRST", "END"))
    parser.add_argument("--layers", nargs=2, type=int, default=[20, 120], metavar=("MIN", "MAX"))
    parser.add_argument("--types", nargs=2, type=int, default=[3, 8], metavar=("MIN", "MAX"))
    parser.add_argument("--time-limit-s", type=float, default=30.0, help="exact's level walk, per problem")
    parser.add_argument(
        "--floor-fraction", nargs=2, type=float, default=[0.05, 1.0], metavar=("LO", "HI"),
        help="the floor as a share of a reachable throughput (the suite's default)",
    )  # fmt: skip
    parser.add_argument(
        "--infeasible-share", type=float, default=0.1, help="share of floors above every plan's"
    )
    args = parser.parse_args(argv)
    places: Counter[str] = Counter()
    for seed in range(*args.seeds):
        problem = generate_problem(
            seed, num_layers=tuple(args.layers), num_types=tuple(args.types), catalogue="gpu_cloud",
            floor_fraction=tuple(args.floor_fraction), infeasible_share=args.infeasible_share,
        )  # fmt: skip
        table = problem.ps.table
        assert table is not None and problem.runtime is not None
        started = time.perf_counter()
        plan = get_scheduler("exact", budget_s=args.time_limit_s).schedule(problem)
        row = {
            "seed": seed, "layers": problem.num_layers, "types": problem.type_names, "rows": table.rows,
            "bytes_per_row": table.bytes_per_row, "hosting": problem.runtime.ps_hosting,
            "gpus_holding_all": [name for name, rows in table.gpu_rows.items() if rows >= table.rows],
            "exact_s": round(time.perf_counter() - started, 2), "proven": plan.extra["proof"]["proven"],
            "feasible": plan.feasible,
        }  # fmt: skip
        if plan.feasible:
            evaluation = evaluate_plan(plan, problem)
            assert evaluation.runtime is not None
            row.update(
                place=evaluation.runtime.table.place, hit_rate=round(evaluation.runtime.table.hit_rate, 4),
                stage0=problem.type_names[evaluation.stages[0].type], replicas=plan.replicas,
                layers_on=dict(Counter(plan.assignment)), ps_shards=plan.ps_shards, cost=round(plan.cost, 2),
            )  # fmt: skip
            places[row["place"]] += 1
        print(json.dumps(row), flush=True)
    print(json.dumps({"places": dict(places)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
