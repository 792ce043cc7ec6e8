"""Benchmark every scheduler against the exact optimum on generated problems.

For each scheduler: cost ratio to exact (median, worst), feasibility rate (on problems where a
feasible plan exists), seconds. And the best heterogeneous plan (exact) against the best
single-type plan: cost at the same floor, and the highest throughput each reaches.

    python benchmarks/bench_schedulers.py --problems 24 --markdown BENCHMARKS.md
    python benchmarks/bench_schedulers.py --schedulers exact,greedy,genetic,random,single,rl --rl-budget-s 60

Results: a markdown section on stdout (and, with --markdown, in place of the file's
"## Schedulers" section) and every row as JSON (--output).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from heterps_ray.costmodel import CostModel
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling import available_schedulers, get_scheduler, provision_counts
from heterps_ray.scheduling.exact import max_reachable_throughput
from heterps_ray.scheduling.generator import generate_problem

SECTION = "## Schedulers"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=24, help="generated problems (seeds seed..seed+n-1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, nargs=2, default=(3, 16), metavar=("LO", "HI"))
    parser.add_argument("--types", type=int, nargs=2, default=(2, 5), metavar=("LO", "HI"))
    parser.add_argument("--schedulers", default=None, help="comma-separated (default: every registered one)")
    parser.add_argument("--budget-s", type=float, default=None, help="budget_s for every scheduler but rl")
    parser.add_argument("--rl-budget-s", type=float, default=60.0, help="budget_s of the rl scheduler")
    parser.add_argument("--output", default="benchmarks/bench_schedulers/schedulers.json", help="rows as JSON")
    parser.add_argument(
        "--markdown", default=None, metavar="FILE", help="replace its '## Schedulers' section"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_schedulers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.schedulers:
        names = [n.strip() for n in args.schedulers.split(",") if n.strip()]
    else:
        names = [n for n in available_schedulers() if n != "brute"]
    names = ["exact"] + [n for n in names if n != "exact"]
    rows: list[dict[str, Any]] = []
    problems: list[dict[str, Any]] = []
    for i in range(args.problems):
        seed = args.seed + i
        problem = generate_problem(seed, num_layers=tuple(args.layers), num_types=tuple(args.types))
        model = CostModel(problem)
        info = {
            "seed": seed,
            "layers": problem.num_layers,
            "types": problem.num_types,
            "floor": problem.throughput_min,
        }
        info["max_throughput"] = max_reachable_throughput(problem)
        singles = [problem.type_index(t) for t in problem.types_running_all_layers()]
        single_counts = [provision_counts(model, (t,) * problem.num_layers) for t in singles]
        info["single_max_throughput"] = max((c.max_throughput for c in single_counts), default=0.0)
        feasible_singles = [c.cost for c in single_counts if c.feasible]
        info["single_cost"] = min(feasible_singles) if feasible_singles else math.inf
        exact_cost = math.nan
        for name in names:
            budget = args.rl_budget_s if name == "rl" else args.budget_s
            started = time.perf_counter()
            try:
                plan = get_scheduler(name, seed=seed, budget_s=budget).schedule(problem)
            except ConfigError:  # "single" where no type can run every layer: no plan at all
                if name != "single" or singles:
                    raise
                rows.append(_no_plan(seed, name, time.perf_counter() - started))
                continue
            wall = time.perf_counter() - started
            if name == "exact":
                exact_cost = plan.cost if plan.feasible else math.nan
                info["exact_feasible"] = plan.feasible
                info["exact_cost"] = plan.cost if plan.feasible else math.inf
                info["exact_stages"] = len(plan.stages)
            rows.append(
                {
                    "seed": seed,
                    "scheduler": name,
                    "feasible": plan.feasible,
                    "cost": plan.cost,
                    "ratio": plan.cost / exact_cost if plan.feasible and exact_cost > 0 else math.nan,
                    "throughput": plan.throughput,
                    "seconds": wall,
                    "plans_evaluated": plan.plans_evaluated,
                }
            )
            print(
                f"problem {seed:>3} ({problem.num_layers:>2} layers, {problem.num_types} types) {name:<8} "
                f"{'ok ' if plan.feasible else 'INF'} cost {plan.cost:>10.4f} in {wall:6.2f} s",
                file=sys.stderr,
            )
        problems.append(info)

    section = render(names, rows, problems, command)
    print(section)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(
            json.dumps({"problems": problems, "rows": rows}, indent=1, default=_json) + "\n"
        )
    if args.markdown:
        replace_section(Path(args.markdown), section)
    return 0


def _no_plan(seed: int, name: str, seconds: float) -> dict[str, Any]:
    return {
        "seed": seed,
        "scheduler": name,
        "feasible": False,
        "cost": math.inf,
        "ratio": math.nan,
        "throughput": 0.0,
        "seconds": seconds,
        "plans_evaluated": 0,
    }


def render(names: list[str], rows: list[dict], problems: list[dict], command: str) -> str:
    feasible_seeds = {p["seed"] for p in problems if p["exact_feasible"]}
    n, nf = len(problems), len(feasible_seeds)
    lines = [
        SECTION,
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, shared 2-core box (load average "
        f"{os.getloadavg()[1]:.0f} at the end); seconds are wall time and noisy. {n} generated problems ({min(p['layers'] for p in problems)}–"
        f"{max(p['layers'] for p in problems)} layers, {min(p['types'] for p in problems)}–"
        f"{max(p['types'] for p in problems)} resource types); {nf} have a feasible plan, {n - nf} do not.",
        "",
        "Cost ratio = scheduler's total $ / exact optimum's total $, over the problems with a feasible plan "
        "(a scheduler that finds no feasible plan where one exists counts as ∞ in the worst case). "
        "Feasible = share of those problems where the scheduler's plan meets the floor.",
        "",
        "| scheduler | median ratio | worst ratio | feasible | median s | max s | plans evaluated (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        mine = [r for r in rows if r["scheduler"] == name]
        ratios = [r["ratio"] if r["feasible"] else math.inf for r in mine if r["seed"] in feasible_seeds]
        ok = sum(r["feasible"] for r in mine if r["seed"] in feasible_seeds)
        secs = [r["seconds"] for r in mine]
        evaluated = statistics.median(r["plans_evaluated"] for r in mine)
        lines.append(
            f"| {name} | {_ratio(statistics.median(ratios)) if ratios else '-'} | {_ratio(max(ratios)) if ratios else '-'} "
            f"| {ok}/{nf} | {statistics.median(secs):.2f} | {max(secs):.2f} | {evaluated:,.0f} |"
        )
    lines += [
        "",
        "Plans evaluated: assignments provisioned (exact: throughput levels solved, or assignments when it "
        "brute-forces a small problem). Per-problem rows: `benchmarks/bench_schedulers/schedulers.json`.",
    ]
    if "rl" not in names:
        lines.append(
            "`rl` is not in this run; add it with `--schedulers exact,greedy,genetic,random,single,rl "
            "--rl-budget-s 60`."
        )
    # heterogeneous (exact) vs the best single-type plan
    both = [p for p in problems if p["exact_feasible"] and math.isfinite(p["single_cost"])]
    only_hetero = [p for p in problems if p["exact_feasible"] and not math.isfinite(p["single_cost"])]
    savings = [1.0 - p["exact_cost"] / p["single_cost"] for p in both]
    speed = [
        p["max_throughput"] / p["single_max_throughput"] for p in problems if p["single_max_throughput"] > 0
    ]
    no_single = sum(p["single_max_throughput"] == 0 for p in problems)
    lines += [
        "",
        "Best heterogeneous plan (exact) against the best single-type plan (each type that can run every "
        "layer, provisioned exactly):",
        "",
        f"- cost at the same floor: on {len(both)} problem(s) where both meet it, the heterogeneous plan costs "
        f"{_pct(statistics.median(savings))} less (median; range {_pct(min(savings))} … {_pct(max(savings))}); "
        f"it is cheaper on {sum(s > 1e-9 for s in savings)} of them and equal (a single type is optimal) on "
        f"{sum(abs(s) <= 1e-9 for s in savings)}. On {len(only_hetero)} more problem(s) only a heterogeneous plan "
        "meets the floor."
        if both
        else "- no problem where both meet the floor",
        f"- highest reachable throughput: heterogeneous / best single type = {statistics.median(speed):.2f}× "
        f"(median; range {min(speed):.2f}× … {max(speed):.2f}×)"
        + (f"; on {no_single} problem(s) no single type can run every layer." if no_single else ".")
        if speed
        else "- no problem with a single-type plan",
    ]
    return "\n".join(lines) + "\n"


def replace_section(path: Path, section: str) -> None:
    """Put `section` in place of the file's '## Schedulers' section (up to the next '## '), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    path.write_text(text)


def _ratio(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.4f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _json(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x))


if __name__ == "__main__":
    sys.exit(main())
