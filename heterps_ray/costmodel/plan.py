"""A plan (DESIGN.md §4): layer -> resource type, stages with replicas, PS shards, predicted
throughput and cost. Plans are data: JSON on disk, a fixed-width table on screen.

Example::

    plan = load_plan("plan.json", problem)   # checked against the problem
    print(plan.table())
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from heterps_ray.config import read_text
from heterps_ray.costmodel.problem import Problem
from heterps_ray.errors import ConfigError

if TYPE_CHECKING:  # the type only: a plan is data and does not price itself (analytic.evaluate_plan does)
    from heterps_ray.costmodel.analytic import Evaluation
from heterps_ray.ps.atomic import write_bytes_atomic


@dataclass(frozen=True)
class PlanStage:
    layers: tuple[str, ...]
    type: str
    replicas: int
    stage_ms: float  # tau_s: one replica's time per batch, ms (compute + boundaries + input)
    throughput: float  # samples/s of the stage with its replicas


@dataclass(frozen=True)
class Plan:
    """Scheduler output. `best_throughput` is the highest throughput any plan reaches, when known."""

    problem: str
    assignment: tuple[str, ...]  # type name per layer, in layer order
    stages: tuple[PlanStage, ...]
    ps_shards: int
    ps_type: str
    ps_throughput: float  # samples/s
    throughput: float  # samples/s
    throughput_min: float  # samples/s, the floor
    cost: float  # $ for all samples
    cost_rate: float  # $/hour
    feasible: bool
    scheduler: str
    seconds: float  # time the scheduler took
    plans_evaluated: int = 0
    best_throughput: float | None = None
    batch_size: int = 0
    samples: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # scheduler-specific notes (JSON-able)
    # where the sparse rows live (DESIGN.md "Table tiers"): "gpu" (all in stage 0's GPU memory),
    # "gpu_cache" (the hot ones there, in front of the shards) or "ps" (on the shards), on `table_type`;
    # None: the plan does not say (a problem without runtime terms, a hand-written plan): the runtime decides
    table_place: str | None = None
    table_type: str = ""
    table_ms: float | None = None  # stage 0's ms a batch for its rows there (in its stage time)
    table_hit_rate: float | None = None  # the share of lookups its GPU memory serves
    ps_hosted: bool = False  # the shards live in stage 0's DataWorker (no actors of their own)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_evaluation(
        cls,
        problem: Problem,
        evaluation: Evaluation,
        scheduler: str,
        seconds: float = 0.0,
        plans_evaluated: int = 0,
        best_throughput: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Plan:
        names, layer_names = problem.type_names, problem.layer_names
        table = evaluation.runtime.table if evaluation.runtime is not None else None
        rows_per_batch = sum(layer.sparse_rows_per_sample for layer in problem.layers) * problem.batch_size
        assignment: list[str] = []
        stages = []
        for s in evaluation.stages:
            assignment += [names[s.type]] * (s.end - s.start)
            stages.append(
                PlanStage(
                    tuple(layer_names[s.start : s.end]), names[s.type], s.replicas, s.tau_ms, s.throughput
                )
            )
        return cls(
            problem=problem.name,
            assignment=tuple(assignment),
            stages=tuple(stages),
            ps_shards=evaluation.ps_shards,
            ps_type=problem.ps_resource,
            ps_throughput=evaluation.ps_throughput,
            throughput=evaluation.throughput,
            throughput_min=problem.throughput_min,
            cost=evaluation.cost,
            cost_rate=evaluation.cost_rate,
            feasible=evaluation.feasible,
            scheduler=scheduler,
            seconds=seconds,
            plans_evaluated=plans_evaluated,
            best_throughput=best_throughput,
            batch_size=problem.batch_size,
            samples=float(problem.samples),
            extra=dict(extra or {}),
            table_place=table.place if table is not None else None,
            table_type=stages[0].type if table is not None and table.place != "ps" else problem.ps_resource,
            table_ms=table.ms_per_row * rows_per_batch if table is not None else None,
            # the GPU tier's hits, or on shards with a disk tier, their RAM's
            table_hit_rate=table.hit_rate if table is not None and (table.place != "ps" or table.hit_rate < 1) else None,
            ps_hosted=evaluation.runtime is not None and evaluation.runtime.ps_hosted,
        )

    @property
    def replicas(self) -> list[int]:
        return [s.replicas for s in self.stages]

    # -- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("ps_throughput", "throughput", "cost", "best_throughput"):
            data[key] = _finite_or_none(data[key])
        for stage in data["stages"]:
            stage["layers"] = list(stage["layers"])
            stage["throughput"] = _finite_or_none(stage["throughput"])
            stage["stage_ms"] = _finite_or_none(stage["stage_ms"])
        data["assignment"] = list(self.assignment)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> Path:
        return write_bytes_atomic(path, (self.to_json() + "\n").encode())

    @classmethod
    def from_dict(cls, data: dict[str, Any], problem: Problem | None = None, file: str | None = None) -> Plan:
        """Parse (and, given `problem`, check) a plan mapping; a mistake is a ConfigError."""
        try:
            raw = _PlanFile.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "<root>"
            expected = str(err["msg"]).removeprefix("Input should be ").lower()
            if err["type"] == "missing":
                expected = "a value (the field is required)"
            got = err.get("input")
            got = got if isinstance(got, str | int | float | bool) and err["type"] != "missing" else None
            raise ConfigError(file, where, expected, got) from None
        stages = tuple(
            PlanStage(
                tuple(s.layers), s.type, s.replicas, _none_to_inf(s.stage_ms), _none_to_inf(s.throughput)
            )
            for s in raw.stages
        )
        plan = cls(
            problem=raw.problem,
            assignment=tuple(raw.assignment),
            stages=stages,
            ps_shards=raw.ps_shards,
            ps_type=raw.ps_type or (problem.ps_resource if problem else ""),
            ps_throughput=_none_to_inf(raw.ps_throughput),
            throughput=_none_to_inf(raw.throughput),
            throughput_min=raw.throughput_min if raw.throughput_min is not None else 0.0,
            cost=_none_to_inf(raw.cost),
            cost_rate=raw.cost_rate,
            feasible=raw.feasible,
            scheduler=raw.scheduler,
            seconds=raw.seconds,
            plans_evaluated=raw.plans_evaluated,
            best_throughput=raw.best_throughput,
            batch_size=raw.batch_size,
            samples=raw.samples,
            extra=raw.extra,
            table_place=raw.table_place,
            table_type=raw.table_type,
            table_ms=raw.table_ms,
            table_hit_rate=raw.table_hit_rate,
            ps_hosted=raw.ps_hosted,
        )
        if problem is not None:
            check_plan(plan, problem, file)
        return plan

    @classmethod
    def from_json(cls, text: str, problem: Problem | None = None, file: str | None = None) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(file, "<file>", f"valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(file, "<file>", "a JSON object", type(data).__name__)
        return cls.from_dict(data, problem, file)

    # -- display -------------------------------------------------------------------------------

    def table(self) -> str:
        """Fixed-width table: a one-line summary, one row per stage and the PS tier, the totals."""
        status = "feasible" if self.feasible else "INFEASIBLE"
        lines = [
            f"plan by {self.scheduler}: {self.plans_evaluated:,} plans evaluated, {status}, "
            f"{self.seconds:.2f} s  [problem {self.problem!r}, floor {_num(self.throughput_min)} samples/s]"
        ]
        header = f"{'stage':<6} {'layers':<28} {'type':<10} {'replicas':>8} {'stage time (ms)':>16} {'throughput (samples/s)':>23}"
        lines += [header, "-" * len(header)]
        for i, s in enumerate(self.stages):
            lines.append(
                f"{i:<6} {_layer_span(s.layers):<28} {s.type:<10} {s.replicas:>8} {_ms(s.stage_ms):>16} {_num(s.throughput):>23}"
            )
        lines.append(self._table_row())
        lines.append("-" * len(header))
        lines.append(
            f"throughput {_num(self.throughput)} samples/s | cost rate {self.cost_rate:,.3f} $/h | "
            f"total cost {_money(self.cost)} $ for {self.samples:,.0f} samples"
        )
        if not self.feasible and self.best_throughput is not None:
            lines.append(f"the highest throughput any plan reaches: {_num(self.best_throughput)} samples/s")
        return "\n".join(lines)


    @property
    def on_disk(self) -> bool:
        """The shard actors keep the rows their RAM does not hold on the PS type's disk."""
        return self.table_place in ("ps", None) and not self.ps_hosted and self.table_hit_rate is not None

    def _table_row(self) -> str:
        """Where the rows live and at what rate: the shard actors' own rate, or, where stage 0 holds
        them (hosted shards, its GPU's memory), its ms a batch for them and the rate that alone allows."""
        if self.table_place in ("ps", None) and not self.ps_hosted:
            what = f"(RAM + disk, {self.table_hit_rate:.1%} RAM hits)" if self.on_disk else "(parameter server)"
            return f"{'ps':<6} {what:<28} {self.ps_type:<10} {self.ps_shards:>8} {'-':>16} {_num(self.ps_throughput):>23}"
        if self.table_place in ("ps", None):
            where, count = f"{self.ps_shards} PS shard(s) in stage 0", self.ps_shards
        else:
            kind = "all rows" if self.table_place == "gpu" else f"cache, {self.table_hit_rate or 0:.1%} hits"
            where, count = f"GPU memory ({kind})", 1
        ms = self.table_ms if self.table_ms is not None else 0.0
        rate = "in stage 0" if ms <= 0 else _num(1000.0 * self.batch_size / ms)
        shown = _ms(ms) if ms > 0 else "-"
        return f"{'table':<6} {where:<28} {self.table_type or self.ps_type:<10} {count:>8} {shown:>16} {rate:>23}"


def check_plan(plan: Plan, problem: Problem, file: str | None = None) -> None:
    """A plan must match its problem: one known type per layer, able to run it, and stages that are
    the maximal runs of its assignment with the problem's layer names."""
    names = problem.type_names
    if len(plan.assignment) != problem.num_layers:
        raise ConfigError(
            file,
            "assignment",
            f"{problem.num_layers} entries, one per layer of {problem.name!r}",
            len(plan.assignment),
        )
    for i, type_name in enumerate(plan.assignment):
        if type_name not in names:
            raise ConfigError(
                file, f"assignment.{i}", f"a resource type of the problem, one of {names}", type_name
            )
        if not problem.can_run(i, type_name):
            raise ConfigError(
                file, f"assignment.{i}", f"a type that can run layer {problem.layers[i].name!r}", type_name
            )
    expected = _runs([names.index(t) for t in plan.assignment])
    if len(plan.stages) != len(expected):
        raise ConfigError(
            file, "stages", f"{len(expected)} stages (maximal runs of the assignment)", len(plan.stages)
        )
    layer_names = problem.layer_names
    for i, (stage, (start, end, t)) in enumerate(zip(plan.stages, expected, strict=True)):
        if list(stage.layers) != layer_names[start:end] or stage.type != names[t]:
            raise ConfigError(
                file,
                f"stages.{i}",
                f"layers {layer_names[start:end]} on {names[t]!r}",
                f"{list(stage.layers)} on {stage.type!r}",
            )
        if stage.replicas < 1:
            raise ConfigError(file, f"stages.{i}.replicas", "at least 1", stage.replicas)
    if plan.ps_type and plan.ps_type != problem.ps_resource:
        raise ConfigError(file, "ps_type", f"the problem's PS resource {problem.ps_resource!r}", plan.ps_type)


def load_plan(path: str | Path, problem: Problem | None = None) -> Plan:
    """Read a plan JSON file; with `problem`, check that it matches (else ConfigError)."""
    text = read_text(path, "a readable plan JSON file")
    return Plan.from_json(text, problem, str(path))


# ---------------------------------------------------------------------------------------------


class _StageFile(BaseModel):
    model_config = ConfigDict(extra="ignore")
    layers: list[str] = Field(min_length=1)
    type: str
    replicas: int = Field(ge=1)
    stage_ms: float | None = None
    throughput: float | None = None


class _PlanFile(BaseModel):
    model_config = ConfigDict(extra="ignore")
    problem: str = ""
    assignment: list[str] = Field(min_length=1)
    stages: list[_StageFile] = Field(min_length=1)
    ps_shards: int = Field(ge=1)
    ps_type: str | None = None
    ps_throughput: float | None = None
    throughput: float | None
    throughput_min: float | None = None
    cost: float | None
    cost_rate: float
    feasible: bool
    scheduler: str
    seconds: float
    plans_evaluated: int = 0
    best_throughput: float | None = None
    batch_size: int = 0
    samples: float = 0.0
    extra: dict[str, Any] = Field(default_factory=dict)
    table_place: Literal["gpu", "gpu_cache", "ps"] | None = None
    table_type: str = ""
    table_ms: float | None = None
    table_hit_rate: float | None = None
    ps_hosted: bool = False


def _runs(assignment: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, type) of each maximal run of equal types: the stages of an assignment."""
    runs, start = [], 0
    for i in range(1, len(assignment) + 1):
        if i == len(assignment) or assignment[i] != assignment[start]:
            runs.append((start, i, assignment[start]))
            start = i
    return runs


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _none_to_inf(x: float | None) -> float:
    return math.inf if x is None else float(x)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "unlimited" if math.isinf(x) else f"{x:,.0f}"


def _ms(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:,.3f}"


def _money(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:,.4f}"


def _layer_span(layers: tuple[str, ...]) -> str:
    text = layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]} ({len(layers)})"
    return text if len(text) <= 28 else text[:25] + "..."
