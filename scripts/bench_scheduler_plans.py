"""Benchmark: which scheduler's plan wins for real. For a profiled problem (with the `runtime` section
`heterps profile` writes, DESIGN.md §3b) at one throughput floor, take the plan of each scheduler
(exact, rl, genetic, greedy, random, single, and base:exact, the exact optimum of the base model of §3),
run each distinct plan on the local cluster with heterps_ray.runtime.driver.train, alternating the
plans over `--rounds` rounds, and compare the achieved throughput (median over rounds) with what the
true model (the runtime terms) and the base model predicted, and with the floor.

    ../shared/bench/quiet.sh && .venv/bin/python scripts/bench_scheduler_plans.py --floor-fraction 0.5
    .venv/bin/python scripts/bench_scheduler_plans.py --problem runs/quickstart/problem.yaml --floor 20000
    .venv/bin/python scripts/bench_scheduler_plans.py --steps 40 --rounds 1 --output /tmp/plans.json  # smoke

Without --problem it profiles the job first (`heterps profile`, into --work-dir). The runs execute as
the problem's runtime section says (mode, micro-batches, batches ahead, in-flight window, PS hosting),
so the model prices the plans as they run. Each run trains `--steps` batches per DataWorker after the
driver's warm-up chunk; the achieved rate is the run's steady rate (RunSummary.steady_throughput; the
whole-run rate where a run has under 3 chunks). A floor counts as met when achieved >= 0.9 x floor
(issue 14). Writes `--output` (default benchmarks/scheduler_plans.json) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCHEDULERS = ("exact", "rl", "genetic", "greedy", "random", "single", "base:exact")
FLOOR_MET = 0.9  # achieved >= 0.9 x floor (issue 14, "Done when")
EPOCHS = 20  # passes over the data a run may make (--steps ends each run first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, default=REPO / "configs" / "jobs" / "quickstart.yaml")
    parser.add_argument(
        "--problem",
        type=Path,
        default=None,
        help="profiled problem with a runtime section (default: profile)",
    )
    floor = parser.add_mutually_exclusive_group()
    floor.add_argument("--floor", type=float, default=None, help="throughput floor, samples/s")
    floor.add_argument(
        "--floor-fraction",
        type=float,
        default=0.5,
        help="floor as a fraction of the highest throughput any plan reaches (true model; default 0.5)",
    )
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS), help="comma-separated, in order")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget per scheduler")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200, help="batches per DataWorker in each run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all plans (alternating order)")
    parser.add_argument("--quick-profile", action="store_true", help="a rough profile (smoke runs only)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench_scheduler_plans")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "scheduler_plans.json")
    parser.add_argument("--address", default=None, help="Ray address (default: an embedded local Ray)")
    args = parser.parse_args()
    from heterps_ray.errors import ConfigError

    if args.steps < 1 or args.rounds < 1:
        raise ConfigError(None, "--steps", "positive --steps and --rounds", (args.steps, args.rounds))
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)

    import ray

    from heterps_ray.cluster import connect
    from heterps_ray.config import load_job
    from heterps_ray.data.dataset import prepare_dataset

    job = load_job(args.job, {"output_dir": str(work / "run")})
    owns_ray = connect(job.cluster, args.address)
    load = [os.getloadavg()[0]]
    try:
        prepare_dataset(job.data, seed=job.seed)
        problem_file = args.problem or _profile(job, work / "problem.yaml", args.quick_profile)
        problem = _problem(problem_file, job, args)
        job = _executed_job(args.job, problem, work)
        plans = _schedule(problem, [s.strip() for s in args.schedulers.split(",") if s.strip()], args)
        runs = _run_plans(job, plans, args, load)
    finally:
        if owns_ray:
            ray.shutdown()
    load.append(os.getloadavg()[0])
    rows = _rows(problem, plans, runs)
    print()
    print(_table(problem, rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "command": "scripts/bench_scheduler_plans.py " + " ".join(sys.argv[1:]),
                "problem": str(problem_file),
                "throughput_min": problem.throughput_min,
                "runtime": problem.runtime.model_dump() if problem.runtime else None,
                "steps_per_data_worker": args.steps,
                "rounds": args.rounds,
                "cpus": os.cpu_count(),
                "load_average": load,
                "rows": rows,
                "runs": runs,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.output}")


def _profile(job: Any, path: Path, quick: bool) -> Path:
    """`heterps profile JOB -o path` (the problem file, its runtime section included)."""
    from heterps_ray.closedloop.probes import profile_job
    from heterps_ray.profiling.fit import write_problem
    from heterps_ray.profiling.profiler import ProfileSettings

    t0 = time.perf_counter()
    settings = ProfileSettings.quick(progress=False) if quick else ProfileSettings(progress=False)
    result = profile_job(job, settings)
    written = write_problem(result, path, header=str(result.problem.get("notes", "")))["problem"]
    print(
        f"profiled in {time.perf_counter() - t0:.0f} s -> {written} ({len(result.flags)} poor fits)",
        flush=True,
    )
    return Path(written)


def _problem(path: Path, job: Any, args: argparse.Namespace) -> Any:
    """The profiled problem at the benchmark's floor; it must describe the runtime (a runtime section)."""
    from heterps_ray.costmodel import load_problem
    from heterps_ray.errors import ConfigError
    from heterps_ray.experiments import with_floor
    from heterps_ray.models import build_model
    from heterps_ray.scheduling.exact import max_reachable_throughput

    problem = load_problem(path)
    if problem.runtime is None:
        raise ConfigError(
            str(path), "runtime", "a runtime section (DESIGN.md §3b; `heterps profile` writes it)", None
        )
    layers = [layer.name for layer in build_model(job.model).layers]
    if problem.layer_names != layers:
        raise ConfigError(str(path), "layers", f"the layers of the job's model {layers}", problem.layer_names)
    types = {t.name for t in job.cluster.resource_types}
    if not set(problem.type_names) <= types:
        raise ConfigError(
            str(path), "resources", f"resource types of cluster {job.cluster.name!r}", problem.type_names
        )
    if problem.batch_size != job.batch_size:
        raise ConfigError(
            str(path), "batch_size", f"the job's batch_size ({job.batch_size})", problem.batch_size
        )
    if args.floor is not None:
        return with_floor(problem, args.floor)
    if not 0.0 < args.floor_fraction <= 1.5:
        raise ConfigError(None, "--floor-fraction", "a fraction in (0, 1.5]", args.floor_fraction)
    return with_floor(problem, args.floor_fraction * max_reachable_throughput(problem))


def _executed_job(job_file: Path, problem: Any, work: Path) -> Any:
    """The job, run as the problem's runtime section says (so the model prices what runs)."""
    from heterps_ray.config import load_job

    terms = problem.runtime
    return load_job(
        job_file,
        {
            "output_dir": str(work / "run"),
            "mode": terms.mode,
            "runtime.micro_batches": terms.micro_batches,
            "runtime.max_in_flight": terms.max_in_flight,
            "runtime.batches_ahead": terms.batches_ahead,
            "runtime.ps_hosting": terms.ps_hosting,
            "runtime.epochs": EPOCHS,
        },
    )


def _schedule(problem: Any, names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each scheduler's plan, priced by the true and the base model; plans are keyed by what runs."""
    from heterps_ray.costmodel import evaluate_plan
    from heterps_ray.errors import HeterPSError
    from heterps_ray.scheduling import base_model, get_scheduler

    base = base_model(problem)
    plans = []
    for name in names:
        try:
            plan = get_scheduler(name, seed=args.seed, budget_s=args.budget_s).schedule(problem)
        except HeterPSError as exc:  # e.g. single where no type runs every layer
            print(f"{name}: no plan ({exc})", flush=True)
            continue
        predicted_base = evaluate_plan(plan, base)
        plans.append(
            {
                "scheduler": name,
                "plan": plan,
                "key": _key(plan),
                "cost": plan.cost,
                "feasible": plan.feasible,
                "predicted": plan.throughput,
                "predicted_base": predicted_base.throughput,
                "bound": evaluate_plan(plan, problem).bound,
                "scheduler_seconds": plan.seconds,
            }
        )
        print(
            f"{name:<12} {_key(plan)}  true {plan.throughput:,.0f}  base {predicted_base.throughput:,.0f} samples/s",
            flush=True,
        )
    return plans


def _key(plan: Any) -> str:
    """A plan as it runs: stages (layers, type, replicas) and PS shards."""
    stages = " | ".join(f"{s.layers[0]}..{s.layers[-1]}@{s.type}x{s.replicas}" for s in plan.stages)
    return f"{stages} | ps x{plan.ps_shards}"


def _run_plans(
    job: Any, plans: list[dict[str, Any]], args: argparse.Namespace, load: list[float]
) -> dict[str, list[dict[str, Any]]]:
    """Every distinct plan `--rounds` times, the order reversed every other round."""
    from heterps_ray.runtime.driver import train
    from heterps_ray.runtime.loop import CHUNK_STEPS

    distinct = {p["key"]: p["plan"] for p in plans}
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in distinct}
    for round_index in range(args.rounds):
        order = list(distinct) if round_index % 2 == 0 else list(reversed(distinct))
        for key in order:
            plan = distinct[key]
            workers = plan.stages[0].replicas  # DataWorkers
            load_before = os.getloadavg()[0]
            load.append(load_before)
            print(f"--- round {round_index + 1}: {key} (load average {load_before:.2f})", flush=True)
            asked = (CHUNK_STEPS + args.steps) * workers  # the warm-up chunk, then the measured batches
            summary = train(job, plan, steps=asked, progress=False, save=False)
            if summary.steps < asked:
                print(f"warning: {summary.steps} of {asked} batches: the job's dataset ran out", flush=True)
            steady = summary.steady_throughput
            runs[key].append(
                {
                    "achieved": steady if steady is not None else summary.throughput,
                    "steady": steady is not None,
                    "whole_run": summary.throughput,
                    "batches": summary.steps,
                    "seconds": summary.seconds,
                    "load_average": [load_before, os.getloadavg()[0]],
                }
            )
            print(json.dumps(runs[key][-1]), flush=True)
    return runs


def _rows(
    problem: Any, plans: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    floor = problem.throughput_min
    rows = []
    for p in plans:
        achieved = statistics.median(r["achieved"] for r in runs[p["key"]])
        rows.append(
            {
                "scheduler": p["scheduler"],
                "plan": p["key"],
                "assignment": list(p["plan"].assignment),
                "replicas": p["plan"].replicas,
                "ps_shards": p["plan"].ps_shards,
                "cost": p["cost"],
                "feasible": p["feasible"],
                "bound": p["bound"],
                "predicted": p["predicted"],
                "predicted_base": p["predicted_base"],
                "achieved": achieved,
                "error": p["predicted"] / achieved - 1.0,
                "base_error": p["predicted_base"] / achieved - 1.0,
                "floor_met": achieved >= FLOOR_MET * floor,
                "scheduler_seconds": p["scheduler_seconds"],
            }
        )
    return rows


def _table(problem: Any, rows: list[dict[str, Any]]) -> str:
    floor = problem.throughput_min
    lines = [
        f"problem {problem.name!r}: floor {floor:,.0f} samples/s ({problem.runtime.mode}, "
        f"{problem.runtime.micro_batches} micro-batches); met = achieved >= {FLOOR_MET:g} x floor; "
        "error = predicted (true model) / achieved - 1"
    ]
    width = max(len(r["plan"]) for r in rows) if rows else 4
    header = (
        f"{'scheduler':<11} {'plan':<{width}} {'cost ($)':>10} {'true (samples/s)':>17} {'base (samples/s)':>17} "
        f"{'achieved':>9} {'error':>7} {'base error':>11} {'met':>4}"
    )
    lines += [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['scheduler']:<11} {r['plan']:<{width}} {r['cost']:>10,.4f} {r['predicted']:>17,.0f} "
            f"{r['predicted_base']:>17,.0f} {r['achieved']:>9,.0f} {r['error']:>+7.0%} {r['base_error']:>+11.0%} "
            f"{'yes' if r['floor_met'] else 'NO':>4}"
        )
    met = [r for r in rows if r["floor_met"]]
    if met:
        cheapest = min(r["cost"] for r in met)
        winners = [r["scheduler"] for r in met if r["cost"] <= cheapest * (1.0 + 1e-9)]
        lines.append(
            f"cheapest plan that met the floor for real: {', '.join(winners)} ({cheapest:,.4f} $ under the true model)"
        )
    else:
        lines.append("no plan met the floor for real")
    return "\n".join(lines)


if __name__ == "__main__":
    from heterps_ray.errors import ConfigError

    try:
        main()
    except ConfigError as exc:  # bad input: the file, the field and what was expected
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
