"""heterps_ray.experiments — Ray Tune experiments over schedulers, the cost/throughput frontier, and plots.

table = compare_schedulers(generate_problems(4), floors=(0.2, 0.6), storage_path="runs/tune")
plot_cost_vs_floor(table, "runs/cost_vs_floor.png")
"""

from __future__ import annotations

import importlib
from typing import Any

# Names import their module on first use, so `heterps --help` does not load pandas and matplotlib.
_LAZY = {
    **dict.fromkeys(("frontier", "with_floor"), "cost_frontier"),
    **dict.fromkeys(("plot_cost_vs_floor", "plot_frontier", "plot_pipeline", "plot_ratio_to_exact"), "plots"),
    **dict.fromkeys(
        (
            "DEFAULT_FLOORS",
            "Case",
            "check_schedulers",
            "compare_schedulers",
            "default_schedulers",
            "generate_problems",
            "load_problems",
            "make_cases",
            "make_scheduler",
            "plan_metrics",
        ),
        "compare",
    ),
    **dict.fromkeys(("SweepResult", "genetic_search_space", "rl_search_space", "sweep_scheduler"), "sweep"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"heterps_ray.experiments.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'heterps_ray.experiments' has no attribute {name!r}")


__all__ = [
    "DEFAULT_FLOORS",
    "Case",
    "SweepResult",
    "check_schedulers",
    "compare_schedulers",
    "default_schedulers",
    "frontier",
    "generate_problems",
    "genetic_search_space",
    "load_problems",
    "make_cases",
    "make_scheduler",
    "plan_metrics",
    "plot_cost_vs_floor",
    "plot_frontier",
    "plot_pipeline",
    "plot_ratio_to_exact",
    "rl_search_space",
    "sweep_scheduler",
    "with_floor",
]
