"""`heterps tune ...` (Ray Tune experiments over schedulers) and `heterps plot ...` (PNG charts)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_SUITE_HELP = (
    "Problems come from --problems (a file, a directory of *.yaml/*.json or a glob) or --generate N "
    "(random problems from scheduling.generator, seeds --seed..--seed+N-1). Floors are fractions of each "
    "problem's highest reachable throughput."
)


def register(subparsers: Any) -> None:
    _register_tune(subparsers)
    _register_plot(subparsers)


# -- heterps tune -------------------------------------------------------------------------------


def _register_tune(subparsers: Any) -> None:
    tune = subparsers.add_parser(
        "tune",
        help="Ray Tune experiments: compare schedulers, sweep the RL and genetic schedulers' settings",
        description="Ray Tune experiments over schedulers. " + _SUITE_HELP,
    )
    sub = tune.add_subparsers(dest="tune_command", metavar="EXPERIMENT", required=True)

    compare = sub.add_parser(
        "schedulers",
        help="every scheduler on every (problem, floor): cost, ratio to exact, throughput, seconds",
        description=(
            "One Tune trial per (problem, floor, scheduler). Writes OUTPUT/schedulers.parquet (problem, floor, "
            "throughput_min, scheduler, cost, ratio, throughput, cost_rate, feasible, base_cost, base_throughput, "
            "base_feasible, scheduled_with, seconds, plans_evaluated, assignment, replicas, ps_shards), "
            "OUTPUT/cost_vs_floor.png and OUTPUT/ratio_to_exact.png, and prints the mean cost ratio to the exact "
            "optimum per scheduler and floor and the cases each scheduler wins. cost/throughput/feasible are "
            "under the problem's own model (with a runtime section, DESIGN.md §3b, the true model), base_* "
            "under the base model of §3; with runtime sections base:exact (the base model's exact optimum) "
            "always runs too. " + _SUITE_HELP
        ),
    )
    _suite_arguments(compare, floors="0.2,0.4,0.6,0.8")
    compare.add_argument(
        "--schedulers",
        default=None,
        help="comma-separated names, base:<name> for <name> on the base model (default: all registered "
        "but brute; exact always runs, and base:exact when a problem has a runtime section)",
    )
    compare.add_argument(
        "--budget-s", type=float, default=30.0, help="time budget per scheduler run, seconds (default 30)"
    )
    compare.add_argument(
        "--rl-iterations", type=int, default=None, help="PPO iterations per rl run instead of its time budget"
    )
    compare.set_defaults(func=_tune_schedulers)

    for name, what in (
        (
            "rl",
            "the RL scheduler's PPO settings (lr, entropy_coeff, train_batch_size, minibatch_size, num_epochs, clip_param, hidden)",
        ),
        ("genetic", "the genetic baseline's population, mutation_rate and generations"),
    ):
        sweep = sub.add_parser(
            name,
            help=f"sweep {what.split(' (')[0]}",
            description=(
                f"Sample --num-samples combinations of {what} with Tune (seeded by --seed) and run each on the "
                "problem suite. Metric, minimised: the mean cost ratio to the exact optimum (a missed floor "
                "counts 10). Writes OUTPUT/sweep_<name>.parquet and OUTPUT/best_<name>.json, prints the best. "
                + _SUITE_HELP
            ),
        )
        _suite_arguments(sweep, floors="0.5")
        sweep.add_argument("--num-samples", type=int, default=8, help="settings to try (default 8)")
        sweep.add_argument(
            "--budget-s",
            type=float,
            default=30.0 if name == "rl" else None,
            help="time budget per scheduler run, seconds"
            + (" (default 30)" if name == "rl" else " (default none)"),
        )
        if name == "rl":
            sweep.add_argument(
                "--iterations", type=int, default=None, help="PPO iterations per run instead of --budget-s"
            )
        sweep.set_defaults(func=_tune_sweep, scheduler=name)


def _suite_arguments(p: argparse.ArgumentParser, floors: str) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--problems", metavar="DIR_OR_GLOB", help="problem files: a file, a directory or a glob"
    )
    source.add_argument("--generate", type=int, metavar="N", help="N random problems instead")
    p.add_argument("--seed", type=int, default=0, help="seed of generated problems, schedulers and sampling")
    p.add_argument(
        "--layers", default="3,6", metavar="MIN,MAX", help="layers of generated problems (default 3,6)"
    )
    p.add_argument(
        "--types", default="2,3", metavar="MIN,MAX", help="resource types of generated problems (default 2,3)"
    )
    p.add_argument("--floors", default=floors, help=f"comma-separated floor fractions (default {floors})")
    p.add_argument(
        "--output", "-o", required=True, type=Path, metavar="DIR", help="where results and plots go"
    )
    p.add_argument(
        "--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else start a local Ray)"
    )
    p.add_argument("--cpus-per-trial", type=float, default=0.5, help="CPUs per trial (rl trials take 1)")


def _tune_schedulers(args: argparse.Namespace) -> int:
    from heterps_ray.errors import ConfigError
    from heterps_ray.experiments.compare import check_schedulers, compare_schedulers
    from heterps_ray.experiments.plots import plot_cost_vs_floor, plot_ratio_to_exact

    if args.rl_iterations is not None and args.rl_iterations < 1:
        raise ConfigError(None, "--rl-iterations", "a positive integer", args.rl_iterations)
    problems, floors = _suite(args)
    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()] if args.schedulers else None
    options = {"rl": {"iterations": args.rl_iterations}} if args.rl_iterations else None
    if schedulers:
        check_schedulers(schedulers)
    _init_ray(args)
    table = compare_schedulers(
        problems,
        schedulers=schedulers,
        floors=floors,
        budget_s=args.budget_s,
        seed=args.seed,
        storage_path=args.output / "tune",
        cpus_per_trial=args.cpus_per_trial,
        scheduler_options=options,
        verbose=args.verbose,
    )
    args.output.mkdir(parents=True, exist_ok=True)
    parquet = args.output / "schedulers.parquet"
    table.to_parquet(parquet, index=False)
    plots = [
        plot_cost_vs_floor(table, args.output / "cost_vs_floor.png"),
        plot_ratio_to_exact(table, args.output / "ratio_to_exact.png"),
    ]
    print(
        f"{len(table)} trials: {table['problem'].nunique()} problems x {table['floor'].nunique()} floors x "
        f"{table['scheduler'].nunique()} schedulers"
    )
    print(_summary(table))
    print(f"wrote {parquet}, {', '.join(str(p) for p in plots)}")
    return 0


def _tune_sweep(args: argparse.Namespace) -> int:
    from heterps_ray.errors import ConfigError
    from heterps_ray.experiments.sweep import sweep_scheduler

    if args.num_samples < 1:
        raise ConfigError(None, "--num-samples", "a positive integer", args.num_samples)
    fixed: dict[str, Any] = {}
    if getattr(args, "iterations", None) is not None:
        if args.iterations < 1:
            raise ConfigError(None, "--iterations", "a positive integer", args.iterations)
        fixed["iterations"] = args.iterations
    problems, floors = _suite(args)
    _init_ray(args)
    result = sweep_scheduler(
        args.scheduler,
        problems,
        num_samples=args.num_samples,
        floors=floors,
        budget_s=args.budget_s,
        fixed=fixed,
        seed=args.seed,
        storage_path=args.output / "tune",
        cpus_per_trial=args.cpus_per_trial,
        verbose=args.verbose,
    )
    args.output.mkdir(parents=True, exist_ok=True)
    parquet = args.output / f"sweep_{args.scheduler}.parquet"
    result.table.to_parquet(parquet, index=False)
    best = args.output / f"best_{args.scheduler}.json"
    best.write_text(json.dumps({"mean_ratio": result.best_mean_ratio, **result.best_config}, indent=2) + "\n")
    print(f"{len(result.table)} settings of {args.scheduler} on {result.table['cases'].iloc[0]} cases:")
    print(result.table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    settings = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.best_config.items()
    )
    print(f"best: {settings} (mean cost ratio to exact {result.best_mean_ratio:.4f})")
    print(f"wrote {parquet}, {best}")
    return 0


def _suite(args: argparse.Namespace) -> tuple[list[Any], list[float]]:
    from heterps_ray.config import writable
    from heterps_ray.errors import ConfigError
    from heterps_ray.experiments.compare import generate_problems, load_problems

    writable(args.output, "--output", directory=True)
    try:
        floors = [float(x) for x in args.floors.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(None, "--floors", "comma-separated numbers such as 0.2,0.6", args.floors) from None
    if not floors:
        raise ConfigError(None, "--floors", "at least one floor fraction", args.floors)
    if args.generate is not None:
        if args.generate < 1:
            raise ConfigError(None, "--generate", "a positive number of problems", args.generate)
        layers, types = _range(args.layers, "--layers", 1, 30), _range(args.types, "--types", 2, 5)
        return generate_problems(args.generate, seed=args.seed, num_layers=layers, num_types=types), floors
    return load_problems(args.problems), floors


def _range(text: str, option: str, low: int, high: int) -> tuple[int, int]:
    from heterps_ray.errors import ConfigError

    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(None, option, "MIN,MAX (two integers)", text) from None
    if not low <= a <= b <= high:
        raise ConfigError(None, option, f"{low} <= MIN <= MAX <= {high}", text)
    return a, b


def _summary(table: Any) -> str:
    """Mean cost ratio to exact per scheduler (rows) and floor (columns); misses counted apart; the cases
    each scheduler wins (its plan the cheapest that meets the floor), on the true model and, where the
    problems have runtime terms, on the base model; and a line naming the winner on the true model."""
    import numpy as np

    finite = table.assign(ratio=table["ratio"].where(np.isfinite(table["ratio"])))
    ratio = finite.pivot_table(index="scheduler", columns="floor", values="ratio", aggfunc="mean")
    ratio = ratio.reindex(sorted(table["scheduler"].unique()))  # a scheduler that missed every floor too
    missed = table.assign(missed=np.isinf(table["ratio"])).groupby("scheduler")["missed"].sum()
    seconds = table.groupby("scheduler")["seconds"].mean()
    ratio.columns = [f"floor {c:g}" for c in ratio.columns]
    ratio["missed"] = missed
    ratio["wins"] = _wins(table, "cost", "feasible").reindex(ratio.index, fill_value=0)
    runtime = bool(
        ((table["base_cost"] != table["cost"]) | (table["base_throughput"] != table["throughput"])).any()
    )
    if runtime:
        ratio["base wins"] = _wins(table, "base_cost", "base_feasible").reindex(ratio.index, fill_value=0)
    ratio["mean s"] = seconds
    cases = table.groupby(["problem", "floor"]).ngroups
    wins = ratio["wins"].sort_values(ascending=False, kind="stable")
    line = (
        f"wins on the true model{' (the runtime terms, DESIGN.md §3b)' if runtime else ''}: "
        + ", ".join(f"{name} {int(n)} of {cases}" for name, n in wins.items() if n > 0)
        if wins.max() > 0
        else "no scheduler's plan meets any floor"
    )
    return (
        "mean cost / exact optimum's cost (feasible plans); missed = floors exact reaches but it does not;\n"
        "wins = cases where its plan is the cheapest that meets the floor (ties shared)"
        + ("; base wins = the same on the base model (no runtime terms)" if runtime else "")
        + "\n"
        + ratio.to_string(float_format=lambda x: f"{x:.3f}")
        + "\n"
        + line
    )


def _wins(table: Any, cost: str, feasible: str) -> Any:
    """Per scheduler, the (problem, floor) cases where its plan meets the floor at the lowest `cost`."""
    from heterps_ray.costmodel.formulas import FLOOR_RTOL

    ok = table[table[feasible].astype(bool)]
    best = ok.groupby(["problem", "floor"])[cost].transform("min")
    return ok[ok[cost] <= best * (1.0 + FLOOR_RTOL)].groupby("scheduler").size()


def _init_ray(args: argparse.Namespace) -> None:
    """The Ray of every command (heterps_ray.cluster): --address, $RAY_ADDRESS, else an embedded one."""
    from heterps_ray.cluster import connect

    connect(None, args.address)


# -- heterps plot -------------------------------------------------------------------------------


def _register_plot(subparsers: Any) -> None:
    plot = subparsers.add_parser(
        "plot",
        help="PNG charts: a problem's cost/throughput frontier, a plan's pipeline timeline, a comparison",
        description="Draw PNG charts (matplotlib) from problems, plans, timelines and experiment results.",
    )
    sub = plot.add_subparsers(dest="plot_command", metavar="CHART", required=True)

    frontier = sub.add_parser(
        "frontier",
        help="the exact optimum's and the best single-type plan's cost against the floor",
        description=(
            "Walk the throughput floor of PROBLEM from 2%% to 115%% of the highest reachable throughput and "
            "draw the cost of the exact optimum and of the best single-type plan (step curves; floors no plan "
            "reaches are shaded). With --table, also write the frontier as Parquet."
        ),
    )
    frontier.add_argument(
        "--problem", required=True, type=Path, metavar="FILE", help="problem file (YAML/JSON)"
    )
    frontier.add_argument("--output", "-o", required=True, type=Path, metavar="PNG")
    frontier.add_argument(
        "--table", type=Path, default=None, metavar="PARQUET", help="also write the frontier table"
    )
    frontier.set_defaults(func=_plot_frontier)

    pipeline = sub.add_parser(
        "pipeline",
        help="a Gantt chart of a plan's micro-batches per stage replica (simulated or from a run)",
        description=(
            "Draw forward/backward calls per stage replica over time. Either simulate PLAN on PROBLEM "
            "(the discrete-event simulator) or read a timeline (CSV or Parquet with start_ms, end_ms, stage, "
            "replica, kind, batch[, micro_batch], as `heterps simulate --timeline` writes)."
        ),
    )
    pipeline.add_argument("--problem", type=Path, metavar="FILE", help="problem file, with --plan")
    pipeline.add_argument("--plan", type=Path, metavar="PLAN.json", help="plan to simulate")
    pipeline.add_argument(
        "--timeline", type=Path, metavar="FILE", help="a recorded timeline instead (CSV/Parquet)"
    )
    pipeline.add_argument(
        "--mode", choices=("sync", "async"), default="async", help="simulated mode (default async)"
    )
    pipeline.add_argument("--batches", type=int, default=12, help="batches to simulate (default 12)")
    pipeline.add_argument("--micro-batches", type=int, default=2, help="micro-batches per batch (default 2)")
    pipeline.add_argument("--max-batches", type=int, default=6, help="batches drawn (default 6)")
    pipeline.add_argument("--output", "-o", required=True, type=Path, metavar="PNG")
    pipeline.set_defaults(func=_plot_pipeline)

    results = sub.add_parser(
        "schedulers",
        help="re-draw the charts of a `heterps tune schedulers` result",
        description="Draw cost_vs_floor.png and ratio_to_exact.png from a schedulers.parquet into DIR.",
    )
    results.add_argument("results", type=Path, metavar="RESULTS.parquet")
    results.add_argument("--output", "-o", required=True, type=Path, metavar="DIR")
    results.set_defaults(func=_plot_schedulers)


def _plot_frontier(args: argparse.Namespace) -> int:
    from heterps_ray.config import writable
    from heterps_ray.costmodel import load_problem
    from heterps_ray.experiments.cost_frontier import frontier
    from heterps_ray.experiments.plots import plot_frontier

    writable(args.output, "--output", directory=False)
    if args.table:
        writable(args.table, "--table", directory=False)
    problem = load_problem(args.problem)
    table = frontier(problem)
    path = plot_frontier(table, args.output, title=f"Cost/throughput frontier: {problem.name}")
    steps = int(table["exact_feasible"].sum())
    print(
        f"{problem.name}: highest reachable throughput {table['best_throughput'].iloc[0]:,.0f} samples/s; "
        f"{steps} floors on the exact frontier, cost {table['exact_cost'][table['exact_feasible']].min():,.4f} .. "
        f"{table['exact_cost'][table['exact_feasible']].max():,.4f} $"
    )
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        table.to_parquet(args.table, index=False)
        print(f"wrote {args.table}")
    print(f"wrote {path}")
    return 0


def _plot_pipeline(args: argparse.Namespace) -> int:
    import pandas as pd

    from heterps_ray.config import writable
    from heterps_ray.errors import ConfigError, DataError
    from heterps_ray.experiments.plots import SPAN_COLUMNS, plot_pipeline

    writable(args.output, "--output", directory=False)
    labels = None
    if args.timeline is not None:
        if args.plan is not None:
            raise ConfigError(None, "--timeline", "either --timeline or --problem with --plan, not both")
        try:
            spans = (
                pd.read_parquet(args.timeline)
                if args.timeline.suffix == ".parquet"
                else pd.read_csv(args.timeline)
            )
        except (OSError, ValueError) as exc:
            raise DataError(f"{args.timeline}: cannot read a timeline ({exc})") from None
        missing = [c for c in SPAN_COLUMNS if c not in spans.columns]
        if missing:
            raise DataError(
                f"{args.timeline}: missing timeline columns {missing} (expected {list(SPAN_COLUMNS)})"
            )
        source = str(args.timeline)
    else:
        if args.problem is None or args.plan is None:
            raise ConfigError(None, "--plan", "--problem and --plan together (or --timeline)")
        from heterps_ray.costmodel import load_plan, load_problem
        from heterps_ray.costmodel.simulator import simulate

        if args.batches < 1 or args.micro_batches < 1:
            raise ConfigError(
                None,
                "--batches",
                "positive --batches and --micro-batches",
                (args.batches, args.micro_batches),
            )
        problem = load_problem(args.problem)
        plan = load_plan(args.plan, problem)
        result = simulate(
            problem, plan, batches=args.batches, micro_batches=args.micro_batches, mode=args.mode
        )
        spans = result.spans
        labels = [f"{s.type} x{s.replicas}" for s in plan.stages]
        source = f"simulated {args.mode}, {result.throughput:,.0f} samples/s"
        print(
            f"simulated {args.batches} batches of {args.plan}: {result.throughput:,.0f} samples/s ({args.mode})"
        )
    path = plot_pipeline(
        spans,
        args.output,
        stage_labels=labels,
        max_batches=args.max_batches,
        title=f"Pipeline timeline ({source}; first {args.max_batches} batches, labels batch.micro-batch)",
    )
    print(f"wrote {path}")
    return 0


def _plot_schedulers(args: argparse.Namespace) -> int:
    import pandas as pd

    from heterps_ray.config import writable
    from heterps_ray.errors import DataError
    from heterps_ray.experiments.plots import plot_cost_vs_floor, plot_ratio_to_exact

    writable(args.output, "--output", directory=True)
    try:
        table = pd.read_parquet(args.results)
    except (OSError, ValueError) as exc:
        raise DataError(f"{args.results}: cannot read the results ({exc})") from None
    try:
        paths = [
            plot_cost_vs_floor(table, args.output / "cost_vs_floor.png"),
            plot_ratio_to_exact(table, args.output / "ratio_to_exact.png"),
        ]
    except ValueError as exc:
        raise DataError(f"{args.results}: {exc}") from None
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
