"""Re-plan and resume: what the closed loop does when training stops at a checkpoint, because the
steady rate missed the floor (refit the model on the measurement) or the cluster's resource types
changed (restrict the problem to the types present, profiling a type that joined). Both end the same
way: the job's scheduler plans again, the plan is saved and training resumes from the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from heterps_ray.closedloop.problems import profile_joined_types, restrict_problem
from heterps_ray.closedloop.report import floor_error, plan_line
from heterps_ray.config import JobConfig
from heterps_ray.costmodel import Plan, Problem
from heterps_ray.costmodel.calibrate import predicted_throughput, refit
from heterps_ray.costmodel.table_memory import TableEstimate
from heterps_ray.errors import InfeasibleError
from heterps_ray.profiling.profiler import ProfileSettings
from heterps_ray.runtime.elastic import ResourcesChanged
from heterps_ray.runtime.loop import FloorMissed
from heterps_ray.scheduling import Scheduler

MAX_REPLANS = 5  # resource changes one run follows before it gives up
FLOOR_ATTEMPTS = 3  # re-plans after a missed floor before the run gives up (exit 3)


@dataclass
class Decisions:
    """What a `heterps run` has decided so far: the problem and plan it trains, where the plan is
    saved, and every re-plan (resource changes) and missed floor with what followed."""

    problem: Problem
    plan: Plan
    plan_file: Path
    replans: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # the closed loop's missed floors
    measured: list[float] = field(default_factory=list)  # steady samples/s measured, for exit 3


class Replanner:
    """Turns a stop of training (FloorMissed, ResourcesChanged) into the next plan to resume with."""

    def __init__(
        self,
        job: JobConfig,
        estimate: TableEstimate | None,
        scheduler: Scheduler,
        settings: ProfileSettings,
        out: Path,
        decisions: Decisions,
    ):
        self.job, self.estimate, self.scheduler, self.settings = job, estimate, scheduler, settings
        self.out, self.decisions = out, decisions

    def after(self, stop: FloorMissed | ResourcesChanged) -> Path | None:
        """Re-plan after `stop`; the new plan is in ``decisions``. Returns the checkpoint to resume
        from (None: the start). InfeasibleError (exit 3) when the floor cannot be kept."""
        if isinstance(stop, FloorMissed):
            plan, record = self._after_floor_missed(stop)
        else:
            plan, record = self._after_change(stop)
        d = self.decisions
        kind = "floor" if isinstance(stop, FloorMissed) else "replan"
        n = len(d.attempts) if kind == "floor" else len(d.replans)
        d.plan_file = self.out / f"plan-{kind}-{n}.json"
        plan.save(d.plan_file)
        record.update(new_plan=plan_line(plan), new_plan_file=str(d.plan_file))
        d.plan = plan
        where = f"checkpoint {stop.checkpoint}" if stop.checkpoint else "the start (no checkpoint)"
        print(f"re-plan: {stop}; resuming from {where} with:")
        print(plan.table())
        return stop.checkpoint

    def _after_floor_missed(self, miss: FloorMissed) -> tuple[Plan, dict[str, Any]]:
        d, job = self.decisions, self.job
        d.measured.append(miss.achieved)
        attempt: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
            "step": miss.step,
            "checkpoint": str(miss.checkpoint) if miss.checkpoint else None,
            "old_plan": plan_line(d.plan),
            "predicted": d.plan.throughput,
            "measured": miss.achieved,
            "measured_over_s": round(miss.seconds, 2),
            "new_plan": None,
        }
        d.attempts.append(attempt)
        print(f"floor: {miss}; the plan promised {d.plan.throughput:,.0f} samples/s")
        if len(d.attempts) > FLOOR_ATTEMPTS:
            raise floor_error(job, d.measured, f"after {FLOOR_ATTEMPTS} re-plans")
        old = d.plan
        d.problem = refit(d.problem, old, miss.achieved)
        attempt["refit_problem"] = str(d.problem.save(self.out / f"problem-refit-{len(d.attempts)}.yaml"))
        plan = self.scheduler.schedule(d.problem)
        if not plan.feasible:
            attempt["refit_best"] = plan.throughput
            raise floor_error(
                job, d.measured, f"the model refit on it reaches at most {plan.throughput:,.0f}"
            )
        attempt.update(new_predicted=plan.throughput, old_plan_refit=predicted_throughput(d.problem, old))
        return plan, attempt

    def _after_change(self, change: ResourcesChanged) -> tuple[Plan, dict[str, Any]]:
        d = self.decisions
        if len(d.replans) >= MAX_REPLANS:
            raise change
        # a type that joined and was not profiled at the start is profiled now
        d.problem, profiled = profile_joined_types(
            self.job, d.problem, change.now, self.settings, self.estimate
        )
        present = restrict_problem(d.problem, change.now)
        plan = feasible(self.scheduler.schedule(present), present, self.job)
        record = {
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
            "reason": change.reason,
            "step": change.step,
            "types_before": change.before,
            "types_now": change.now,
            "checkpoint": str(change.checkpoint) if change.checkpoint else None,
            "old_plan": plan_line(d.plan),
            "problem_file": str(present.save(self.out / f"problem-replan-{len(d.replans) + 1}.yaml")),
            "profiled_types": profiled,
        }
        d.replans.append(record)
        return plan, record


def feasible(plan: Plan, problem: Problem, job: JobConfig) -> Plan:
    """`plan` if it reaches the floor, else an InfeasibleError giving the fastest throughput (or, when
    no plan can be placed at all, what the types present hold)."""
    if plan.feasible:
        return plan
    if plan.throughput >= problem.throughput_min:  # fast enough, yet no plan: it does not fit
        types = ", ".join(f"{r.name} x{r.max_instances}" for r in problem.resources)
        raise InfeasibleError(
            f"no plan of {problem.name!r} can be placed on the resource types present ({types}; the PS "
            f"type {problem.ps_resource!r} holds the shards too) on cluster {job.cluster.name!r}; raise "
            "max_instances of a type, or bring back a type that left.",
            0.0,
        )
    raise InfeasibleError(
        f"no plan reaches the floor of {problem.throughput_min:,.0f} samples/s on cluster "
        f"{job.cluster.name!r}; the fastest reaches {plan.throughput:,.0f} samples/s. Lower "
        "throughput_min, or raise max_instances of a resource type.",
        plan.throughput,
    )
