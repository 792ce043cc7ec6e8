"""`heterps run JOB.yaml`: the whole system end to end on one Ray cluster.

profile the job's model on every resource type the cluster has -> fit a problem file ->
plan with the job's scheduler -> train the plan as a pipeline of actors -> report predicted
against achieved throughput, $/hour, the projected total cost and the model's AUC / logloss.

Everything a run produces lands in the job's output_dir::

    problem.yaml (+ .measurements.parquet, .fit.csv, .runtime.yaml)   the fitted cost model
    plan.json                                                          the schedule
    run_summary.json, model/                                           the training run
    run_report.json                                                    the comparison below
    plan-replan-N.json                                                 plans made when resources changed

Elastic: when the Ray cluster's resource types change mid-run (a node with a type leaves or joins),
training stops at a checkpoint, the problem is restricted to the types present now (their profiles
are kept), the job's scheduler re-plans, and training resumes from the checkpoint with the new plan.
Each re-plan is printed and listed under "replans" in run_report.json.
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
from heterps_ray.errors import ConfigError

REPORT_FILE = "run_report.json"
_MAX_REPLANS = 5  # resource changes one run follows before it gives up


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
    replans: list[dict[str, Any]] = field(default_factory=list)  # resource changes and the new plans

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
) -> RunReport:
    """Profile, fit, plan and train `job`; returns the report (also saved as run_report.json)."""
    import ray

    from heterps_ray.cluster import connect
    from heterps_ray.costmodel import load_problem, one_replica_per_stage
    from heterps_ray.data.dataset import prepare_dataset
    from heterps_ray.profiling.fit import write_problem
    from heterps_ray.profiling.profiler import ProfileSettings, profile
    from heterps_ray.runtime.checkpoint import CHECKPOINTS_DIR, MODEL_DIR
    from heterps_ray.runtime.driver import SUMMARY_FILE, train
    from heterps_ray.runtime.elastic import ResourcesChanged, restrict_problem
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
    owns_ray = connect(job.cluster, address)
    try:
        t0 = time.perf_counter()
        prepare_dataset(job.data, seed=job.seed)
        seconds["data"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        settings = (
            ProfileSettings.quick(progress=progress) if quick_profile else ProfileSettings(progress=progress)
        )
        fit = profile(job, settings)
        problem_path = write_problem(fit, out / "problem.yaml")["problem"]
        problem = load_problem(problem_path)
        if job.mode == "sync":
            problem = one_replica_per_stage(problem)
        seconds["profile"] = time.perf_counter() - t0
        if fit.flags:
            print(f"profile: {len(fit.flags)} poor fits (see {problem_path.with_suffix('.fit.csv').name})")

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
        resume = False
        while True:
            try:
                summary = train(
                    job,
                    plan,
                    steps=steps,
                    progress=progress,
                    overwrite=overwrite or bool(replans),
                    plan_file=str(plan_file),
                    resume=resume,
                    elastic=True,
                )
                break
            except ResourcesChanged as change:
                if len(replans) >= _MAX_REPLANS:
                    raise
                new_plan = _feasible(scheduler.schedule(restrict_problem(problem, change.now)), problem, job)
                plan_file = out / f"plan-replan-{len(replans) + 1}.json"
                new_plan.save(plan_file)
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
    achieved = summary.steady_throughput or summary.throughput
    simulated = _simulated(problem, plan, job, fit.runtime)  # the plan that ran (after any re-plan)
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
        auc=summary.auc,
        logloss=summary.logloss,
        seconds={k: round(v, 2) for k, v in seconds.items()},
        output_dir=str(out),
        replans=replans,
    )
    (out / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def _plan_line(plan: Any) -> str:
    """A plan in one line: stages as first..last layer @ type x replicas, then the PS shards."""
    stages = " | ".join(f"{s.layers[0]}..{s.layers[-1]}@{s.type}x{s.replicas}" for s in plan.stages)
    return f"{stages} | ps x{plan.ps_shards}"


def _simulated(problem: Any, plan: Any, job: JobConfig, runtime: dict[str, Any]) -> float:
    """The simulator's steady throughput of `plan` run as `job` runs it (no start-up, as the achieved)."""
    from heterps_ray.costmodel.simulator import simulate
    from heterps_ray.profiling.fit import simulator_options
    from heterps_ray.runtime.driver import CHUNK_STEPS

    options = {**simulator_options(runtime), "startup_ms": 0.0}
    return simulate(
        problem,
        plan,
        batches=100 * plan.stages[0].replicas,
        mode=job.mode,
        micro_batches=job.runtime.micro_batches,
        max_in_flight=job.runtime.max_in_flight,
        drain_every=CHUNK_STEPS,
        **options,
    ).throughput


def _feasible(plan: Any, problem: Any, job: JobConfig) -> Any:
    """`plan` if it reaches the floor, else an InfeasibleError giving the fastest throughput."""
    from heterps_ray.errors import InfeasibleError

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
            "as inside `ray job submit`). Exit codes: 0 done, 2 bad input, 3 no plan meets the floor."
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
    )
    print(report.table())
    print(f"wrote {report.output_dir}/{REPORT_FILE}")
    return 0
