"""The end-to-end run's report: the cost model's prediction against what the runtime achieved,
$/hour, the projected total cost, the floor, the model's quality and the time of each phase.

It carries one prediction, the cost model's (what the plan was chosen on and the floor is checked
against). The discrete-event simulator (costmodel/simulator.py) is a what-if tool: it does not model
the runtime terms of DESIGN.md §3b and missed the achieved rate by about a third on the main job, so
a second figure beside the model's would only leave a reader guessing which one the plan rests on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from heterps_ray.config import JobConfig
from heterps_ray.costmodel import Plan
from heterps_ray.costmodel.pricing import monetary_cost
from heterps_ray.errors import InfeasibleError
from heterps_ray.ps.atomic import write_bytes_atomic
from heterps_ray.runtime.driver import RunSummary
from heterps_ray.runtime.loop import FLOOR_SHORTFALL, FLOOR_WINDOW_S

REPORT_FILE = "run_report.json"


@dataclass
class RunReport:
    """Predicted (cost model) against achieved (runtime) for one end-to-end run."""

    job: str
    scheduler: str
    plan: str  # one line: stages as layers@type x replicas
    predicted_throughput: float  # samples/s, from the fitted cost model (DESIGN.md §3, what plans optimise)
    achieved_throughput: float  # samples/s, measured by the runtime (after its warm-up chunk)
    cost_rate: float  # $/hour of the plan's actors
    projected_cost: float  # $ to train job.samples at the achieved throughput
    predicted_cost: float  # $ to train job.samples at the predicted throughput
    auc: float | None
    logloss: float | None
    seconds: dict[str, float]  # wall time of each phase; "phase.part": a part of one (profile.probes)
    output_dir: str
    throughput_min: float = 0.0  # samples/s, the job's floor
    # achieved >= 90% of the floor (runtime/loop.py FLOOR_SHORTFALL); None: a run too short to
    # measure it (under FLOOR_WINDOW_S of steady chunks after the warm-up one)
    floor_met: bool | None = None
    replans: list[dict[str, Any]] = field(default_factory=list)  # resource changes and the new plans
    floor_attempts: list[dict[str, Any]] = field(default_factory=list)  # missed floors and the re-plans
    # an autoscaling cluster (closedloop/autoscale.py): s waited for requested nodes, $ of the nodes
    # up meanwhile (idle, at each type's price_per_hour), and each request (profile, plan, re-plans)
    node_wait_s: float = 0.0
    node_wait_cost: float = 0.0
    node_requests: list[dict[str, Any]] = field(default_factory=list)
    # samples/s: the predicted throughput within the profile's own spread (problem runtime.spread of
    # the plan's types, the widest); None: a problem without one (a quick profile, a given file)
    predicted_range: list[float] | None = None
    # where the sparse rows lived (DESIGN.md "Table tiers") and, in GPU memory, the share of lookups
    # served there (run_summary.json's extra.table)
    sparse_table: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        err = (
            self.achieved_throughput / self.predicted_throughput - 1
            if self.predicted_throughput
            else float("nan")
        )
        lines = [
            f"run {self.job!r}: scheduler {self.scheduler}, plan {self.plan}",
            f"  throughput  predicted {self.predicted_throughput:>12,.0f} samples/s  (cost model"
            + (
                f"; range {self.predicted_range[0]:,.0f}-{self.predicted_range[1]:,.0f} from the profile's spread)"
                if self.predicted_range
                else ")"
            ),
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
        restarts = [
            r["restart"]["first_batch_s"] for r in self.floor_attempts + self.replans if r.get("restart")
        ]
        if any(s is not None for s in restarts):  # each re-plan's first batch, from the decision on
            shown = ", ".join("?" if s is None else f"{s:.1f} s" for s in restarts)
            lines.append(f"  re-plans    first batch {shown} after the decision")
        if self.sparse_table.get("place"):
            lines.append(f"  table       {self.sparse_table['place']}{_table_measured(self.sparse_table)}")
        if self.auc is not None:
            lines.append(f"  model       AUC {self.auc:.4f}, logloss {self.logloss:.4f}")
        if self.node_requests:
            missing = sorted({t for r in self.node_requests for t in r["missing"]})
            lines.append(
                f"  nodes       {self.node_wait_s:.1f} s waited in {len(self.node_requests)} request(s), "
                f"{sum(len(r['joined']) for r in self.node_requests)} node(s) joined, "
                f"{self.node_wait_cost:.6f} $ idle meanwhile"
                + (f"; never came: {missing}" if missing else "")
            )
        lines.append(f"  time        {time_line(self.seconds)}")
        return "\n".join(lines)

    def save(self, out: Path) -> Path:
        import json

        return write_bytes_atomic(out / REPORT_FILE, (json.dumps(asdict(self), indent=2) + "\n").encode())


def build_report(
    job: JobConfig,
    plan: Plan,
    summary: RunSummary | None,
    measured: list[float],
    seconds: dict[str, float],
    replans: list[dict[str, Any]],
    attempts: list[dict[str, Any]],
    node_requests: list[dict[str, Any]] | None = None,
    spread: dict[str, float] | None = None,
) -> RunReport:
    """The report of a run that trained `plan` (the last plan, after any re-plan) to `summary`, or
    (summary None) whose closed loop gave up after measuring `measured`; `node_requests`: the waits
    for an autoscaling cluster's nodes (closedloop/autoscale.py NodeWait.to_dict); `spread`: the
    problem's runtime.spread (the profile's own, per type)."""
    if summary is not None:
        # a long run's rate: the warm-up (first calls, first data chunk) is a one-time cost
        achieved = summary.steady_throughput or summary.throughput
        # measured only over as long a steady window as the closed loop's check needs (else: None)
        steady_s = sum(s for _, s in summary.extra["chunks"][1:])
        floor_met = _floor_met(summary, achieved, steady_s, job.throughput_min)
    else:  # the closed loop gave up: what the last plan achieved before it stopped
        achieved, floor_met = measured[-1], False
    return RunReport(
        job=job.name,
        scheduler=plan.scheduler,
        plan=plan_line(plan),
        predicted_throughput=plan.throughput,
        achieved_throughput=achieved,
        cost_rate=plan.cost_rate,
        projected_cost=monetary_cost(plan.cost_rate, job.samples, achieved),
        predicted_cost=plan.cost,
        predicted_range=predicted_range(plan, spread or {}),
        auc=summary.auc if summary is not None else None,
        logloss=summary.logloss if summary is not None else None,
        seconds={k: round(v, 2) for k, v in seconds.items()},
        output_dir=str(job.output_dir),
        throughput_min=job.throughput_min,
        floor_met=floor_met,
        replans=replans,
        floor_attempts=attempts,
        node_wait_s=round(sum(r["seconds"] for r in node_requests or []), 2),
        node_wait_cost=round(sum(r["cost"] for r in node_requests or []), 6),
        node_requests=list(node_requests or []),
        sparse_table=dict(summary.extra.get("table", {})) if summary is not None else {},
    )


def _floor_met(summary: RunSummary, achieved: float, steady_s: float, floor: float) -> bool | None:
    """Whether the run kept the floor (achieved >= FLOOR_SHORTFALL of it). The steady rate decides
    when it was measured over FLOOR_WINDOW_S; a shorter run (a short job, or what is left after a
    re-plan) has met it still when its rate over the whole loop, warm-up included, clears the floor:
    the warm-up only slows that rate down. Otherwise None: too short to tell."""
    if summary.steady_throughput is not None and steady_s >= FLOOR_WINDOW_S:
        return achieved >= FLOOR_SHORTFALL * floor
    if summary.throughput >= FLOOR_SHORTFALL * floor:
        return True
    return None


def floor_error(job: JobConfig, measured: list[float], why: str) -> InfeasibleError:
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


def time_line(seconds: dict[str, float]) -> str:
    """Each phase's wall time; a phase's parts ("profile.probes") in brackets after it."""
    parts: dict[str, list[str]] = {}
    for key, took in seconds.items():
        phase, _, part = key.partition(".")
        if part:
            parts.setdefault(phase, []).append(f"{part} {took:.1f}s")
    return ", ".join(
        f"{key} {took:.1f}s" + (f" ({', '.join(parts[key])})" if key in parts else "")
        for key, took in seconds.items()
        if "." not in key
    )


def plan_line(plan: Plan) -> str:
    """A plan in one line: stages as first..last layer @ type x replicas, then the PS shards."""
    stages = " | ".join(f"{s.layers[0]}..{s.layers[-1]}@{s.type}x{s.replicas}" for s in plan.stages)
    return f"{stages} | ps x{plan.ps_shards}"


def predicted_range(plan: Plan, spread: dict[str, float]) -> list[float] | None:
    """The plan's predicted throughput within the widest spread of its stages' types (runtime.spread:
    how far the profile's repeated one-stage probes fell from their median); None without one."""
    widest = max((spread[s.type] for s in plan.stages if s.type in spread), default=None)
    if widest is None:
        return None
    return [round(plan.throughput * (1.0 - widest), 1), round(plan.throughput * (1.0 + widest), 1)]


def _table_measured(table: dict[str, Any]) -> str:
    """What the run measured of where its rows lived: the GPU tier's hit rate; with a disk tier, the
    rows in the shards' RAM and on their disks at the end and the share of lookups RAM served."""
    hits = table.get("hit_rate")
    shown = f"; {hits:.1%} of lookups served there" if hits is not None else ""
    if "disk_rows" in table:
        ram_hits = table.get("ram_hit_rate")
        shown += f"; measured: {table['ram_rows']:,} rows in RAM, {table['disk_rows']:,} on disk"
        shown += f", {ram_hits:.1%} of lookups from RAM" if ram_hits is not None else ""
    return shown
