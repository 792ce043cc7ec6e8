"""`heterps plan` and `heterps compare`: schedule a problem file, or compare every scheduler on it."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

DEFAULT_SCHEDULER = "rl"  # the shipped pretrained policy, zero-shot (issue 8)
BASE_OPTIMUM = "base:exact"  # the base model's exact optimum (DESIGN.md §3), priced by the true model


def register(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="find the cheapest plan that meets a problem's throughput floor",
        description="Schedule a problem (DESIGN.md §4) and print the plan. Exit 0 a plan meets the "
        "floor, 2 bad input, 3 no plan meets the floor.",
    )
    plan.add_argument("--problem", required=True, metavar="FILE", help="problem file (YAML or JSON)")
    plan.add_argument(
        "--scheduler",
        default=DEFAULT_SCHEDULER,
        metavar="NAME",
        help=f"rl, exact, brute, greedy, genetic, random, single, single:<type>, or base:<name> (<name> "
        f"on the base model, ignoring the problem's runtime section) (default {DEFAULT_SCHEDULER})",
    )
    plan.add_argument("--output", metavar="PLAN.json", help="write the plan as JSON")
    plan.add_argument(
        "--budget-s",
        type=float,
        default=None,
        metavar="N",
        help="time budget for search/training (rl: train a fresh policy on this problem for N s; exact: "
        "a time limit on its search, past which it prints the best plan found, marked not proven, or exits "
        "3 if it found none)",
    )
    plan.add_argument(
        "--finetune-s",
        type=float,
        default=None,
        metavar="N",
        help="rl only: fine-tune the shipped pretrained policy on this problem for N s first",
    )
    plan.add_argument("--seed", type=int, default=0, metavar="S")
    plan.set_defaults(func=_plan)

    compare = subparsers.add_parser(
        "compare",
        help="run every scheduler on a problem, side by side",
        description="Cost, ratio to the exact optimum, throughput, feasibility and seconds of every "
        "registered scheduler (and every single-type plan). For a problem with a runtime section "
        "(DESIGN.md §3b) each plan is priced under that true model and under the base model (base_cost, "
        "base_throughput), the base model's exact optimum (base:exact) is added, and a last line names "
        "the plan cheapest under the true model.",
    )
    compare.add_argument("--problem", required=True, metavar="FILE")
    compare.add_argument(
        "--budget-s", type=float, default=None, metavar="N", help="time budget per scheduler"
    )
    compare.add_argument("--seed", type=int, default=0, metavar="S")
    compare.add_argument("--output", metavar="FILE.json", help="write the comparison rows as JSON")
    compare.add_argument(
        "--schedulers",
        metavar="NAMES",
        help="comma-separated subset (default: all registered + single:<type>)",
    )
    compare.set_defaults(func=_compare)


def _plan(args: argparse.Namespace) -> int:
    from heterps_ray.config import writable
    from heterps_ray.costmodel import load_problem
    from heterps_ray.costmodel.table_memory import check_table_fits, disk_line
    from heterps_ray.errors import ConfigError
    from heterps_ray.scheduling import get_scheduler

    if args.output:
        writable(args.output, "--output", directory=False)
    problem = load_problem(args.problem)
    check_table_fits(problem, args.problem)
    options = {}
    if args.finetune_s is not None:
        if args.scheduler != "rl":
            raise ConfigError(
                None, "--finetune-s", "--scheduler rl (only the RL policy fine-tunes)", args.scheduler
            )
        options["finetune_s"] = args.finetune_s
    scheduler = get_scheduler(args.scheduler, seed=args.seed, budget_s=args.budget_s, **options)
    plan = scheduler.schedule(problem)
    print(plan.table())
    table = problem.ps.table
    if table is not None and table.disk_rows and not plan.ps_hosted:  # the plan's ps row says "RAM + disk"
        print(disk_line(table, problem.ps_resource))
    proof = plan.extra.get("proof", {})
    if proof.get("proven") is False:
        limit = "" if args.budget_s is None else f", --budget-s {args.budget_s:g}"
        print(
            f"not proven optimal: {plan.scheduler} stopped ({proof.get('stop') or 'a solver limit'}{limit}) "
            "before its proof; this is the best plan it found"
        )
        if not plan.feasible:
            _raise_unfinished(problem, args.problem, plan, args.budget_s)
    if not plan.feasible:
        # before --output is written: a plan that fails never replaces a file already there
        # exact and rl decide infeasibility by an exhaustive search; others know only the plans they tried
        decided = plan.scheduler in ("exact", "brute", "rl")
        if decided and plan.best_throughput is None and plan.extra.get("refusal") == "bound":
            _raise_bounded(problem, args.problem, plan.throughput, plan.extra["throughput_bound"])
        _raise_infeasible(problem, args.problem, plan.best_throughput if decided else None, plan.scheduler)
    if args.output:
        print(f"plan written to {plan.save(args.output)}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    import json

    from heterps_ray.config import writable
    from heterps_ray.costmodel import load_problem
    from heterps_ray.costmodel.table_memory import check_table_fits
    from heterps_ray.scheduling import available_schedulers, get_scheduler

    if args.output:
        writable(args.output, "--output", directory=False)
    problem = load_problem(args.problem)
    check_table_fits(problem, args.problem)
    if args.schedulers:
        names = ["exact"] + [n.strip() for n in args.schedulers.split(",") if n.strip() not in ("", "exact")]
    else:
        names = ["exact"] + [n for n in available_schedulers() if n not in ("exact", "brute", "single")]
        names += [f"single:{t}" for t in problem.types_running_all_layers()]
    if problem.runtime is not None and BASE_OPTIMUM not in names:
        names.insert(1, BASE_OPTIMUM)  # what the exact optimum of the base model is worth in the runtime
    unable = [t for t in problem.type_names if t not in problem.types_running_all_layers()]
    rows: list[dict[str, Any]] = []
    exact_cost = math.nan
    for name in names:
        plan = get_scheduler(name, seed=args.seed, budget_s=args.budget_s).schedule(problem)
        if name == "exact":
            exact_cost = plan.cost if plan.feasible else math.nan
        rows.append(compare_row(problem, plan, exact_cost))
    print(_compare_table(problem, rows, unable))
    if "rl" not in names and not args.schedulers:
        print("rl: not compared (heterps_ray.scheduling.rl is not installed in this build)", file=sys.stderr)
    if args.output:
        with open(args.output, "w") as fh:
            json.dump([{k: _json_num(v) for k, v in row.items()} for row in rows], fh, indent=2)
    if not rows[0]["feasible"]:
        _raise_infeasible(problem, args.problem, None)
    return 0


def compare_row(problem: Any, plan: Any, exact_cost: float) -> dict[str, Any]:
    """One row of `heterps compare`: the plan under the problem's own model (`cost`, `throughput`, ...)
    and, for a problem with runtime terms (DESIGN.md §3b), under the base model of §3 (`base_cost`,
    `base_throughput`, `base_feasible`), with `scheduled_with` naming the model its scheduler optimised.
    `ratio_to_exact` compares `cost` with `exact_cost`, the exact optimum of the problem's own model."""
    from heterps_ray.scheduling import base_model

    row: dict[str, Any] = {
        "scheduler": plan.scheduler,
        "cost": plan.cost,
        "ratio_to_exact": plan.cost / exact_cost if plan.feasible and exact_cost > 0 else math.nan,
        "throughput": plan.throughput,
        "cost_rate": plan.cost_rate,
        "feasible": plan.feasible,
        "seconds": plan.seconds,
        "plans_evaluated": plan.plans_evaluated,
        "assignment": list(plan.assignment),
        "replicas": plan.replicas,
        "ps_shards": plan.ps_shards,
    }
    if problem.runtime is not None:
        from heterps_ray.costmodel import evaluate_plan

        true = evaluate_plan(plan, problem)
        base = evaluate_plan(plan, base_model(problem))
        row.update(
            scheduled_with="base" if plan.scheduler.startswith("base:") else "true",
            bound=true.bound,
            base_cost=base.cost,
            base_throughput=base.throughput,
            base_feasible=base.feasible,
        )
    return row


def _compare_table(problem: Any, rows: list[dict[str, Any]], unable: list[str]) -> str:
    runtime = problem.runtime is not None
    lines = [
        f"problem {problem.name!r}: floor {problem.throughput_min:,.0f} samples/s, {problem.samples:,.0f} samples"
    ]
    if runtime:
        lines.append(
            "true model: the problem's runtime section (DESIGN.md §3b); base model: without it (§3); "
            "'scheduled with' names the model each scheduler optimised"
        )
        header = (
            f"{'scheduler':<14} {'scheduled with':>14} {'cost ($)':>12} {'ratio to exact':>15} "
            f"{'throughput (samples/s)':>23} {'base cost ($)':>14} {'base throughput':>16} "
            f"{'$/h':>9} {'feasible':>9} {'bound':>8} {'seconds':>9}"
        )
    else:
        header = (
            f"{'scheduler':<14} {'cost ($)':>12} {'ratio to exact':>15} {'throughput (samples/s)':>23} "
            f"{'$/h':>9} {'feasible':>9} {'seconds':>9}"
        )
    lines += [header, "-" * len(header)]
    for r in rows:
        ratio = "-" if math.isnan(r["ratio_to_exact"]) else f"{r['ratio_to_exact']:.4f}"
        feasible = "yes" if r["feasible"] else "NO"
        if runtime:
            lines.append(
                f"{r['scheduler']:<14} {r['scheduled_with']:>14} {r['cost']:>12,.4f} {ratio:>15} "
                f"{r['throughput']:>23,.0f} {r['base_cost']:>14,.4f} {r['base_throughput']:>16,.0f} "
                f"{r['cost_rate']:>9.3f} {feasible:>9} {r['bound']:>8} {r['seconds']:>9.2f}"
            )
        else:
            lines.append(
                f"{r['scheduler']:<14} {r['cost']:>12,.4f} {ratio:>15} {r['throughput']:>23,.0f} "
                f"{r['cost_rate']:>9.3f} {feasible:>9} {r['seconds']:>9.2f}"
            )
    if unable:
        lines.append(f"(no single-type plan on {', '.join(unable)}: they cannot run every layer)")
    if runtime:
        lines.append(_cheapest_line(rows))
    return "\n".join(lines)


def _cheapest_line(rows: list[dict[str, Any]]) -> str:
    """Which schedulers' plans are cheapest under the true model, and what the base optimum is worth there."""
    from heterps_ray.costmodel.formulas import FLOOR_RTOL

    feasible = [r for r in rows if r["feasible"]]
    if not feasible:
        line = "under the true model no scheduler's plan meets the floor"
    else:
        best = min(r["cost"] for r in feasible)
        winners = [r["scheduler"] for r in feasible if r["cost"] <= best * (1.0 + FLOOR_RTOL)]
        line = f"cheapest under the true model: {', '.join(winners)} ({best:,.4f} $)"
    base = next((r for r in rows if r["scheduler"] == BASE_OPTIMUM), None)
    if base is not None:
        verdict = (
            f"{base['ratio_to_exact']:.4f} x the true optimum"
            if base["feasible"] and not math.isnan(base["ratio_to_exact"])
            else "misses the floor"
        )
        line += (
            f"; the base model's optimum ({BASE_OPTIMUM}) promises {base['base_throughput']:,.0f} samples/s "
            f"for {base['base_cost']:,.4f} $, and under the true model reaches {base['throughput']:,.0f} "
            f"samples/s for {base['cost']:,.4f} $: {verdict}"
        )
    return line


def _json_num(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _raise_bounded(problem: Any, file: str, reached: float, bound: float) -> None:
    """No plan meets the floor, proven by an upper bound on every plan's throughput (the policy's
    fast refusal, rl/scheduler.py); the highest throughput lies between a plan found and the bound."""
    from heterps_ray.errors import InfeasibleError

    raise InfeasibleError(
        f"{file}: no plan meets the floor throughput_min = {problem.throughput_min:,.0f} samples/s: no "
        f"plan reaches more than {bound:,.0f} samples/s (an upper bound), and the fastest plan found "
        f"reaches {reached:,.0f} samples/s (--scheduler exact gives the highest exactly). Possible fixes: "
        f"(1) lower throughput_min to at most {math.floor(reached):,}; (2) raise max_instances of the "
        "resource types (or ps.rows_per_second_per_shard); (3) add a faster resource type.",
        reached,
    )


def _raise_unfinished(problem: Any, file: str, plan: Any, budget_s: float | None) -> None:
    """The search stopped at its time limit before any plan met the floor: none is proven not to exist."""
    from heterps_ray.errors import InfeasibleError

    raise InfeasibleError(
        f"{file}: {plan.scheduler} found no plan that meets the floor throughput_min = "
        f"{problem.throughput_min:,.0f} samples/s within its time limit (--budget-s {budget_s:g}); that no "
        f"plan meets it is not proven (the fastest plan it found reaches {plan.throughput:,.0f} samples/s). "
        "Possible fixes: (1) a larger --budget-s, or none; (2) lower throughput_min.",
        plan.throughput,
    )


def _raise_infeasible(problem: Any, file: str, best: float | None, scheduler: str | None = None) -> None:
    from heterps_ray.costmodel.formulas import FLOOR_RTOL
    from heterps_ray.errors import InfeasibleError
    from heterps_ray.scheduling.exact import max_reachable_throughput

    if best is None:
        best = max_reachable_throughput(problem)
    if scheduler is not None and best >= problem.throughput_min * (1.0 - FLOOR_RTOL):
        fix = (
            f"drop the base: prefix ({scheduler!r} optimises the base model, without the problem's runtime "
            "section)."
            if scheduler.startswith("base:")
            else f"give {scheduler!r} a larger --budget-s."
        )
        # the scheduler missed plans that exist: say so, never "no plan meets the floor"
        raise InfeasibleError(
            f"{file}: scheduler {scheduler!r} found no plan that meets the floor throughput_min = "
            f"{problem.throughput_min:,.0f} samples/s, but such plans exist (the fastest reaches "
            f"{best:,.0f} samples/s). Possible fixes: (1) --scheduler exact (the optimum) or rl; (2) {fix}",
            best,
        )
    raise InfeasibleError(
        f"{file}: no plan meets the floor throughput_min = {problem.throughput_min:,.0f} samples/s; "
        f"the highest throughput any plan reaches is {best:,.0f} samples/s. Possible fixes: "
        f"(1) lower throughput_min to at most {math.floor(best):,}; (2) raise max_instances of the "
        f"resource types (or ps.rows_per_second_per_shard); (3) add a faster resource type.",
        best,
    )
