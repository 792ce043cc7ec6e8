"""heterps_ray.costmodel — the scheduling problem and the analytic cost model (DESIGN.md §2–4)."""

from heterps_ray.costmodel.analytic import (
    BatchEvaluation,
    CostModel,
    Evaluation,
    StageEvaluation,
    StageTime,
    monetary_cost,
    stage_throughput,
)
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
    "Problem",
    "Resource",
    "RuntimeTerms",
    "as_executed",
    "StageEvaluation",
    "StageTime",
    "load_problem",
    "monetary_cost",
    "one_replica_per_stage",
    "problem_from_dict",
    "stage_throughput",
]
