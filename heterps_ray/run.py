"""`heterps run JOB.yaml`: the whole system end to end on one Ray cluster.

profile the job's model on every resource type the cluster has -> fit a problem file ->
plan with the job's scheduler -> train the plan as a pipeline of actors -> report predicted
against achieved throughput, $/hour, the projected total cost and the model's AUC / logloss.

Everything a run produces lands in the job's output_dir::

    problem.yaml (+ .measurements.parquet, .fit.csv)                  the fitted cost model
    plan.json                                                          the schedule
    run_summary.json, model/                                           the training run
    run_report.json                                                    the comparison below
    plan-replan-N.json                                                 plans made when resources changed
    problem-replan-N.yaml                                              what each re-plan planned on
    problem-refit-N.yaml, plan-floor-N.json                            the closed loop's refits and plans

Elastic: when the Ray cluster's resource types change mid-run (a node with a type leaves or joins),
training stops at a checkpoint, the problem is restricted to the types present now (their profiles
are kept; a type that joins and was not profiled at the start is profiled then, runtime/elastic.py),
the job's scheduler re-plans, and training resumes from the checkpoint with the new plan.
Each re-plan is printed and listed under "replans" in run_report.json.

Closed loop: the throughput floor is kept, not only promised. After the warm-up the driver compares
the steady throughput with the job's throughput_min (runtime/driver.py FLOOR_WINDOW_S); when it is
more than 10% short, training stops at a checkpoint, the model is refit on the measurement
(costmodel/calibrate.py), the job's scheduler re-plans on the refit model and training resumes from
the checkpoint with the new plan, at most _FLOOR_ATTEMPTS times, each listed under "floor_attempts"
in run_report.json. When no plan meets the floor under the refit model, or the attempts run out, the
run stops with exit 3 naming the highest throughput measured (run_report.json is still written).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from heterps_ray.config import JobConfig
from heterps_ray.errors import ConfigError, InfeasibleError

REPORT_FILE = "run_report.json"
_MAX_REPLANS = 5  # resource changes one run follows before it gives up
_FLOOR_ATTEMPTS = 3  # re-plans after a missed floor before the run gives up (exit 3)


@dataclass
class RunReport:
    """Predicted (cost model) against achieved (runtime) for one end-to-end run."""

    job: str
    scheduler: str
    plan: str  # one line: stages as layers@type x replicas
    predicted_throughput: float  # samples/s, from the fitted cost model (DESIGN.md §3, what plans optimise)
    simulated_throughput: float  # samples/s, the pipeline simulator's steady state of the plan as run
    achieved_throughput: float  # samples/s, measured by the runtime (after its warm-up chunk)
    cost_rate: float  # $/hour of the plan's actors
    projected_cost: float  # $ to train job.samples at the achieved throughput
    predicted_cost: float  # $ to train job.samples at the predicted throughput
    auc: float | None
    logloss: float | None
    seconds: dict[str, float]  # wall time of each phase
    output_dir: str
    throughput_min: float = 0.0  # samples/s, the job's floor
    # achieved >= 90% of the floor (runtime/driver.py FLOOR_SHORTFALL); None: a run too short to
    # measure it (under FLOOR_WINDOW_S of steady chunks after the warm-up one)
    floor_met: bool | None = None
    replans: list[dict[str, Any]] = field(default_factory=list)  # resource changes and the new plans
    floor_attempts: list[dict[str, Any]] = field(default_factory=list)  # missed floors and the re-plans

    def table(self) -> str:
        err = (
            self.achieved_throughput / self.predicted_throughput - 1
            if self.predicted_throughput
            else float("nan")
        )
        sim_err = (
            self.simulated_throughput / self.achieved_throughput - 1
            if self.achieved_throughput
            else float("nan")
        )
        lines = [
            f"run {self.job!r}: scheduler {self.scheduler}, plan {self.plan}",
            f"  throughput  predicted {self.predicted_throughput:>12,.0f} samples/s  (analytic model)",
            f"              simulated {self.simulated_throughput:>12,.0f} samples/s  ({sim_err:+.1%} of achieved)",
            f"              achieved  {self.achieved_throughput:>12,.0f} samples/s  ({err:+.1%} of predicted)",
            f"  cost rate   {self.cost_rate:>12.3f} $/h",
            f"  total cost  {self.projected_cost:>12.4f} $ projected at the achieved throughput "
            f"(predicted {self.predicted_cost:.4f} $)",
        ]
        met = {
            True: "met (achieved >= 90% of it)",
            False: "missed (achieved < 90% of it)",
            None: "not measured (too short a run for a steady rate)",
        }[self.floor_met]
        if self.floor_attempts:
            replans = sum(a["new_plan"] is not None for a in self.floor_attempts)
            met += f"; {len(self.floor_attempts)} miss(es), {replans} re-plan(s)"
        lines.append(f"  floor       {self.throughput_min:>12,.0f} samples/s  {met}")
        if self.auc is not None:
            lines.append(f"  model       AUC {self.auc:.4f}, logloss {self.logloss:.4f}")
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items())
        lines.append(f"  time        {phases}")
        return "\n".join(lines)


def run_job(
    job: JobConfig,
    *,
    address: str | None = None,
    overwrite: bool = False,
    steps: int | None = None,
    budget_s: float | None = None,
    progress: bool = True,
    quick_profile: bool = False,
    problem_file: str | Path | None = None,
) -> RunReport:
    """Profile, fit, plan and train `job`; returns the report (also saved as run_report.json).

    `problem_file`: plan on this problem (say, the problem.yaml of an earlier run's profile of the
    same model and cluster) instead of profiling; the job's floor, batch size and samples apply.
    InfeasibleError (exit 3) when no plan meets the floor, at plan time or in the closed loop."""
    import ray

    from heterps_ray.cluster import connect
    from heterps_ray.costmodel import load_problem, one_replica_per_stage
    from heterps_ray.costmodel.calibrate import predicted_throughput, refit
    from heterps_ray.data.dataset import prepare_dataset
    from heterps_ray.profiling.fit import write_problem
    from heterps_ray.profiling.profiler import ProfileSettings, profile
    from heterps_ray.runtime.checkpoint import CHECKPOINTS_DIR, MODEL_DIR
    from heterps_ray.runtime.driver import FLOOR_SHORTFALL, FLOOR_WINDOW_S, SUMMARY_FILE, FloorMissed, train
    from heterps_ray.runtime.elastic import ResourcesChanged, profile_joined_types, restrict_problem
    from heterps_ray.scheduling import get_scheduler

    out = Path(job.output_dir)
    # Refused before profiling writes problem.yaml / plan.json: a `heterps train` run counts too.
    previous = [
        name for name in (REPORT_FILE, SUMMARY_FILE, MODEL_DIR, CHECKPOINTS_DIR) if (out / name).exists()
    ]
    if previous and not overwrite:
        raise ConfigError(
            None,
            "output_dir",
            f"a directory without a previous run (found {previous[0]}); pass --overwrite",
            str(out),
        )
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    owns_ray = connect(job.cluster, address, all_types=False)  # elastic: types may join later
    try:
        t0 = time.perf_counter()
        prepare_dataset(job.data, seed=job.seed)
        seconds["data"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        # the same settings for the first profile and for a type that joins mid-run
        settings = (
            ProfileSettings.quick(progress=progress) if quick_profile else ProfileSettings(progress=progress)
        )
        if problem_file is not None:
            problem = _given_problem(Path(problem_file), job, out / "problem.yaml")
        else:
            fit = profile(job, settings)
            problem_path = write_problem(fit, out / "problem.yaml")["problem"]
            problem = load_problem(problem_path)
            if fit.flags:
                print(
                    f"profile: {len(fit.flags)} poor fits (see {problem_path.with_suffix('.fit.csv').name})"
                )
        if job.mode == "sync":
            problem = one_replica_per_stage(problem)
        seconds["profile"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {"seed": job.seed}
        if budget_s is not None:
            kwargs["budget_s"] = budget_s
        scheduler = get_scheduler(job.scheduler, **kwargs)
        plan = _feasible(scheduler.schedule(problem), problem, job)
        seconds["plan"] = time.perf_counter() - t0
        plan_file = out / "plan.json"
        plan.save(plan_file)
        print(plan.table())

        t0 = time.perf_counter()
        replans: list[dict[str, Any]] = []
        attempts: list[dict[str, Any]] = []  # the closed loop's missed floors and re-plans
        measured: list[float] = []  # steady throughputs measured (samples/s), for the exit-3 message
        gave_up: InfeasibleError | None = None
        summary = None
        resume = False
        while True:
            try:
                summary = train(
                    job,
                    plan,
                    steps=steps,
                    progress=progress,
                    overwrite=overwrite or bool(replans) or bool(attempts),
                    plan_file=str(plan_file),
                    resume=resume,
                    elastic=True,
                    floor=job.throughput_min or None,
                )
                break
            except FloorMissed as miss:
                measured.append(miss.achieved)
                attempt: dict[str, Any] = {
                    "time": datetime.now(UTC).isoformat(timespec="seconds"),
                    "step": miss.step,
                    "checkpoint": str(miss.checkpoint) if miss.checkpoint else None,
                    "old_plan": _plan_line(plan),
                    "predicted": plan.throughput,
                    "measured": miss.achieved,
                    "measured_over_s": round(miss.seconds, 2),
                    "new_plan": None,
                }
                attempts.append(attempt)
                print(f"floor: {miss}; the plan promised {plan.throughput:,.0f} samples/s")
                if len(attempts) > _FLOOR_ATTEMPTS:
                    gave_up = _floor_error(job, measured, f"after {_FLOOR_ATTEMPTS} re-plans")
                    break
                problem = refit(problem, plan, miss.achieved)
                refit_file = problem.save(out / f"problem-refit-{len(attempts)}.yaml")
                attempt["refit_problem"] = str(refit_file)
                new_plan = scheduler.schedule(problem)
                if not new_plan.feasible:
                    attempt["refit_best"] = new_plan.throughput
                    gave_up = _floor_error(
                        job, measured, f"the model refit on it reaches at most {new_plan.throughput:,.0f}"
                    )
                    break
                plan_file = out / f"plan-floor-{len(attempts)}.json"
                new_plan.save(plan_file)
                attempt.update(new_plan=_plan_line(new_plan), new_plan_file=str(plan_file),
                               new_predicted=new_plan.throughput,
                               old_plan_refit=predicted_throughput(problem, plan))  # fmt: skip
                where = f"checkpoint {miss.checkpoint}" if miss.checkpoint else "the start (no checkpoint)"
                print(f"re-plan on the refit model; resuming from {where} with:")
                print(new_plan.table())
                plan, resume = new_plan, miss.checkpoint is not None
            except ResourcesChanged as change:
                if len(replans) >= _MAX_REPLANS:
                    raise
                # a type that joined and was not profiled at the start is profiled now (elastic.py)
                problem, profiled = profile_joined_types(job, problem, change.now, settings)
                present = restrict_problem(problem, change.now)
                new_plan = _feasible(scheduler.schedule(present), problem, job)
                plan_file = out / f"plan-replan-{len(replans) + 1}.json"
                new_plan.save(plan_file)
                problem_replan = present.save(out / f"problem-replan-{len(replans) + 1}.yaml")
                replans.append(
                    {
                        "time": datetime.now(UTC).isoformat(timespec="seconds"),
                        "reason": change.reason,
                        "step": change.step,
                        "types_before": change.before,
                        "types_now": change.now,
                        "checkpoint": str(change.checkpoint) if change.checkpoint else None,
                        "old_plan": _plan_line(plan),
                        "new_plan": _plan_line(new_plan),
                        "new_plan_file": str(plan_file),
                        "problem_file": str(problem_replan),
                        "profiled_types": profiled,
                    }
                )
                where = (
                    f"checkpoint {change.checkpoint}" if change.checkpoint else "the start (no checkpoint)"
                )
                print(f"re-plan: {change.reason} at step {change.step}; resuming from {where} with:")
                print(new_plan.table())
                plan, resume = new_plan, change.checkpoint is not None
        seconds["train"] = time.perf_counter() - t0
    finally:
        if owns_ray:
            ray.shutdown()

    # a long run's rate: the warm-up (first calls, first data chunk) is a one-time cost
    if summary is not None:
        achieved = summary.steady_throughput or summary.throughput
        # measured only over as long a steady window as the closed loop's check needs (else: None)
        steady_s = sum(seconds for _, seconds in summary.extra["chunks"][1:])
        floor_met = (
            None
            if summary.steady_throughput is None or steady_s < FLOOR_WINDOW_S
            else achieved >= FLOOR_SHORTFALL * job.throughput_min
        )
    else:  # the closed loop gave up: what the last plan achieved before it stopped
        achieved, floor_met = measured[-1], False
    simulated = _simulated(problem, plan, job)  # the plan that ran (after any re-plan)
    hours = lambda throughput: job.samples / throughput / 3600.0 if throughput > 0 else float("inf")  # noqa: E731
    report = RunReport(
        job=job.name,
        scheduler=plan.scheduler,
        plan=_plan_line(plan),
        predicted_throughput=plan.throughput,
        simulated_throughput=simulated,
        achieved_throughput=achieved,
        cost_rate=plan.cost_rate,
        projected_cost=plan.cost_rate * hours(achieved),
        predicted_cost=plan.cost,
        auc=summary.auc if summary is not None else None,
        logloss=summary.logloss if summary is not None else None,
        seconds={k: round(v, 2) for k, v in seconds.items()},
        output_dir=str(out),
        throughput_min=job.throughput_min,
        floor_met=floor_met,
        replans=replans,
        floor_attempts=attempts,
    )
    (out / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
    if gave_up is None and floor_met is False:  # trained to the end, but below the floor
        gave_up = _floor_error(job, [*measured, achieved], "the run ended before it could re-plan")
    if gave_up is not None:
        print(report.table())
        raise gave_up
    return report


def _floor_error(job: JobConfig, measured: list[float], why: str) -> InfeasibleError:
    """The InfeasibleError (exit 3) of a floor the closed loop could not keep, naming the highest
    throughput measured."""
    best = max(measured)
    return InfeasibleError(
        f"no plan met the floor of {job.throughput_min:,.0f} samples/s on cluster {job.cluster.name!r} "
        f"in closed loop ({why}); the highest throughput measured is {best:,.0f} samples/s "
        f"(runs: {', '.join(f'{m:,.0f}' for m in measured)}). Lower throughput_min to at most "
        f"{best / 0.9:,.0f}, or raise max_instances of a resource type. Details in {REPORT_FILE}.",
        best,
    )


def _given_problem(path: Path, job: JobConfig, copy: Path) -> Any:
    """`heterps run --problem FILE`: the problem to plan on instead of a profile, checked against the
    job (same layers, and types of the job's cluster) and given the job's floor, batch size and
    samples; saved as output_dir/problem.yaml."""
    from heterps_ray.costmodel import load_problem, problem_from_dict
    from heterps_ray.models import build_model

    if not path.is_file():
        raise ConfigError(str(path), "--problem", "an existing problem file (YAML or JSON)", str(path))
    problem = load_problem(path)
    layers = [layer.name for layer in build_model(job.model).layers]
    if problem.layer_names != layers:
        raise ConfigError(str(path), "layers", f"the layers of the job's model {layers}", problem.layer_names)
    types = {t.name for t in job.cluster.resource_types}
    unknown = sorted(set(problem.type_names) - types)
    if unknown:
        raise ConfigError(str(path), "resources", f"resource types of cluster {job.cluster.name!r}", unknown)
    data = problem.to_dict()
    data.update(throughput_min=job.throughput_min, batch_size=job.batch_size, samples=job.samples)
    problem = problem_from_dict(data, str(path))
    if path.resolve() != copy.resolve():
        problem.save(copy)
    return problem


def _plan_line(plan: Any) -> str:
    """A plan in one line: stages as first..last layer @ type x replicas, then the PS shards."""
    stages = " | ".join(f"{s.layers[0]}..{s.layers[-1]}@{s.type}x{s.replicas}" for s in plan.stages)
    return f"{stages} | ps x{plan.ps_shards}"


def _simulated(problem: Any, plan: Any, job: JobConfig) -> float:
    """The simulator's steady throughput of `plan` run as `job` runs it (no start-up, as the achieved)."""
    from heterps_ray.costmodel.simulator import simulate
    from heterps_ray.runtime.driver import CHUNK_STEPS

    return simulate(
        problem,
        plan,
        batches=100 * plan.stages[0].replicas,
        mode=job.mode,
        micro_batches=job.runtime.micro_batches,
        max_in_flight=job.runtime.max_in_flight,
        drain_every=CHUNK_STEPS,
        startup_ms=0.0,
    ).throughput


def _feasible(plan: Any, problem: Any, job: JobConfig) -> Any:
    """`plan` if it reaches the floor, else an InfeasibleError giving the fastest throughput."""
    if not plan.feasible:
        raise InfeasibleError(
            f"no plan reaches the floor of {problem.throughput_min:,.0f} samples/s on cluster "
            f"{job.cluster.name!r}; the fastest reaches {plan.throughput:,.0f} samples/s. Lower "
            "throughput_min, or raise max_instances of a resource type.",
            plan.throughput,
        )
    return plan


# -- heterps run --------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="profile -> fit -> plan -> train -> report, end to end",
        description=(
            "Run a job end to end: generate its data if the job asks for synthetic data, profile its "
            "model on every resource type of the Ray cluster, fit the cost model, plan with the job's "
            "scheduler, train the plan, and report predicted against achieved throughput, $/hour, the "
            "projected total cost, AUC and logloss. Outputs go to the job's output_dir. Uses an embedded "
            "local Ray with the cluster's resource types, or the cluster at --address (or $RAY_ADDRESS, "
            "as inside `ray job submit`). The floor is kept in closed loop: when the steady throughput "
            "after warm-up is more than 10% under throughput_min, training stops at a checkpoint, the model "
            "is refit on the measurement, the scheduler re-plans and training resumes (at most 3 times; "
            "run_report.json lists each attempt, throughput_min and floor_met). Exit codes: 0 done with "
            "the floor met (or too short a run to measure it), 2 bad input, 3 no plan meets the floor "
            "(at plan time, or as measured in closed loop; the message names the highest throughput "
            "reached or measured, and run_report.json is still written)."
        ),
    )
    p.add_argument("job", metavar="JOB.yaml", help="job config")
    p.add_argument("--address", default=None, help="Ray cluster address (default: an embedded local Ray)")
    p.add_argument("--steps", type=int, default=None, help="batches to train (default: the job's)")
    p.add_argument(
        "--budget-s", type=float, default=None, help="scheduler time budget (rl: train per problem)"
    )
    p.add_argument("--output-dir", default=None, help="override the job's output_dir")
    p.add_argument("--quick-profile", action="store_true", help="a fast, rough profile (smoke runs)")
    p.add_argument(
        "--problem",
        metavar="FILE",
        default=None,
        help="plan on this problem file instead of profiling (e.g. an earlier run's problem.yaml); "
        "the job's floor, batch size and samples apply",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in output_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from heterps_ray.config import load_job

    overrides = {"output_dir": str(Path(args.output_dir).resolve())} if args.output_dir else None
    job = load_job(args.job, overrides)
    if args.steps is not None and args.steps < 1:
        raise ConfigError(None, "--steps", "a positive integer", args.steps)
    report = run_job(
        job,
        address=args.address,
        overwrite=args.overwrite,
        steps=args.steps,
        budget_s=args.budget_s,
        progress=not args.no_progress,
        quick_profile=args.quick_profile,
        problem_file=args.problem,
    )
    print(report.table())
    print(f"wrote {report.output_dir}/{REPORT_FILE}")
    return 0
