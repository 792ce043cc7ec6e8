"""The scheduler comparison: every scheduler on every case, each cost against the case's exact optimum.

A *case* is a problem at one throughput floor, given as a fraction of the highest throughput any plan
of that problem reaches (so 0.8 is hard everywhere, whatever the problem's scale). Every cost is
compared with the exact optimum of its case. A problem with a runtime section (DESIGN.md §3b) is
scheduled on that true model; each plan is also priced on the base model of §3 (`base_cost`,
`base_throughput`, `base_feasible`), and `base:exact` (the base model's exact optimum) always runs
beside exact, to show what ignoring the runtime terms costs::

    problems = generate_problems(4, seed=0)
    table = compare_schedulers(problems, floors=(0.2, 0.6), schedulers=["exact", "greedy", "genetic"],
                               storage_path="runs/tune")

Trials run inside the caller's Ray (``ray.init`` first, or the CLI's); each asks for `cpus_per_trial`
CPUs, and RL trials for a whole CPU (RLlib runs inside the trial).
"""

from __future__ import annotations

import glob
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from heterps_ray.costmodel import Plan, Problem, evaluate_plan, load_problem
from heterps_ray.errors import ConfigError, HeterPSError
from heterps_ray.experiments.cost_frontier import with_floor
from heterps_ray.experiments.trials import RL_CPUS, cpus_available, fit
from heterps_ray.scheduling import (
    BaseModelScheduler,
    Scheduler,
    available_schedulers,
    base_model,
    get_scheduler,
)
from heterps_ray.scheduling.exact import max_reachable_throughput

DEFAULT_FLOORS = (0.2, 0.4, 0.6, 0.8)  # fractions of each problem's highest reachable throughput
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


@dataclass(frozen=True)
class Case:
    """One problem at one floor: `floor` is the fraction, `problem.throughput_min` the samples/s."""

    problem_name: str
    floor: float
    problem: Problem

    @property
    def key(self) -> str:
        return f"{self.problem_name}@{self.floor:g}"


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
    cpus = cpus_available()
    rows = fit(
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


def _unique_names(problems: list[Problem], stems: list[str]) -> list[Problem]:
    """Cases are keyed by problem name: rename duplicates after their files."""
    seen: dict[str, int] = {}
    for p in problems:
        seen[p.name] = seen.get(p.name, 0) + 1
    return [
        p if seen[p.name] == 1 else p.model_copy(update={"name": f"{p.name} [{stem}]"})
        for p, stem in zip(problems, stems, strict=True)
    ]
