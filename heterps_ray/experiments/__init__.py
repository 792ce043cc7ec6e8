"""heterps_ray.experiments — Ray Tune experiments over schedulers, the cost/throughput frontier, and plots.

table = compare_schedulers(generate_problems(4), floors=(0.2, 0.6), storage_path="runs/tune")
plot_cost_vs_floor(table, "runs/cost_vs_floor.png")
"""

from heterps_ray.experiments.frontier import frontier, with_floor
from heterps_ray.experiments.plots import (
    plot_cost_vs_floor,
    plot_frontier,
    plot_pipeline,
    plot_ratio_to_exact,
)
from heterps_ray.experiments.tune import (
    DEFAULT_FLOORS,
    Case,
    SweepResult,
    check_schedulers,
    compare_schedulers,
    default_schedulers,
    generate_problems,
    genetic_search_space,
    load_problems,
    make_cases,
    make_scheduler,
    plan_metrics,
    rl_search_space,
    sweep_scheduler,
)

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
