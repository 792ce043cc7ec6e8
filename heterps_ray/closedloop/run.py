"""`heterps run JOB.yaml`: the whole system end to end on one Ray cluster, as steps.

data -> problem (profile the model on every resource type the cluster has, or a given problem file)
-> plan (the job's scheduler) -> train (the runtime, with the floor kept in closed loop and elastic
re-plans) -> report (predicted against achieved throughput, $/hour, projected cost, AUC / logloss).

Everything a run produces lands in the job's output_dir::

    problem.yaml (+ .measurements.parquet, .fit.csv)                  the fitted cost model
    plan.json                                                          the schedule
    run_summary.json, model/                                           the training run
    run_report.json                                                    the comparison below
    plan-replan-N.json, problem-replan-N.yaml                          re-plans when resources changed
    problem-refit-N.yaml, plan-floor-N.json                            the closed loop's refits and plans

Elastic: when the Ray cluster's resource types change mid-run (a node with a type leaves or joins),
training stops at a checkpoint, the problem is restricted to the types present now (a type that joins
and was not profiled at the start is profiled then), the job's scheduler re-plans, and training
resumes from the checkpoint with the new plan (replan.py). Each re-plan is listed under "replans".

Closed loop: after the warm-up the runtime compares the steady throughput with throughput_min
(runtime/loop.py FLOOR_WINDOW_S); more than 10% short, training stops at a checkpoint, the model is
refit on the measurement (costmodel/calibrate.py), the scheduler re-plans and training resumes, at
most replan.FLOOR_ATTEMPTS times, each listed under "floor_attempts". When no plan meets the floor,
the run stops with exit 3 naming the highest throughput measured (run_report.json is still written).

Warm actors: the whole run holds the runtime's idle actors (runtime/warm.py hold): those the profile
left, of every type, and every plan's, wait for the re-plans and elastic restarts to come, however late,
and are reconfigured instead of started. Only the idle actors of a type that left the cluster go, and on
an autoscaling cluster those of every type the plan in training does not use (so that the autoscaler can
take back their nodes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

import ray

from heterps_ray.closedloop.autoscale import NodeWait, PlanNodes, profile_nodes
from heterps_ray.closedloop.probes import profile_job
from heterps_ray.closedloop.problems import given_problem, with_table_estimate
from heterps_ray.closedloop.replan import Decisions, Replanner, feasible
from heterps_ray.closedloop.report import REPORT_FILE, RunReport, build_report, floor_error, plan_line
from heterps_ray.closedloop.state import STATE_FILE, has_state, load_state, save_state
from heterps_ray.cluster import connect
from heterps_ray.config import JobConfig
from heterps_ray.costmodel import Plan, Problem, load_problem, one_replica_per_stage
from heterps_ray.costmodel.table_memory import (
    TableEstimate,
    check_job_table,
    check_table_fits,
    estimate_table,
)
from heterps_ray.data.dataset import prepare_dataset
from heterps_ray.errors import ConfigError, InfeasibleError
from heterps_ray.profiling.fit import write_problem
from heterps_ray.profiling.profiler import ProfileSettings
from heterps_ray.runtime import warm
from heterps_ray.runtime.checkpoint import CHECKPOINTS_DIR, MODEL_DIR
from heterps_ray.runtime.driver import SUMMARY_FILE, RunSummary, train
from heterps_ray.runtime.elastic import ResourcesChanged
from heterps_ray.runtime.loop import FloorMissed
from heterps_ray.scheduling import Scheduler, get_scheduler

Resume = Literal["no", "yes", "auto"]


def run_job(
    job: JobConfig,
    *,
    address: str | None = None,
    overwrite: bool = False,
    resume: Resume = "no",
    steps: int | None = None,
    budget_s: float | None = None,
    progress: bool = True,
    quick_profile: bool = False,
    problem_file: str | Path | None = None,
) -> RunReport:
    """Profile, fit, plan and train `job`; returns the report (also saved as run_report.json).

    `problem_file`: plan on this problem (say, the problem.yaml of an earlier run's profile of the
    same model and cluster) instead of profiling; the job's floor, batch size and samples apply.
    `resume` "yes": continue the killed run in output_dir (run_state.json) from its newest valid
    checkpoint (none yet: from step 0) with the problem, plan and history it had decided; "auto": do
    that when output_dir holds a run, else start one. InfeasibleError (exit 3) when no plan meets the
    floor, at plan time or in the closed loop."""
    out = Path(job.output_dir)
    resuming = resume == "yes" or (resume == "auto" and has_state(out))
    if resuming and overwrite:
        raise ConfigError(
            None, "--resume", "not together with --overwrite (a resumed run deletes nothing)", resume
        )
    saved = load_state(out, job) if resuming else None
    # the table's estimate, once for the whole run: every stop reads it (None: no dataset yet)
    estimate = estimate_table(job)
    if saved is None:
        check_job_table(job, estimate)  # a table no plan can hold: refused before anything starts (exit 3)
        _claim(out, overwrite)
    elif saved[2]:  # finished: the report is there, nothing is left to do
        print(f"{out}: the run finished already; its report is {out / REPORT_FILE}")
        return RunReport(**json.loads((out / REPORT_FILE).read_text()))
    seconds: dict[str, float] = dict(saved[1]) if saved else {}
    waits: list[NodeWait] = []  # an autoscaling cluster's node requests (closedloop/autoscale.py)
    # the same settings for the first profile and for a type that joins mid-run
    settings = (
        ProfileSettings.quick(progress=progress) if quick_profile else ProfileSettings(progress=progress)
    )
    scheduler = get_scheduler(
        job.scheduler, seed=job.seed, **({} if budget_s is None else {"budget_s": budget_s})
    )
    owns_ray = connect(job.cluster, address, all_types=False)  # elastic: types may join later
    try:
        with warm.hold():  # the profile's and every plan's idle actors wait for the re-plans
            with _timed(seconds, "data"):
                prepare_dataset(job.data, seed=job.seed)
            if estimate is None:  # the dataset was made just now (data.synth_rows)
                estimate = estimate_table(job)
            if saved is None:
                decisions = _plan(job, estimate, scheduler, settings, out, problem_file, seconds, waits)
            else:
                decisions = saved[0]
                print(f"resuming {out} with {plan_line(decisions.plan)}")
            estimate = _as_planned(estimate, decisions.plan)  # RAM or the disk, as the plan weighed them
            save_state(out, job, decisions, seconds)
            with _timed(seconds, "train"):
                summary, gave_up = _train(
                    job,
                    estimate,
                    scheduler,
                    settings,
                    decisions,
                    steps,
                    progress,
                    overwrite,
                    saved is not None,
                    waits,
                )
    finally:
        if owns_ray:
            ray.shutdown()
    d = decisions
    nodes = [w.to_dict() for w in waits]
    spread = d.problem.runtime.spread if d.problem.runtime is not None else {}
    report = build_report(job, d.plan, summary, d.measured, seconds, d.replans, d.attempts, nodes, spread)
    report.save(out)
    save_state(out, job, decisions, seconds, finished=True)
    if gave_up is None and report.floor_met is False:  # trained to the end, but below the floor
        gave_up = floor_error(
            job, [*d.measured, report.achieved_throughput], "the run ended before it could re-plan"
        )
    if gave_up is not None:
        print(report.table())
        raise gave_up
    return report


def _plan(
    job: JobConfig,
    estimate: TableEstimate | None,
    scheduler: Scheduler,
    settings: ProfileSettings,
    out: Path,
    problem_file: str | Path | None,
    seconds: dict[str, float],
    waits: list[NodeWait],
) -> Decisions:
    """The problem (profiled, or the given file) and the scheduler's plan for it (output_dir/plan.json).
    On an autoscaling cluster a profile runs on one node of each type, requested for it (`waits`)."""
    with _timed(seconds, "profile"), profile_nodes(job, waits, wanted=problem_file is None):
        problem = _problem(job, estimate, settings, out, problem_file, seconds)
    check_table_fits(problem, str(out / "problem.yaml"))
    with _timed(seconds, "plan"):
        plan = scheduler.schedule(problem)
        if estimate is not None and estimate.disk_option is not None:
            problem, plan = _weigh_disk(job, scheduler, problem, plan, estimate, out)
        plan = feasible(plan, problem, job)
    print(plan.table())
    return Decisions(problem, plan, plan.save(out / "plan.json"))


def _weigh_disk(
    job: JobConfig, scheduler: Scheduler, problem: Problem, plan: Plan, estimate: TableEstimate, out: Path
) -> tuple[Problem, Plan]:
    """The table all in the PS type's RAM (`problem`, its `plan`) or on its disk with fewer shards
    (estimate.disk_option): the problem and plan of the cheaper that meets the floor (neither: the
    faster; the disk's is saved as output_dir/problem.yaml). Each is planned by `scheduler` on the same
    profile, so its price weighs the disk rows' time against the PS instances they save; a line says
    both."""
    on_disk = with_table_estimate(problem, job, estimate.on_disk())
    disk_plan = scheduler.schedule(on_disk)
    if disk_plan.feasible and plan.feasible:
        take_disk = disk_plan.cost < plan.cost
    else:
        take_disk = disk_plan.feasible or (not plan.feasible and disk_plan.throughput > plan.throughput)
    assert problem.ps.table is not None and on_disk.ps.table is not None
    print(
        f"table: in RAM on {problem.ps.table.shards_needed} shard(s) {_priced(plan)}; on the PS type's disk on "
        f"{on_disk.ps.table.shards_needed} ({on_disk.ps.table.ram_hit_rate:.1%} of lookups from RAM) "
        f"{_priced(disk_plan)}: {'the disk' if take_disk else 'RAM'}"
    )
    if not take_disk:
        return problem, plan
    on_disk.save(out / "problem.yaml")
    return on_disk, disk_plan


def _priced(plan: Plan) -> str:
    if plan.feasible:
        return f"{plan.cost:.4g} $ at {plan.cost_rate:.3f} $/h"
    return f"no plan meets the floor (at most {plan.throughput:,.0f} samples/s)"


def _as_planned(estimate: TableEstimate | None, plan: Plan) -> TableEstimate | None:
    """The table estimate the plan was made for: with its disk option taken where the plan keeps rows
    on disk (a resumed run reads the choice back from its saved plan)."""
    if estimate is not None and plan.on_disk and estimate.disk is None:
        return estimate.on_disk()
    return estimate


def _claim(out: Path, overwrite: bool) -> None:
    """Refuse an output_dir holding a run (a `heterps train` run counts too) before anything is written."""
    previous = [
        name
        for name in (REPORT_FILE, STATE_FILE, SUMMARY_FILE, MODEL_DIR, CHECKPOINTS_DIR)
        if (out / name).exists()
    ]
    if previous and not overwrite:
        raise ConfigError(
            None,
            "output_dir",
            f"a directory without a previous run (found {previous[0]}); pass --resume to continue it or "
            "--overwrite to replace it",
            str(out),
        )
    out.mkdir(parents=True, exist_ok=True)


def _problem(
    job: JobConfig,
    estimate: TableEstimate | None,
    settings: ProfileSettings,
    out: Path,
    problem_file: str | Path | None,
    seconds: dict[str, float],
) -> Problem:
    """The problem to plan on: the given file, or a profile of the live cluster (output_dir/problem.yaml);
    the profile's parts go into `seconds` as "profile.<part>" (layers, probes, fit)."""
    if problem_file is not None:
        problem = given_problem(Path(problem_file), job, out / "problem.yaml", estimate)
    else:
        fit = profile_job(job, settings, estimate)
        seconds.update({f"profile.{part}": took for part, took in fit.seconds.items()})
        path = write_problem(fit, out / "problem.yaml")["problem"]
        problem = load_problem(path)
        for item in fit.unmeasured:  # what this cluster did not let the profile measure
            print(f"profile: not measured: {item}")
        if fit.flags:
            print(f"profile: {len(fit.flags)} poor fits (see {path.with_suffix('.fit.csv').name})")
    return one_replica_per_stage(problem) if job.mode == "sync" else problem


def _train(
    job: JobConfig,
    estimate: TableEstimate | None,
    scheduler: Scheduler,
    settings: ProfileSettings,
    decisions: Decisions,
    steps: int | None,
    progress: bool,
    overwrite: bool,
    resumed: bool,
    waits: list[NodeWait],
) -> tuple[RunSummary | None, InfeasibleError | None]:
    """Train the plan; after each stop for a missed floor or a resource change, re-plan and resume
    from its checkpoint. `resumed`: a killed run's, from its newest checkpoint (none: step 0). Returns
    the summary, or the closed loop's exit-3 error once it gives up. On an autoscaling cluster each
    plan's nodes are requested before it trains and given back at the end (PlanNodes, `waits`)."""
    out = Path(job.output_dir)
    replanner = Replanner(job, estimate, scheduler, settings, out, decisions)
    resume: Path | None = None
    stops = 0
    restart: _Restart | None = None  # the last re-plan, until its run has trained a batch
    gone: set[str] = set()  # types that left the cluster and did not come back
    with PlanNodes(job, estimate, waits) as nodes:  # its lines print with --no-progress too, as re-plans do
        while True:
            called = time.perf_counter()
            warm.release_types(_types_left(job, decisions.plan, gone))
            try:
                # autoscaling: request and await this plan's nodes (a type that does not come: re-plan)
                resume = nodes.get(decisions, replanner, resume)
                summary = train(
                    job,
                    decisions.plan,
                    steps=steps,
                    progress=progress,
                    overwrite=overwrite or stops > 0,
                    plan_file=str(decisions.plan_file),
                    resume=resume is not None or resumed,
                    start_if_none=resumed and stops == 0,
                    elastic=True,
                    floor=job.throughput_min or None,
                    estimate=estimate,
                )
                if restart is not None:
                    restart.record(called, summary.extra["start"])
                return summary, None
            except (FloorMissed, ResourcesChanged) as stop:
                if restart is not None:
                    restart.record(called, stop.start)
                decided = time.perf_counter()
                stops += 1
                if isinstance(stop, ResourcesChanged):
                    gone = (gone | set(stop.before)) - set(stop.now)
                # autoscaling: a plan type that left is asked for again before the run re-plans
                replan = nodes.after(stop, decisions.plan)
                if replan is None:  # it came back: the same plan resumes
                    resume = stop.checkpoint
                    continue
                try:
                    resume = replanner.after(replan)
                    entries = decisions.attempts if isinstance(replan, FloorMissed) else decisions.replans
                    restart = _Restart(entries[-1], decided)
                    save_state(out, job, decisions, {})
                except InfeasibleError as err:
                    if not decisions.measured:  # no plan at all (a resource change): nothing to report
                        raise
                    return None, err
            except InfeasibleError as err:  # no plan on the nodes that came
                if not decisions.measured:
                    raise
                return None, err


def _types_left(job: JobConfig, plan: Plan, gone: set[str]) -> set[str]:
    """The types whose idle actors go before `plan` trains: those that left the cluster (`gone`: their
    actors died with their nodes), and on an autoscaling cluster every type `plan` does not use (an idle
    actor would keep the autoscaler from taking back its node). Any other type may come back in a
    re-plan, so its actors stay up."""
    if not job.cluster.autoscale.enabled:
        return gone
    used = {s.type for s in plan.stages} | {plan.ps_type}
    return gone | {t.name for t in job.cluster.resource_types if t.name not in used}


class _Restart:
    """How long a re-plan took to train again, in its record (``restart``): seconds from the decision
    (the stop caught) to the new plan's train() call (re-plan, node requests), to its actors placed
    (warm actors reconfigured, new ones started, the checkpoint restored), and to its first batch."""

    def __init__(self, entry: dict[str, Any], decided: float):
        self.entry, self.decided = entry, decided

    def record(self, called: float, start: dict[str, float | None]) -> None:
        replan_s = called - self.decided
        ready, first = start.get("ready_s"), start.get("first_batch_s")
        self.entry["restart"] = {
            "replan_s": round(replan_s, 3),
            "ready_s": None if ready is None else round(replan_s + ready, 3),
            "first_batch_s": None if first is None else round(replan_s + first, 3),
        }
        if first is not None:
            print(f"re-plan: first batch {replan_s + first:.1f} s after the decision")


class _timed:
    """``with _timed(seconds, "phase"):`` adds the block's wall time to seconds["phase"]."""

    def __init__(self, seconds: dict[str, float], phase: str):
        self.seconds, self.phase = seconds, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.seconds[self.phase] = time.perf_counter() - self.t0
