"""Sweeping a scheduler's settings (genetic or rl): sample settings, score each on a suite of cases::

    sweep = sweep_scheduler("genetic", generate_problems(4, seed=0), num_samples=8, storage_path="runs/tune")
    sweep.best_config, sweep.table

Cases and schedulers are the comparison's (experiments.compare); each trial asks for `cpus_per_trial`
CPUs, an rl one for a whole CPU.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from heterps_ray.costmodel import Problem
from heterps_ray.errors import ConfigError
from heterps_ray.experiments.compare import Case, make_cases, make_scheduler
from heterps_ray.experiments.trials import RL_CPUS, cpus_available, fit, plain
from heterps_ray.scheduling import get_scheduler

MISSED_RATIO = 10.0  # a sweep scores a plan that misses a reachable floor as 10x the optimum's cost

# What each sweep trial reports (besides its settings).
SWEEP_METRICS = ("mean_ratio", "worst_ratio", "mean_ratio_feasible", "missed", "cases", "seconds")


@dataclass
class SweepResult:
    """One row per trial (its settings and metrics), sorted best first, and the best settings."""

    scheduler: str
    table: pd.DataFrame
    best_config: dict[str, Any]
    best_mean_ratio: float


def genetic_search_space() -> dict[str, Any]:
    """The genetic baseline's settings: population, mutation rate, generations."""
    from ray import tune

    return {
        "population": tune.choice([16, 32, 48, 96]),
        "mutation_rate": tune.loguniform(0.02, 0.5),
        "generations": tune.choice([10, 30, 60, 120]),
    }


def rl_search_space() -> dict[str, Any]:
    """PPO settings of the RL scheduler (fields of RLConfig) worth sweeping."""
    from ray import tune

    return {
        "lr": tune.loguniform(1e-4, 3e-3),
        "entropy_coeff": tune.loguniform(1e-3, 5e-2),
        "train_batch_size": tune.choice([256, 512, 1024]),
        "minibatch_size": tune.choice([64, 128]),
        "num_epochs": tune.choice([4, 8, 16]),
        "clip_param": tune.choice([0.1, 0.2, 0.3]),
        "hidden": tune.choice([32, 64, 128]),
    }


def sweep_scheduler(
    scheduler: str,
    problems: Sequence[Problem],
    *,
    search_space: Mapping[str, Any] | None = None,
    num_samples: int = 8,
    floors: Iterable[float] = (0.5,),
    budget_s: float | None = None,
    fixed: Mapping[str, Any] | None = None,
    seed: int = 0,
    storage_path: str | Path = "runs/tune",
    cpus_per_trial: float = 0.5,
    verbose: bool = False,
) -> SweepResult:
    """Sample `num_samples` settings of `scheduler` (genetic or rl) and score each on the suite.

    The metric, minimised, is the mean over cases of cost / exact optimum's cost, a missed floor
    counting MISSED_RATIO; cases no plan reaches are left out. `fixed` are keyword arguments given
    to every trial's scheduler (e.g. {"iterations": 2} for rl). Sampling is seeded by `seed`.
    """
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    if scheduler not in ("genetic", "rl"):
        raise ConfigError(
            None, "scheduler", "genetic or rl (the schedulers with settings to sweep)", scheduler
        )
    space = dict(search_space or (rl_search_space() if scheduler == "rl" else genetic_search_space()))
    if scheduler == "rl":
        from heterps_ray.scheduling.rl import RLConfig

        known = {f.name for f in fields(RLConfig)}
        unknown = sorted(set(space) - known)
        if unknown:
            raise ConfigError(None, "search_space", f"fields of RLConfig ({sorted(known)})", unknown)
    cases = make_cases(problems, floors)
    exact = {c.key: get_scheduler("exact").schedule(c.problem) for c in cases}
    reachable = [c for c in cases if exact[c.key].feasible]
    if not reachable:
        raise ConfigError(None, "--floors", "floors some plan reaches on at least one problem")
    cpus = min(RL_CPUS if scheduler == "rl" else cpus_per_trial, cpus_available())
    trainable = tune.with_parameters(
        _sweep_trial,
        cases=reachable,
        exact_costs={k: p.cost for k, p in exact.items()},
        scheduler=scheduler,
        fixed=dict(fixed or {}),
        budget_s=budget_s,
        seed=seed,
    )
    rows = fit(
        tune.with_resources(trainable, {"cpu": cpus}),
        param_space=space,
        storage_path=storage_path,
        name=f"sweep-{scheduler}",
        num_samples=num_samples,
        metric="mean_ratio",
        search_alg=BasicVariantGenerator(random_state=seed),
        total_trials=num_samples,
        verbose=verbose,
    )
    records = [
        {**{k: config[k] for k in space}, **{k: metrics[k] for k in SWEEP_METRICS}}
        for config, metrics in rows
    ]
    table = pd.DataFrame.from_records(records).sort_values(["mean_ratio", "seconds"]).reset_index(drop=True)
    best = {k: plain(table[k].iloc[0]) for k in space}
    return SweepResult(scheduler, table, best, float(table.iloc[0]["mean_ratio"]))


def _sweep_trial(
    config: dict[str, Any],
    cases: list[Case],
    exact_costs: dict[str, float],
    scheduler: str,
    fixed: dict[str, Any],
    budget_s: float | None,
    seed: int,
) -> None:
    from ray import tune

    settings = dict(config)
    if scheduler == "rl":
        settings = {"config": settings}
    started = time.perf_counter()
    ratios, missed = [], 0
    for case in cases:
        plan = make_scheduler(scheduler, seed=seed, budget_s=budget_s, **fixed, **settings).schedule(
            case.problem
        )
        if plan.feasible:
            optimum = exact_costs[case.key]
            ratios.append(plan.cost / optimum if optimum > 0 else 1.0)
        else:
            missed += 1
            ratios.append(MISSED_RATIO)
    feasible_ratios = [r for r in ratios if r != MISSED_RATIO] or [math.nan]
    tune.report(
        {
            "mean_ratio": float(statistics.fmean(ratios)),
            "worst_ratio": float(max(ratios)),
            "mean_ratio_feasible": float(np.nanmean(feasible_ratios)),
            "missed": missed,
            "cases": len(cases),
            "seconds": time.perf_counter() - started,
        }
    )
