"""Ray Tune experiments over schedulers: compare them across problems and floors, sweep their settings.

A *case* is a problem at one throughput floor, given as a fraction of the highest throughput any plan
of that problem reaches (so 0.8 is hard everywhere, whatever the problem's scale). Every cost is
compared with the exact optimum of its case. A problem with a runtime section (DESIGN.md §3b) is
scheduled on that true model; each plan is also priced on the base model of §3 (`base_cost`,
`base_throughput`, `base_feasible`), and `base:exact` (the base model's exact optimum) always runs
beside exact, to show what ignoring the runtime terms costs::

    problems = generate_problems(4, seed=0)
    table = compare_schedulers(problems, floors=(0.2, 0.6), schedulers=["exact", "greedy", "genetic"],
                               storage_path="runs/tune")
    sweep = sweep_scheduler("genetic", problems, num_samples=8, storage_path="runs/tune")
    sweep.best_config, sweep.table

Trials run inside the caller's Ray (``ray.init`` first, or the CLI's); each asks for `cpus_per_trial`
CPUs, and RL trials for a whole CPU (RLlib runs inside the trial).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from heterps_ray.costmodel import Plan, Problem, evaluate_plan, load_problem
from heterps_ray.errors import ConfigError, HeterPSError
from heterps_ray.experiments.cost_frontier import with_floor
from heterps_ray.scheduling import (
    BaseModelScheduler,
    Scheduler,
    available_schedulers,
    base_model,
    get_scheduler,
)
from heterps_ray.scheduling.exact import max_reachable_throughput

DEFAULT_FLOORS = (0.2, 0.4, 0.6, 0.8)  # fractions of each problem's highest reachable throughput
MISSED_RATIO = 10.0  # a sweep scores a plan that misses a reachable floor as 10x the optimum's cost
RL_CPUS = 1.0  # RLlib inside a trial keeps one CPU busy
# Schedulers left out by default: brute enumerates T^L assignments (exact gives the same optimum).
_NOT_COMPARED_BY_DEFAULT = {"brute"}

# Result columns of compare_schedulers, in order.
COMPARISON_COLUMNS = (
    "problem",
    "floor",
    "throughput_min",
    "scheduler",
    "cost",
    "ratio",
    "throughput",
    "cost_rate",
    "feasible",
    "base_cost",
    "base_throughput",
    "base_feasible",
    "scheduled_with",
    "seconds",
    "plans_evaluated",
    "assignment",
    "replicas",
    "ps_shards",
    "error",
)
BASE_OPTIMUM = "base:exact"  # the base model's exact optimum, priced by the true model


# What each sweep trial reports (besides its settings).
SWEEP_METRICS = ("mean_ratio", "worst_ratio", "mean_ratio_feasible", "missed", "cases", "seconds")


@dataclass(frozen=True)
class Case:
    """One problem at one floor: `floor` is the fraction, `problem.throughput_min` the samples/s."""

    problem_name: str
    floor: float
    problem: Problem

    @property
    def key(self) -> str:
        return f"{self.problem_name}@{self.floor:g}"


@dataclass
class SweepResult:
    """One row per trial (its settings and metrics), sorted best first, and the best settings."""

    scheduler: str
    table: pd.DataFrame
    best_config: dict[str, Any]
    best_mean_ratio: float


# ---------------------------------------------------------------------------------------------
# Problem suites


def load_problems(spec: str | Path) -> list[Problem]:
    """Problems from a file, a directory (its *.yaml, *.yml and *.json) or a glob pattern."""
    path = Path(spec)
    if path.is_dir():
        # problem files, not an older profile's <problem>.runtime.yaml side file beside them
        files = sorted(
            p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json") and ".runtime." not in p.name
        )
    elif path.is_file():
        files = [path]
    else:
        files = [Path(p) for p in sorted(glob.glob(str(spec)))]
    if not files:
        raise ConfigError(
            str(spec), "--problems", "a problem file, a directory of them or a glob matching some"
        )
    problems = [load_problem(f) for f in files]
    return _unique_names(problems, [f.stem for f in files])


def generate_problems(
    count: int, seed: int = 0, num_layers: tuple[int, int] = (3, 6), num_types: tuple[int, int] = (2, 3)
) -> list[Problem]:
    """`count` random problems (scheduling.generator), seeds seed..seed+count-1."""
    from heterps_ray.scheduling.generator import generate_problem

    return [generate_problem(seed + i, num_layers=num_layers, num_types=num_types) for i in range(count)]


def make_cases(problems: Sequence[Problem], floors: Iterable[float]) -> list[Case]:
    """Every problem at every floor fraction of its highest reachable throughput."""
    floors = [float(f) for f in floors]
    for f in floors:
        if not 0.0 < f <= 1.5:
            raise ConfigError(
                None, "--floors", "fractions of the highest reachable throughput in (0, 1.5]", f
            )
    cases = []
    for problem in problems:
        theta_max = max_reachable_throughput(problem)
        if not (theta_max > 0.0 and math.isfinite(theta_max)):
            raise ConfigError(
                None,
                "--problems",
                f"problems where some plan reaches a finite throughput ({problem.name!r} reaches {theta_max})",
            )
        cases += [Case(problem.name, f, with_floor(problem, f * theta_max)) for f in floors]
    return cases


# ---------------------------------------------------------------------------------------------
# Comparing schedulers


def default_schedulers() -> list[str]:
    """Every registered scheduler worth comparing: exact, the best single type, the baselines, rl."""
    return sorted(set(available_schedulers()) - _NOT_COMPARED_BY_DEFAULT, key=lambda n: (n != "exact", n))


def compare_schedulers(
    problems: Sequence[Problem],
    *,
    schedulers: Sequence[str] | None = None,
    floors: Iterable[float] = DEFAULT_FLOORS,
    budget_s: float | None = None,
    seed: int = 0,
    storage_path: str | Path = "runs/tune",
    cpus_per_trial: float = 0.5,
    scheduler_options: Mapping[str, Mapping[str, Any]] | None = None,
    verbose: bool = False,
) -> pd.DataFrame:
    """One Tune trial per (problem, floor, scheduler); a DataFrame with COMPARISON_COLUMNS.

    `ratio` is cost / the exact optimum's cost of the case (exact always runs): inf where the
    scheduler misses a floor that exact reaches, NaN where no plan reaches it. Cost, throughput and
    feasible are under the problem's own model (with its runtime terms, the true model), base_* under
    the base model of DESIGN.md §3 (plan_metrics); with runtime terms base:exact always runs too.
    `scheduler_options` adds keyword arguments per scheduler (e.g. {"rl": {"iterations": 2}}).
    """
    from ray import tune

    # with runtime terms the base model's optimum is not the optimum: always show what it is worth
    base = [BASE_OPTIMUM] if any(p.runtime is not None for p in problems) else []
    names = list(dict.fromkeys(["exact", *base, *(schedulers or default_schedulers())]))
    check_schedulers(names)
    cases = make_cases(problems, floors)
    options = {k: dict(v) for k, v in (scheduler_options or {}).items()}
    trainable = tune.with_parameters(
        _schedule_trial, cases={c.key: c for c in cases}, budget_s=budget_s, seed=seed, options=options
    )
    cpus = _cpus_available()
    rows = _fit(
        tune.with_resources(
            trainable,
            lambda config: tune.PlacementGroupFactory(
                [{"CPU": min(RL_CPUS if _is_rl(config["scheduler"]) else cpus_per_trial, cpus)}]
            ),
        ),
        param_space={
            "case": tune.grid_search([c.key for c in cases]),
            "scheduler": tune.grid_search(names),
        },
        storage_path=storage_path,
        name="schedulers",
        total_trials=len(cases) * len(names),
        verbose=verbose,
    )
    by_key = {c.key: c for c in cases}
    records = []
    for config, metrics in rows:
        case = by_key[config["case"]]
        records.append(
            {
                "problem": case.problem_name,
                "floor": case.floor,
                "throughput_min": case.problem.throughput_min,
                "scheduler": config["scheduler"],
                **{k: metrics[k] for k in COMPARISON_COLUMNS[4:] if k != "ratio"},
            }
        )
    table = pd.DataFrame.from_records(records)
    table["ratio"] = _ratios(table)
    order = {name: i for i, name in enumerate(names)}
    table = table.sort_values(
        ["problem", "floor", "scheduler"], key=lambda col: col.map(order) if col.name == "scheduler" else col
    )
    return table.reset_index(drop=True)[list(COMPARISON_COLUMNS)]


def check_schedulers(names: Iterable[str]) -> None:
    """ConfigError unless every name is a registered scheduler, single:<type> or base:<either>."""
    known = available_schedulers()
    for name in names:
        inner = name.removeprefix("base:")
        if inner not in known and not inner.startswith("single:"):
            raise ConfigError(
                None, "--schedulers", f"names among {known}, single:<type> or base:<name>", name
            )


def _is_rl(name: str) -> bool:
    return name.removeprefix("base:") == "rl"


def plan_metrics(plan: Plan, problem: Problem) -> dict[str, Any]:
    """The comparison columns of one plan of `problem` (what a trial reports): cost (inf where it misses
    the floor), throughput and feasible under the problem's model, base_* under the base model of
    DESIGN.md §3 (the same numbers for a problem without runtime terms)."""
    base = evaluate_plan(plan, base_model(problem))
    return {
        "cost": float(plan.cost) if plan.feasible else math.inf,
        "throughput": float(plan.throughput),
        "cost_rate": float(plan.cost_rate),
        "feasible": bool(plan.feasible),
        "base_cost": float(base.cost) if base.feasible else math.inf,
        "base_throughput": float(base.throughput),
        "base_feasible": bool(base.feasible),
        "scheduled_with": "base" if plan.scheduler.startswith("base:") else "true",
        "seconds": float(plan.seconds),
        "plans_evaluated": int(plan.plans_evaluated),
        "assignment": " ".join(plan.assignment),
        "replicas": " ".join(str(k) for k in plan.replicas),
        "ps_shards": int(plan.ps_shards),
        "error": "",
    }


def make_scheduler(name: str, *, seed: int = 0, budget_s: float | None = None, **options: Any) -> Scheduler:
    """A scheduler by registry name; "single" is the best single-type plan over all types;
    "base:<name>" that scheduler on the base model (scheduling.BaseModelScheduler)."""
    if name.startswith("base:"):
        return BaseModelScheduler(
            make_scheduler(name.removeprefix("base:"), seed=seed, budget_s=budget_s, **options)
        )
    if name == "single":
        from heterps_ray.scheduling.baselines import SingleTypeScheduler

        return SingleTypeScheduler(seed=seed, budget_s=budget_s, **options)
    if name == "rl":
        from heterps_ray.scheduling.rl import RLConfig

        config = options.pop("config", None)
        if isinstance(config, Mapping):
            config = RLConfig(**config)
        if config is not None:
            options["config"] = config
    return get_scheduler(name, seed=seed, budget_s=budget_s, **options)


def _schedule_trial(
    config: dict[str, Any],
    cases: dict[str, Case],
    budget_s: float | None,
    seed: int,
    options: dict[str, dict],
) -> None:
    from ray import tune

    name = config["scheduler"]
    problem = cases[config["case"]].problem
    try:
        settings = options.get(name.removeprefix("base:"), {})  # base:rl takes rl's options
        plan = make_scheduler(name, seed=seed, budget_s=budget_s, **settings).schedule(problem)
    except HeterPSError as exc:  # e.g. "single" where no type runs every layer: a result, not a crash
        tune.report(_no_plan(str(exc), name))
        return
    tune.report(plan_metrics(plan, problem))


def _no_plan(error: str, scheduler: str) -> dict[str, Any]:
    """The metrics of a scheduler that cannot plan a case at all."""
    return {
        "cost": math.inf,
        "throughput": 0.0,
        "cost_rate": math.nan,
        "feasible": False,
        "base_cost": math.inf,
        "base_throughput": 0.0,
        "base_feasible": False,
        "scheduled_with": "base" if scheduler.startswith("base:") else "true",
        "seconds": 0.0,
        "plans_evaluated": 0,
        "assignment": "",
        "replicas": "",
        "ps_shards": 0,
        "error": error,
    }


def _ratios(table: pd.DataFrame) -> pd.Series:
    exact = table[table["scheduler"] == "exact"].set_index(["problem", "floor"])
    ratios = []
    for problem, floor, cost, feasible in zip(
        table["problem"], table["floor"], table["cost"], table["feasible"], strict=True
    ):
        row = exact.loc[(problem, floor)]
        if not row["feasible"]:
            ratios.append(math.nan)
        elif not feasible:
            ratios.append(math.inf)
        else:
            ratios.append(cost / row["cost"] if row["cost"] > 0 else 1.0)
    return pd.Series(ratios, index=table.index, dtype=float)


# ---------------------------------------------------------------------------------------------
# Sweeping a scheduler's settings


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
    cpus = min(RL_CPUS if scheduler == "rl" else cpus_per_trial, _cpus_available())
    trainable = tune.with_parameters(
        _sweep_trial,
        cases=reachable,
        exact_costs={k: p.cost for k, p in exact.items()},
        scheduler=scheduler,
        fixed=dict(fixed or {}),
        budget_s=budget_s,
        seed=seed,
    )
    rows = _fit(
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
    best = {k: _plain(table[k].iloc[0]) for k in space}
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


# ---------------------------------------------------------------------------------------------
# Picking the pretrained policy's hyper-parameters

# What each policy-search trial reports at every validation point (besides its settings).
POLICY_METRICS = (
    "mean_ratio",
    "median_ratio",
    "worst_ratio",
    "greedy_median_ratio",
    "missed",
    "problems",
    "iterations",
    "env_steps",
    "final_return",
    "seconds",
)
# The shipped run's length: 320 PPO iterations of 1024 env steps.
FULL_ENV_STEPS = 327_680


@dataclass
class PolicySearch:
    """A policy search: one row per trial (full-length trials first, best first), each trial's validation
    history and final checkpoint, and the winner: the best trial among those that ran the full length."""

    table: pd.DataFrame
    trials: list[dict[str, Any]]
    best_config: dict[str, Any]
    best_mean_ratio: float
    best_checkpoint: Path
    settings: dict[str, Any]


def policy_search_space() -> dict[str, Any]:
    """Pretraining settings (fields of RLConfig) the policy search samples."""
    from ray import tune

    return {
        "lr": tune.loguniform(1e-4, 3e-3),
        "lr_end": tune.choice([1.0, 0.1]),
        "entropy_coeff": tune.loguniform(1e-3, 3e-2),
        "train_batch_size": tune.choice([512, 1024, 2048]),
        "minibatch_size": tune.choice([128, 256]),
        "num_epochs": tune.choice([4, 6, 10]),
        "hidden": tune.choice([64, 128]),
    }


def asha_milestones(max_env_steps: int, grace_env_steps: int, reduction_factor: float) -> list[int]:
    """The env steps at which ASHA compares trials (its rungs), then the full length."""
    rungs, t = [], float(grace_env_steps)
    while t < max_env_steps:
        rungs.append(int(t))
        t *= reduction_factor
    return [*rungs, int(max_env_steps)]


def tune_policy(
    *,
    num_samples: int = 6,
    max_env_steps: int = FULL_ENV_STEPS,
    report_every: int = 32_768,
    grace_env_steps: int = 98_304,
    reduction_factor: float = 3.0,
    max_concurrent: int = 2,
    pool_size: int = 1000,
    validation: int = 30,
    seed: int = 0,
    layers: tuple[int, int] = (3, 30),
    types: tuple[int, int] = (2, 5),
    search_space: Mapping[str, Any] | None = None,
    base: Any = None,
    include_current: bool = True,
    storage_path: str | Path = "runs/tune",
    between_iterations: Any = None,
    verbose: bool = False,
) -> PolicySearch:
    """Ray Tune with ASHA over the pretraining hyper-parameters, trials as long as a full pretraining run.

    Each trial pretrains a fresh policy (seeded by `seed`) for up to `max_env_steps` env steps on the
    training pool (`pool_size` problems of `layers` x `types`, scheduling.rl.pretrain). Every
    `report_every` env steps, and at its end, it scores the policy alone, zero-shot, on `validation`
    held-out problems (policy_only_score: mean of best-of-33-plans / exact optimum, MISSED_RATIO where it
    misses; minimised) and saves its weights as a Tune checkpoint (policy.pt + policy.json).
    ASHA (time = env steps) stops the trials behind at its rungs (asha_milestones); only a trial that ran
    the full length can win. `base` (an RLConfig; default PRETRAIN_CONFIG) is changed by the sampled
    fields; `include_current` makes base itself the first trial. A linear lr decay (`lr_end`) ends at
    `max_env_steps`.
    """
    import dataclasses

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from heterps_ray.scheduling.rl import RLConfig
    from heterps_ray.scheduling.rl.pretrain import PRETRAIN_CONFIG, training_pool, validation_problems

    space = dict(search_space or policy_search_space())
    known = {f.name for f in fields(RLConfig)}
    unknown = sorted(set(space) - known)
    if unknown:
        raise ConfigError(None, "search_space", f"fields of RLConfig ({sorted(known)})", unknown)
    held_out = validation_problems(validation, layers, types)
    exact_costs = {p.name: _exact_cost(p) for p in held_out}
    if all(c is None for c in exact_costs.values()):
        raise ConfigError(
            None, "validation", "a validation set with at least one feasible problem", validation
        )
    base = dataclasses.replace(base or PRETRAIN_CONFIG, lr_decay_steps=max_env_steps)
    current = {k: v for k, v in dataclasses.asdict(base).items() if k in space}
    milestones = asha_milestones(max_env_steps, grace_env_steps, reduction_factor)
    settings: dict[str, Any] = {
        "num_samples": num_samples,
        "max_env_steps": max_env_steps,
        "report_every": report_every,
        "grace_env_steps": grace_env_steps,
        "reduction_factor": reduction_factor,
        "max_concurrent": max_concurrent,
        "pool_size": pool_size,
        "validation": validation,
        "seed": seed,
        "layers": list(layers),
        "types": list(types),
        "milestones": milestones,
    }
    trainable = tune.with_parameters(
        _policy_trial,
        pool=training_pool(pool_size, seed, layers, types),
        validation=held_out,
        exact_costs=exact_costs,
        base=base,
        max_env_steps=max_env_steps,
        report_every=report_every,
        seed=seed,
        description={"pool": pool_size, "layers": list(layers), "types": list(types)},
        between_iterations=between_iterations,
    )
    results = _tune_results(
        tune.with_resources(trainable, {"cpu": min(RL_CPUS, _cpus_available())}),
        param_space=space,
        storage_path=storage_path,
        name="tune-policy",
        num_samples=num_samples,
        metric="mean_ratio",
        search_alg=BasicVariantGenerator(
            points_to_evaluate=[current] if include_current else None,
            max_concurrent=max_concurrent,
            random_state=seed,
        ),
        scheduler=ASHAScheduler(
            time_attr="env_steps",
            max_t=max_env_steps,
            grace_period=grace_env_steps,
            reduction_factor=reduction_factor,
        ),
        max_concurrent=max_concurrent,
        keep_checkpoints=1,
        total_trials=num_samples,
        verbose=verbose,
    )
    trials = [_policy_trial_record(r, space, current if include_current else None) for r in results]
    table = _policy_table(trials, milestones)
    if not table["full_length"].iloc[0]:
        raise RuntimeError("no policy-search trial ran the full length (every trial was stopped)")
    best = next(t for t in trials if t["trial"] == table["trial"].iloc[0])
    return PolicySearch(
        table=table,
        trials=trials,
        best_config=best["config"],
        best_mean_ratio=float(best["final"]["mean_ratio"]),
        best_checkpoint=best["checkpoint"],
        settings=settings,
    )


def ship_policy(search: PolicySearch, directory: str | Path, command: str) -> Path:
    """Copy the winning trial's final weights to `directory` (policy.pt, its numpy mirror policy.npz when
    the trial wrote one, and policy.json); policy.json keeps
    the trial's own record (config, seed, curve, validation history) and adds the Tune command and table."""
    import shutil

    from heterps_ray.scheduling.rl.policy import policy_metadata

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = policy_metadata(search.best_checkpoint)
    for name in ("policy.pt", "policy.npz"):  # zero-shot planning reads the .npz (it checks its .pt hash)
        if (search.best_checkpoint / name).exists():
            shutil.copyfile(search.best_checkpoint / name, directory / name)
    meta["command"] = command
    meta["tune"] = {
        "picked": search.best_config,
        "mean_ratio": search.best_mean_ratio,
        "settings": search.settings,
        "trials": [_trial_summary(t) for t in search.trials],
    }
    (directory / "policy.json").write_text(json.dumps(meta, indent=1, default=float) + "\n")
    return directory


def _exact_cost(problem: Problem) -> float | None:
    plan = get_scheduler("exact").schedule(problem)
    return float(plan.cost) if plan.feasible else None


def _policy_trial(
    config: dict[str, Any],
    pool: list[Problem],
    validation: list[Problem],
    exact_costs: dict[str, float | None],
    base: Any,
    max_env_steps: int,
    report_every: int,
    seed: int,
    description: dict[str, Any],
    between_iterations: Any,
) -> None:
    import dataclasses
    import tempfile

    from ray import tune

    from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES
    from heterps_ray.scheduling.rl.policy import save_policy
    from heterps_ray.scheduling.rl.pretrain import policy_only_score, pretrain

    settings = dataclasses.replace(base, **config)
    iterations = math.ceil(max_env_steps / settings.train_batch_size)
    started = time.perf_counter()
    curve: list[dict[str, float]] = []
    history: list[dict[str, float]] = []
    next_report = report_every

    def validate(iteration: int, module: Any, point: dict[str, float]) -> None:
        nonlocal next_report
        curve.append(point)
        # RLlib samples a few env steps over train_batch_size per iteration: a trial may reach the full
        # length an iteration early, and ASHA stops it there.
        if point["env_steps"] < min(next_report, max_env_steps) and iteration < iterations:
            return
        while next_report <= point["env_steps"]:
            next_report += report_every
        score = policy_only_score(module, validation, exact_costs, rollouts=settings.rollouts, seed=seed)
        returns = [p["episode_return_mean"] for p in curve[-5:] if math.isfinite(p["episode_return_mean"])]
        metrics = {
            **score,
            "iterations": iteration,
            "env_steps": int(point["env_steps"]),
            "final_return": float(statistics.fmean(returns)) if returns else math.nan,
            "seconds": time.perf_counter() - started,
        }
        history.append(metrics)
        meta = {
            "hidden": settings.hidden,
            "type_features": list(TYPE_FEATURES),
            "context_features": list(CONTEXT_FEATURES),
            "config": dataclasses.asdict(settings),
            "seed": seed,
            **description,
            "iterations": iteration,
            "planned_iterations": iterations,
            "max_env_steps": max_env_steps,
            "curve": curve,
            "validation": history,
        }
        with tempfile.TemporaryDirectory() as folder:
            save_policy(module, folder, meta)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

    pretrain(
        settings,
        pool,
        seed,
        iterations=iterations,
        on_iteration=validate,
        between_iterations=between_iterations,
    )


def _policy_trial_record(
    result: Any, space: Mapping[str, Any], current: dict[str, Any] | None
) -> dict[str, Any]:
    """A finished (or stopped) trial: its config, validation history and final checkpoint folder."""
    from heterps_ray.scheduling.rl.policy import policy_metadata

    if result.checkpoint is None:
        raise RuntimeError(f"policy-search trial {result.path} reported no checkpoint")
    checkpoint = Path(result.checkpoint.path)
    meta = policy_metadata(checkpoint)
    config = {k: _plain(result.config[k]) for k in space}
    return {
        "trial": str(result.metrics["trial_id"]),
        "path": str(result.path),
        "config": config,
        "current": current is not None and all(config[k] == current[k] for k in space),
        "history": meta["validation"],
        "final": meta["validation"][-1],
        "full_length": meta["validation"][-1]["env_steps"] >= meta["max_env_steps"]
        or meta["iterations"] >= meta["planned_iterations"],
        "iterations": meta["iterations"],
        "planned_iterations": meta["planned_iterations"],
        "checkpoint": checkpoint,
    }


def _policy_table(trials: list[dict[str, Any]], milestones: list[int]) -> pd.DataFrame:
    """One row per trial: settings, final scores, the mean ratio at each ASHA milestone it reached."""
    records = []
    for t in trials:
        row: dict[str, Any] = {"trial": t["trial"], "current": t["current"], **t["config"]}
        row.update({k: t["final"][k] for k in POLICY_METRICS})
        row["full_length"] = t["full_length"]
        for m in milestones:
            reached = [h for h in t["history"] if h["env_steps"] >= m]
            row[f"mean_ratio@{m}"] = reached[0]["mean_ratio"] if reached else math.nan
        records.append(row)
    table = pd.DataFrame.from_records(records)
    order = table.sort_values(["full_length", "mean_ratio", "median_ratio"], ascending=[False, True, True])
    return order.reset_index(drop=True)


def _trial_summary(trial: dict[str, Any]) -> dict[str, Any]:
    """A trial as plain JSON: its settings, whether it ran the full length, its validation history."""
    keys = (
        "trial",
        "path",
        "config",
        "current",
        "full_length",
        "iterations",
        "planned_iterations",
        "history",
    )
    return {k: trial[k] for k in keys}


# ---------------------------------------------------------------------------------------------
# Tune plumbing


def _fit(trainable: Any, **options: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run the trials (`options` as :func:`_tune_results`); (config, last reported metrics) per trial."""
    return [(dict(r.config or {}), dict(r.metrics or {})) for r in _tune_results(trainable, **options)]


def _tune_results(
    trainable: Any,
    *,
    param_space: dict[str, Any],
    storage_path: str | Path,
    name: str,
    num_samples: int = 1,
    metric: str | None = None,
    search_alg: Any = None,
    scheduler: Any = None,
    max_concurrent: int = 0,
    keep_checkpoints: int | None = None,
    total_trials: int,
    verbose: bool = False,
) -> list[Any]:
    """Run the trials; Tune's Result per trial (config, last metrics, latest checkpoint). A failed trial
    raises. Quiet unless `verbose`: a progress bar over trials instead of Tune's status tables."""
    from ray import tune

    # No TensorBoard/CSV/JSON loggers: results are read from memory, not from trial folders.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    storage = Path(storage_path).resolve()
    storage.mkdir(parents=True, exist_ok=True)
    progress = _trial_progress(total_trials, name)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            num_samples=num_samples,
            metric=metric,
            mode="min" if metric else None,
            search_alg=search_alg,
            scheduler=scheduler,
            max_concurrent_trials=max_concurrent or None,
            # a trial that ASHA stops must not leave its RLlib algorithm behind in a reused actor
            reuse_actors=scheduler is None,
        ),
        run_config=tune.RunConfig(
            storage_path=str(storage),
            name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
            verbose=1 if verbose else 0,
            callbacks=[progress],
            checkpoint_config=tune.CheckpointConfig(num_to_keep=keep_checkpoints),
        ),
    )
    with _quiet_tune(not verbose):
        results = tuner.fit()
    progress.close()
    if results.errors:
        raise RuntimeError(
            f"{len(results.errors)} Tune trial(s) of {name!r} failed; the first: {results.errors[0]!r}"
        )
    return [results[i] for i in range(len(results))]


@contextmanager
def _quiet_tune(quiet: bool) -> Iterator[None]:
    """Tune's new console output prints tables even at verbose=0; the old engine at 0 is silent.
    Its INFO lines and the warnings about trial folders without result files (we read results
    from memory) are hidden too."""
    if not quiet:
        yield
        return
    previous = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    tune_log = logging.getLogger("ray.tune")
    level = tune_log.level
    tune_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tune_log.setLevel(level)
        if previous is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = previous


def _trial_progress_class() -> type:
    from ray.tune import Callback

    class TrialProgress(Callback):
        """A tqdm bar that advances as trials finish."""

        def __init__(self, total: int, name: str):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=name, unit="trial", leave=False)

        def __getstate__(self) -> dict[str, Any]:
            # Tune pickles its callbacks with the experiment state; a bar holds the terminal stream.
            return {"bar": None}

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            if self.bar is not None:
                self.bar.update(1)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.on_trial_complete(iteration, trials, trial)

        def close(self) -> None:
            if self.bar is not None:
                self.bar.close()

    return TrialProgress


def _trial_progress(total: int, name: str) -> Any:
    """A TrialProgress callback (its class is built on first use: Tune is imported lazily)."""
    return _trial_progress_class()(total, name)


def _cpus_available() -> float:
    import ray

    return float(ray.cluster_resources().get("CPU", 1.0))


def _unique_names(problems: list[Problem], stems: list[str]) -> list[Problem]:
    """Cases are keyed by problem name: rename duplicates after their files."""
    seen: dict[str, int] = {}
    for p in problems:
        seen[p.name] = seen.get(p.name, 0) + 1
    return [
        p if seen[p.name] == 1 else p.model_copy(update={"name": f"{p.name} [{stem}]"})
        for p, stem in zip(problems, stems, strict=True)
    ]


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers, for printing and JSON."""
    return value.item() if isinstance(value, np.generic) else value
