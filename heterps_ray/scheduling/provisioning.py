"""Exact provisioning (DESIGN.md §3, last paragraph): the cheapest replica and shard counts for a
fixed assignment. Shared by every scheduler.

The pipeline throughput of an optimal plan equals one of the finite candidates
{theta_s(k)} U {theta_ps(m)} (U the cap no count changes, with runtime terms). For each candidate X we
take the smallest counts that reach X, check max_instances, and keep the lowest monetary cost
R * N / Theta / 3600 among plans at or above the floor. Cost, not cost rate: a faster plan with more
replicas can cost less in total.

With runtime terms and ``ps_hosting: auto`` a plan with one replica everywhere hosts its shards in
the DataWorker and is priced so; the tables describe shards on actors, which needs some stage
replicated: a level whose smallest counts are all ones is reached instead by one stage at two
replicas (each stage tried) or by the hosted plan (each shard count tried), all priced by the model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from heterps_ray.costmodel import CostModel, Problem, StageTime
from heterps_ray.costmodel.plan import Plan
from heterps_ray.costmodel.pricing import price_plan

REACH_RTOL = 1e-12  # a count "reaches" X when its throughput is >= X up to float rounding
STEP_RTOL = 1e-9  # the level walks' next level: strictly above the last plan's throughput (relative)


@dataclass(frozen=True)
class Provisioned:
    """The counts chosen for one assignment, and what they give."""

    replicas: tuple[int, ...]  # per stage
    ps_shards: int
    throughput: float  # samples/s
    cost_rate: float  # $/hour
    cost: float  # $
    feasible: bool  # meets the floor within max_instances
    max_throughput: float  # highest throughput this assignment reaches within max_instances (0: none)


def provision_counts(model: CostModel, assignment: Sequence[int | str]) -> Provisioned:
    """Cheapest counts for `assignment` meeting the floor; if none meets it, the fastest counts."""
    a = model.indices(assignment)
    stages = model.stage_times(a)
    S = len(stages)
    cap = model.max_instances
    ps_t, m_min = model.ps_type, model.ps_min_shards
    fallback = Provisioned((1,) * S, m_min, 0.0, math.inf, math.inf, False, 0.0)
    if not all(model.runnable[li, t] for li, t in enumerate(a)):
        return fallback

    # theta_s(k) for k = 1..K_s (the type's instances, less the PS shards' minimum on it). A hosted
    # plan's shards take no instance: where the shard actors leave a stage none, it is the only plan.
    k_max = [int(cap[st.type]) - (m_min if st.type == ps_t else 0) for st in stages]
    shards = np.arange(m_min, int(cap[ps_t]) + 1)  # shard actors a plan may have
    if min(k_max) >= 1 and len(shards):
        counts, m, throughput, cost_rate, reachable = _on_actor_shards(model, stages, k_max, shards)
    else:
        counts, m = np.empty((S, 0), dtype=np.int64), np.empty(0, dtype=np.int64)
        throughput, cost_rate, reachable = np.empty(0), np.empty(0), np.empty(0, dtype=bool)
    problem = model.problem
    if problem.runtime is not None and problem.runtime.ps_hosting == "auto":
        ones = (counts == 1).all(axis=0)
        extra = _hosted_and_bumped(model, a, m[ones & reachable])
        reachable &= ~ones
        ev = [model.evaluate(a, list(k), int(n)) for k, n in extra]
        counts = np.concatenate([counts, np.array([k for k, _ in extra]).T], axis=1)
        m = np.concatenate([m, [n for _, n in extra]])
        throughput = np.concatenate([throughput, [e.throughput for e in ev]])
        cost_rate = np.concatenate([cost_rate, [e.cost_rate for e in ev]])
        reachable = np.concatenate([reachable, [e.available for e in ev]])
    if not reachable.any():
        return fallback

    price = price_plan([throughput], cost_rate, model.samples, model.floor)
    cost = price.cost
    ok = reachable & price.meets_floor
    max_throughput = float(throughput[reachable].max())
    if ok.any():
        # lowest cost; ties -> lower cost rate
        order = np.lexsort((cost_rate, np.where(ok, cost, np.inf)))
    else:
        # the fastest reachable counts; ties -> lower cost
        order = np.lexsort((cost, np.where(reachable, -throughput, np.inf)))
    i = int(order[0])
    return Provisioned(
        replicas=tuple(int(k) for k in counts[:, i]),
        ps_shards=int(m[i]),
        throughput=float(throughput[i]),
        cost_rate=float(cost_rate[i]),
        cost=float(cost[i]),
        feasible=bool(ok[i]),
        max_throughput=max_throughput,
    )


def _on_actor_shards(
    model: CostModel, stages: Sequence[StageTime], k_max: list[int], shards: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate throughput X (every θ_s(k), θ_ps(m) and the cap no count changes) the fewest
    counts on shard actors reaching it: (replicas [S, X], shards, throughput, $/hour, within the
    types' instances)."""
    cap, ps_t = model.max_instances, model.ps_type
    tables, ceiling = model.throughput_tables(stages, k_max)
    ps_table = np.array([model.ps_throughput(int(m)) for m in shards])
    candidates = np.unique(
        np.concatenate(tables + [ps_table] + ([[ceiling]] if math.isfinite(ceiling) else []))
    )
    target = candidates * (1.0 - REACH_RTOL)
    reachable = np.ones(len(candidates), dtype=bool)
    usage = np.zeros((len(candidates), model.num_types), dtype=np.int64)
    throughput = np.full(len(candidates), np.inf)
    cost_rate = np.zeros(len(candidates))
    counts = np.empty((len(stages), len(candidates)), dtype=np.int64)
    for s, (st, table) in enumerate(zip(stages, tables, strict=True)):
        idx = np.searchsorted(table, target, side="left")  # tables increase with k
        reachable &= idx < len(table)
        idx = np.minimum(idx, len(table) - 1)
        counts[s] = idx + 1
        usage[:, st.type] += idx + 1
        throughput = np.minimum(throughput, table[idx])
        cost_rate += (idx + 1) * model.price[st.type]
    if model.rows_per_sample > 0.0:
        idx = np.searchsorted(ps_table, target, side="left")
        reachable &= idx < len(ps_table)
        idx = np.minimum(idx, len(ps_table) - 1)
    else:
        idx = np.zeros(len(candidates), dtype=np.int64)  # the PS never limits: its minimum suffices
    m = shards[idx]
    usage[:, ps_t] += m
    throughput = np.minimum(np.minimum(throughput, ps_table[idx]), ceiling)
    cost_rate += m * model.price[ps_t]
    reachable &= (usage <= cap).all(axis=1)
    return counts, m, throughput, cost_rate, reachable


def _hosted_and_bumped(
    model: CostModel, assignment: list[int], shards_at: np.ndarray
) -> list[tuple[tuple[int, ...], int]]:
    """The plans that replace all-ones counts on actor shards: the hosted plan (its fewest shards:
    hosted shards take no instance and bound nothing, so more change nothing), and, for each shard
    count `shards_at` a level asked for with all ones, each stage bumped to two replicas."""
    S = len(model.split_stages(assignment))
    plans = {((1,) * S, int(model.ps_min_shards))}
    for n in np.unique(shards_at):
        for j in range(S):
            plans.add((tuple(2 if i == j else 1 for i in range(S)), int(n)))
    return sorted(plans)


def provision(
    problem: Problem,
    assignment: Sequence[int | str],
    *,
    scheduler: str = "provision",
    model: CostModel | None = None,
) -> Plan:
    """The cheapest plan for a fixed assignment (type names or indices per layer), as a Plan."""
    started = time.perf_counter()
    model = model or CostModel(problem)
    counts = provision_counts(model, assignment)
    return plan_from_counts(
        problem, model, assignment, counts, scheduler=scheduler, seconds=time.perf_counter() - started
    )


def plan_from_counts(
    problem: Problem,
    model: CostModel,
    assignment: Sequence[int | str],
    counts: Provisioned,
    *,
    scheduler: str,
    seconds: float,
    plans_evaluated: int = 1,
    best_throughput: float | None = None,
    extra: dict | None = None,
) -> Plan:
    """Price the provisioned plan with the cost model and wrap it as a Plan."""
    evaluation = model.evaluate(assignment, list(counts.replicas), counts.ps_shards)
    return Plan.from_evaluation(
        problem,
        evaluation,
        scheduler=scheduler,
        seconds=seconds,
        plans_evaluated=plans_evaluated,
        best_throughput=best_throughput if best_throughput is not None else None,
        extra=extra,
    )
