"""Validate the cost model against real runs: profile ctr_dnn on the local two-CPU-type cluster, then
for several plans compare the throughput predicted by the analytic model (DESIGN.md §3) and by the
pipeline simulator with the throughput the runtime measures (heterps_ray.runtime.driver.train).

    .venv/bin/python benchmarks/validate_costmodel.py                 # profile + 5 plans, ~1.5 min here
    .venv/bin/python benchmarks/validate_costmodel.py --bracket       # + a profile after the plans, ~2 min
    .venv/bin/python benchmarks/validate_costmodel.py --problem runs/validate_costmodel/problem.yaml
    .venv/bin/python benchmarks/validate_costmodel.py --profile-each   # re-profile before each plan

Writes the problem file (+ raw measurements), results.json and table.md under --output-dir and
prints the table (the "## Cost model validation" section of BENCHMARKS.md comes from it).
Each DataWorker trains on 131,072 rows (256 batches of 512: two of the 65,536-row chunks the runtime
reads and hashes input in). The measured throughput is the runtime's steady rate, after the driver's
first chunk of 20 batches (the warm-up: actors' first calls, the first data chunk read), and the
simulator predicts the same steady state (no start-up); the whole-run rate is kept beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROWS_PER_CHUNK = 1 << 16  # heterps_ray.data.dataset reads and converts 65,536 rows at a time


@dataclass(frozen=True)
class Case:
    name: str
    assignment: tuple[str, ...]
    replicas: tuple[int, ...]
    mode: str
    micro_batches: int
    ps_shards: int = 1
    batches_ahead: int = 0  # async: runtime.batches_ahead


S, B = "cpu_small", "cpu_big"
CASES = (
    Case("1 stage, sync", (S,) * 6, (1,), "sync", 1),
    Case("2 stages, sync", (S, B, B, B, B, B), (1, 1), "sync", 1),
    Case("2 stages, sync, 4 micro-batches", (S, B, B, B, B, B), (1, 1), "sync", 4),
    Case("3 stages, sync", (S, B, B, S, S, S), (1, 1, 1), "sync", 1),
    Case("3 stages, async, 2 DataWorkers", (S, B, B, S, S, S), (2, 1, 1), "async", 1),
    Case("1 stage on cpu_big, sync", (B,) * 6, (1,), "sync", 1),
    Case("4 stages, sync", (S, B, S, B, B, B), (1, 1, 1, 1), "sync", 1),
    Case("2 stages, async, 2 batches ahead", (S, B, B, B, B, B), (1, 1), "async", 1, batches_ahead=2),
    Case("2 stages, async, 2 replicas", (S, S, B, B, B, B), (1, 2), "async", 1),
    Case("1 stage, async, 2 DataWorkers", (S,) * 6, (2,), "async", 1),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=REPO / "runs" / "validate_costmodel")
    parser.add_argument(
        "--problem", type=Path, default=None, help="reuse a profiled problem (skip profiling)"
    )
    parser.add_argument(
        "--measured",
        type=Path,
        default=None,
        help="results.json of an earlier run: predict its measured runs again (with --problem, or the "
        "problem it names), without running anything",
    )
    parser.add_argument(
        "--rows", type=int, default=300_000, help="synthetic dataset rows (2 train partitions)"
    )
    parser.add_argument("--batches-per-worker", type=int, default=2 * ROWS_PER_CHUNK // 512)
    parser.add_argument("--repeat-factor", type=int, default=1, help="profile repeats multiplier")
    parser.add_argument("--cases", nargs="*", type=int, default=None, help="indices of CASES to run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every plan this many times, the plans alternating (odd rounds in reverse order); the "
        "measured figure is the median over rounds (the runtime's own rate varies run to run)",
    )
    parser.add_argument(
        "--profile-each",
        action="store_true",
        help="profile again right before each plan (a shared machine's load drifts between profile and run)",
    )
    parser.add_argument(
        "--bracket",
        action="store_true",
        help="profile again after the plans and predict them from both profiles together (the machine's "
        "speed averaged over the runs); the first profile's predictions are kept beside them",
    )
    args = parser.parse_args()
    if args.measured is not None:
        _repredict(args.measured, args.problem)
        return
    args.output_dir = (
        args.output_dir.resolve()
    )  # the job file names its data; a relative path would be read from its folder
    args.output_dir.mkdir(parents=True, exist_ok=True)

    import ray

    from heterps_ray.closedloop.probes import run_probe
    from heterps_ray.config import load_job
    from heterps_ray.data import DEFAULT_EVAL_FRACTION
    from heterps_ray.models import build_model
    from heterps_ray.profiling.fit import write_problem
    from heterps_ray.profiling.profiler import ProfileSettings, fit_runs, measure
    from heterps_ray.runtime.driver import train

    data = args.output_dir / "data"
    from heterps_ray.data.layout import is_dataset

    if not is_dataset(data):
        from heterps_ray.data.synth import synthesize

        train_rows = args.rows - int(args.rows * DEFAULT_EVAL_FRACTION)
        synthesize(data, args.rows, seed=0, rows_per_part=-(-train_rows // 2))  # one part per DataWorker
    job_file = args.output_dir / "job.yaml"
    job_file.write_text(
        f"name: validate-costmodel\nmodel: {REPO / 'configs/models/ctr_dnn.yaml'}\n"
        f"cluster: {REPO / 'configs/clusters/local.yaml'}\ndata: {{path: {data}}}\nbatch_size: 512\n"
        f"samples: 100000000\nthroughput_min: 0\noutput_dir: {args.output_dir / 'run'}\n"
    )
    job = load_job(job_file)
    ray.init(
        num_cpus=2,
        resources=job.cluster.local_resources(),
        object_store_memory=1 << 30,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    load = [os.getloadavg()[0]]

    settings = ProfileSettings().scaled(args.repeat_factor)
    spec = build_model(job.model)
    profiles: list[Any] = []

    def profiled(tag: str, runs: int = 1) -> Path:
        t0 = time.perf_counter()
        profiles.append(measure(job, spec, settings, run_probe))
        result = fit_runs(job, profiles[-runs:], settings)
        path = write_problem(result, args.output_dir / f"problem{tag}.yaml", header=result.problem["notes"])[
            "problem"
        ]
        print(
            f"profiled in {time.perf_counter() - t0:.0f} s -> {path} ({len(result.flags)} poor fits)",
            flush=True,
        )
        return path

    problem_file = args.problem or (None if args.profile_each else profiled(""))

    rows: list[dict[str, Any]] = []
    cases = [CASES[i] for i in args.cases] if args.cases is not None else list(CASES)
    order = [c for r in range(args.rounds) for c in (cases if r % 2 == 0 else cases[::-1])]
    measured: dict[str, list[dict[str, Any]]] = {}
    for index, case in enumerate(order):
        if problem_file is None or (args.profile_each and index > 0):
            problem_file = profiled(f"_{index}")
        plan = _plan(problem_file, case)
        workers = case.replicas[0]
        steps = args.batches_per_worker * workers
        case_job = load_job(
            job_file,
            {
                "mode": case.mode,
                "runtime.micro_batches": case.micro_batches,
                "runtime.batches_ahead": case.batches_ahead,
            },
        )
        load_before = os.getloadavg()[0]
        load.append(load_before)
        summary = train(case_job, plan, steps=steps, progress=False, save=False)
        row = {
            "case": case.name,
            "assignment": list(case.assignment),
            "replicas": list(case.replicas),
            "ps_shards": case.ps_shards,
            "mode": case.mode,
            "micro_batches": case.micro_batches,
            "batches_ahead": case.batches_ahead,
            "max_in_flight": case_job.runtime.max_in_flight,
            "batches": steps,
            "measured": summary.steady_throughput or summary.throughput,
            "measured_whole_run": summary.throughput,
            "measured_busy": [s["busy"] for s in summary.stages],
            "chunks": summary.extra.get("chunks"),
            "data_wait_s": summary.extra.get("data_wait_s"),
            "load_average": [load_before, os.getloadavg()[0]],
            "problem": str(problem_file),
        }
        row.update(_predict(problem_file, row))
        measured.setdefault(case.name, []).append(row)
        _print_row(row)
    for case in cases:  # the median round of each plan, with every round's rate beside it
        runs = sorted(measured[case.name], key=lambda r: r["measured"])
        row = dict(runs[(len(runs) - 1) // 2]) if len(runs) % 2 else dict(runs[len(runs) // 2 - 1])
        row["measured"] = statistics.median(r["measured"] for r in runs)
        row["measured_rounds"] = [r["measured"] for r in measured[case.name]]
        row.update(_predict(Path(row["problem"]), row))
        rows.append(row)
    if args.bracket and args.problem is None and not args.profile_each:
        problem_file = profiled("_bracketed", runs=2)
        for row in rows:
            row["simulator_first_profile"] = row["simulator"]
            row.update(_predict(problem_file, row), problem=str(problem_file))
    ray.shutdown()
    load.append(os.getloadavg()[0])
    _write(args.output_dir, rows, str(problem_file), load)
    print(f"1-min load average during the runs: {min(load):.1f}..{max(load):.1f} on {os.cpu_count()} CPUs")


def _plan(problem_file: Path, case: Any) -> Any:
    """The plan of a case, priced by the analytic model of the problem."""
    from heterps_ray.costmodel import CostModel, Plan, load_problem

    problem = _executed(load_problem(problem_file), case)
    evaluation = CostModel(problem).evaluate(list(case.assignment), list(case.replicas), case.ps_shards)
    return Plan.from_evaluation(problem, evaluation, "validation")


def _executed(problem: Any, case: Any) -> Any:
    """The problem as the case's job runs it (its runtime section's execution fields)."""
    from heterps_ray.costmodel import as_executed

    return as_executed(
        problem, mode=case.mode, micro_batches=case.micro_batches, batches_ahead=case.batches_ahead
    )


def _predict(problem_file: Path, row: dict[str, Any]) -> dict[str, Any]:
    """Analytic and simulated throughput of a measured run (a row of results.json) on a problem file."""
    from heterps_ray.costmodel import CostModel, load_problem
    from heterps_ray.costmodel.simulator import simulate
    from heterps_ray.runtime.loop import CHUNK_STEPS

    problem = load_problem(problem_file)
    case = Case(row["case"], tuple(row["assignment"]), tuple(row["replicas"]), row["mode"], row["micro_batches"],
                row["ps_shards"], row.get("batches_ahead", 0))  # fmt: skip
    evaluation = CostModel(_executed(problem, case)).evaluate(
        list(case.assignment), list(case.replicas), case.ps_shards
    )
    plan = _plan(problem_file, case)
    sim = simulate(
        problem,
        plan,
        batches=row["batches"],
        micro_batches=case.micro_batches,
        mode=case.mode,  # type: ignore[arg-type]
        max_in_flight=row["max_in_flight"],
        drain_every=CHUNK_STEPS,  # the driver runs DataWorkers in chunks, draining between
        startup_ms=0.0,  # the steady state: the measured rate leaves the warm-up chunk out
    )
    measured = row["measured"]
    base = CostModel(problem.model_copy(update={"runtime": None})).evaluate(
        list(case.assignment), list(case.replicas), case.ps_shards
    )
    return {
        "stages": " → ".join(f"{_span(s.layers)} on {s.type} ×{s.replicas}" for s in plan.stages),
        "base_model": base.throughput,
        "bound": evaluation.bound,
        "analytic": evaluation.throughput,
        "simulator": sim.throughput,
        "analytic_error": evaluation.throughput / measured - 1.0,
        "simulator_error": sim.throughput / measured - 1.0,
        "simulated_busy": sim.utilisation,
        "host_sharing": problem.hosts is not None,
    }


def _repredict(measured: Path, problem: Path | None) -> None:
    """Predict the runs saved in `measured` again (the model changed, or another problem file)."""
    saved = json.loads(measured.read_text())
    problem_file = problem or Path(saved["problem"])
    if not problem_file.is_absolute() and not problem_file.exists():
        problem_file = measured.parent / problem_file
    rows = []
    from heterps_ray.runtime.loop import steady_rate

    for row in saved["rows"]:
        if "measured_whole_run" not in row:  # saved before the steady rate: derive it from the chunks
            row = {**row, "measured_whole_run": row["measured"]}
            row["measured"] = steady_rate([tuple(c) for c in row.get("chunks") or []]) or row["measured"]
        row = {**row, **_predict(problem_file, row), "problem": str(problem_file)}
        rows.append(row)
        _print_row(row)
    print()
    print(_markdown(rows))


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"{row['case']:<34} measured {row['measured']:8,.0f}  model {row['analytic']:8,.0f} "
        f"({row['analytic_error']:+.0%}, {row['bound']})  base {row['base_model']:8,.0f}  simulator {row['simulator']:8,.0f} ({row['simulator_error']:+.0%})  "
        f"busy measured {_pct(row['measured_busy'])} simulated {_pct(row['simulated_busy'])}",
        flush=True,
    )


def _write(output_dir: Path, rows: list[dict[str, Any]], problem_file: str, load: list[float]) -> None:
    table = _markdown(rows)
    (output_dir / "results.json").write_text(
        json.dumps({"problem": problem_file, "load_average": load, "rows": rows}, indent=2)
    )
    (output_dir / "table.md").write_text(table)
    print()
    print(table)


def _spread(rounds: list[float] | None) -> str:
    """The rounds' lowest and highest rate, in thousands."""
    if not rounds or len(rounds) < 2:
        return "–"
    return f"{min(rounds) / 1000:.1f}k–{max(rounds) / 1000:.1f}k"


def _span(layers: tuple[str, ...]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"


def _pct(values: list[float]) -> str:
    return "/".join(f"{v:.0%}" for v in values)


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| plan | mode | K | ahead | load | measured, steady (samples/s) | rounds | model | error | bound | base model | error | simulator | error |",
        "|---|---|---|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        load = r["load_average"]
        load_text = "–".join(f"{x:.1f}" for x in load) if isinstance(load, list) else f"{load:.1f}"
        lines.append(
            f"| {r['stages']} | {r['mode']} | {r['micro_batches']} | {r.get('batches_ahead', 0)} | {load_text} | "
            f"{r['measured']:,.0f} | {_spread(r.get('measured_rounds'))} | {r['analytic']:,.0f} | "
            f"{r['analytic_error']:+.0%} | {r['bound']} | "
            f"{r['base_model']:,.0f} | {r['base_model'] / r['measured'] - 1:+.0%} | "
            f"{r['simulator']:,.0f} | {r['simulator_error']:+.0%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
