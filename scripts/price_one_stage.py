"""The one-stage plan's price on each type of each problem file, and how far each lies from their
median (issue 29: three profiles taken one after another should agree within ±5%):

    python scripts/price_one_stage.py p1.yaml p2.yaml p3.yaml
"""

from __future__ import annotations

import statistics
import sys

from heterps_ray.costmodel import CostModel, load_problem


def main(paths: list[str]) -> None:
    prices: dict[str, list[float]] = {}
    spreads: dict[str, list[float]] = {}
    for path in paths:
        problem = load_problem(path)
        model = CostModel(problem)
        for rtype in problem.resources:
            evaluation = model.evaluate([rtype.name] * len(problem.layers), [1], 1)
            prices.setdefault(rtype.name, []).append(evaluation.throughput)
            spread = problem.runtime.spread.get(rtype.name) if problem.runtime else None
            spreads.setdefault(rtype.name, []).append(spread if spread is not None else float("nan"))
    for name, values in prices.items():
        median = statistics.median(values)
        shown = ", ".join(f"{v:,.0f}" for v in values)
        own = ", ".join(f"±{s:.1%}" for s in spreads[name])
        print(
            f"{name}: {shown} samples/s; median {median:,.0f}, "
            f"{min(values) / median - 1:+.1%} .. {max(values) / median - 1:+.1%}; profiles' own spread {own}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
