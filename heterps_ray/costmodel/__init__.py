"""heterps_ray.costmodel — the scheduling problem, the plan, and the cost model (DESIGN.md §2–4) with
its runtime terms (§3b). Problem and Plan are the types the other parts pass each other."""

from heterps_ray.costmodel.analytic import (
    BatchEvaluation,
    CostModel,
    Evaluation,
    StageEvaluation,
    StageTime,
    evaluate_plan,
    stage_throughput,
)
from heterps_ray.costmodel.plan import Plan, PlanStage, check_plan, load_plan
from heterps_ray.costmodel.pricing import Priced, meets_floor, monetary_cost, price_plan
from heterps_ray.costmodel.problem import (
    Layer,
    LayerTime,
    Problem,
    PSTier,
    Resource,
    RuntimeTerms,
    as_executed,
    load_problem,
    one_replica_per_stage,
    problem_from_dict,
)

__all__ = [
    "BatchEvaluation",
    "CostModel",
    "Evaluation",
    "Layer",
    "LayerTime",
    "PSTier",
    "Plan",
    "PlanStage",
    "Problem",
    "Resource",
    "RuntimeTerms",
    "as_executed",
    "check_plan",
    "StageEvaluation",
    "StageTime",
    "evaluate_plan",
    "load_plan",
    "load_problem",
    "meets_floor",
    "monetary_cost",
    "price_plan",
    "Priced",
    "one_replica_per_stage",
    "problem_from_dict",
    "stage_throughput",
]
