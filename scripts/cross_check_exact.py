"""Cross-check `exact` at size (issue 26): on generated problems, with a runtime section as the profiler
writes one (generator.with_runtime_section) and without, re-price with `costmodel.evaluate_plan` the
plans of rl (zero-shot), genetic, greedy and random search, and count any cheaper than exact's.

    python scripts/cross_check_exact.py --seeds 300 320 --layers 20 60 --types 3 6 --time-limit-s 30

One JSON row per problem and model on stdout: exact's seconds, whether its answer is proven, the best
other scheduler's cost over exact's, and whether it beats exact (it must never).
"""

from __future__ import annotations

import argparse
import json
import math
import time

from heterps_ray.costmodel import evaluate_plan
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.exact import level_search, runtime_plan
from heterps_ray.scheduling.generator import generate_problem, with_runtime_section

# budgets in counts, not seconds: a loaded machine finds the same plans (as tests/test_level_walk.py)
OTHERS = (("rl", {}), ("genetic", {"generations": 20}), ("greedy", {}), ("random", {"samples": 300}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs=2, type=int, default=[300, 320], metavar=("FIRST", "END"))
    parser.add_argument("--layers", nargs=2, type=int, default=[20, 60], metavar=("MIN", "MAX"))
    parser.add_argument("--types", nargs=2, type=int, default=[3, 6], metavar=("MIN", "MAX"))
    parser.add_argument("--time-limit-s", type=float, default=30.0, help="exact on the runtime model")
    args = parser.parse_args(argv)
    beaten = 0
    for seed in range(*args.seeds):
        base = generate_problem(
            seed, num_layers=tuple(args.layers), num_types=tuple(args.types), catalogue="wide",
            infeasible_share=0.0,
        )  # fmt: skip
        for model, problem in (("runtime", with_runtime_section(base)), ("base", base)):
            started = time.perf_counter()
            exact = (
                runtime_plan(problem, time_limit_s=args.time_limit_s)
                if problem.runtime
                else level_search(problem)
            )
            seconds = time.perf_counter() - started
            exact_cost = evaluate_plan(exact, problem).cost if exact.feasible else math.inf
            best, best_cost = None, math.inf
            for name, kwargs in OTHERS:
                evaluation = evaluate_plan(get_scheduler(name, seed=0, **kwargs).schedule(problem), problem)
                if evaluation.meets_floor and evaluation.cost < best_cost:
                    best, best_cost = name, evaluation.cost
            beats = best_cost < exact_cost * (1.0 - 1e-9)
            beaten += beats
            row = {
                "seed": seed, "layers": problem.num_layers, "types": problem.num_types, "model": model,
                "exact_s": round(seconds, 2), "proven": exact.extra["proof"]["proven"],
                "feasible": exact.feasible, "exact_cost": exact_cost if exact.feasible else None,
                "best_other": best,
                "ratio_best_other": best_cost / exact_cost if exact.feasible else None, "beats": beats,
            }  # fmt: skip
            print(json.dumps(row), flush=True)
    return 1 if beaten else 0


if __name__ == "__main__":
    raise SystemExit(main())
