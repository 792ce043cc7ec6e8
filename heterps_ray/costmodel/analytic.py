"""The analytic cost model of DESIGN.md §3: stage times, pipeline throughput, cost rate and cost
(assembled by pricing.price_plan, the one place a plan's price is put together).

A problem with a `runtime` section is priced with the runtime terms of §3b (runtime_terms.py): the
throughput the runtime achieves, not the base model's pipeline of free messages on dedicated cores.
Every scheduler optimises this one model and a plan promises what it says.

Two ways to price plans, which agree exactly (tests check it):
* :meth:`CostModel.evaluate` — one plan, plain Python over plain numbers, easy to read;
* :meth:`CostModel.evaluate_batch` — many plans at once with numpy (measured ~1.5e5 plans/s for
  10 layers, ~3e5 for 6, on the shared 2-core dev box), for search and for the RL environment.

A plan is an assignment (resource type index per layer), replicas per stage and PS shards.
A stage is a maximal run of consecutive layers on the same type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from heterps_ray.costmodel.formulas import (
    boundary_ms,
    input_ms,
    layer_ms,
    ps_throughput,
    stage_throughput,
)
from heterps_ray.costmodel.pricing import price_plan
from heterps_ray.costmodel.problem import Problem

if TYPE_CHECKING:
    from heterps_ray.costmodel.plan import Plan
from heterps_ray.costmodel.runtime_terms import RuntimeLimits, limits, throughput_tables

# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class StageTime:
    """A stage's layers [start, end), its type index, its one-replica time and parallel fraction."""

    start: int
    end: int
    type: int
    tau_ms: float
    alpha: float


@dataclass(frozen=True)
class StageEvaluation:
    start: int
    end: int
    type: int
    replicas: int
    tau_ms: float
    alpha: float
    throughput: float  # samples/s with `replicas` replicas


@dataclass(frozen=True)
class Evaluation:
    """One plan priced by the cost model."""

    stages: tuple[StageEvaluation, ...]
    ps_shards: int
    ps_throughput: float  # samples/s
    throughput: float  # samples/s, the pipeline's
    cost_rate: float  # $/hour
    cost: float  # $ for all `samples`
    instances: tuple[int, ...]  # per resource type, stages' replicas + PS shards
    runnable: bool  # every layer on a type that can run it
    available: bool  # max_instances respected, replicas >= 1, ps_shards >= min_shards
    meets_floor: bool
    runtime: RuntimeLimits | None = None  # the runtime terms (DESIGN.md §3b), when the problem has them

    @property
    def bound(self) -> str:
        """What limits the throughput: 'stage j', 'ps', and with runtime terms 'loop' or 'host'."""
        if self.runtime is not None:
            return self.runtime.bound(math.inf if self.runtime.ps_hosted else self.ps_throughput)
        terms = {f"stage {j}": s.throughput for j, s in enumerate(self.stages)}
        terms["ps"] = self.ps_throughput
        return min(terms, key=lambda name: terms[name])

    @property
    def feasible(self) -> bool:
        return self.runnable and self.available and self.meets_floor

    @property
    def replicas(self) -> list[int]:
        return [s.replicas for s in self.stages]


@dataclass(frozen=True)
class BatchEvaluation:
    """Many plans priced at once; every array has one entry per plan."""

    throughput: np.ndarray  # float64[P] samples/s (0 where not runnable)
    cost_rate: np.ndarray  # float64[P] $/hour
    cost: np.ndarray  # float64[P] $ (inf where throughput is 0)
    num_stages: np.ndarray  # int64[P]
    runnable: np.ndarray  # bool[P]
    available: np.ndarray  # bool[P]
    meets_floor: np.ndarray  # bool[P]

    @property
    def feasible(self) -> np.ndarray:
        return self.runnable & self.available & self.meets_floor


# ---------------------------------------------------------------------------------------------
# The model


class CostModel:
    """DESIGN.md §3 for one problem. Assignments are resource type indices (or names) per layer."""

    def __init__(self, problem: Problem):
        self.problem = problem
        B = problem.batch_size
        self.batch_size = B
        self.samples = float(problem.samples)
        self.floor = float(problem.throughput_min)
        self.num_layers, self.num_types = problem.num_layers, problem.num_types
        types = problem.resources
        self.price = np.array([r.price_per_hour for r in types], dtype=np.float64)  # $/hour
        self.max_instances = np.array([r.max_instances for r in types], dtype=np.int64)
        self.runnable = np.array(
            [[r.name in layer.time_ms for r in types] for layer in problem.layers], dtype=bool
        )  # [L, T]
        # c(l,t) in ms; inf where the type cannot run the layer
        self.compute_ms = np.full((self.num_layers, self.num_types), np.inf)
        self.fixed_ms = np.full((self.num_layers, self.num_types), np.inf)
        self.per_sample_ms = np.full((self.num_layers, self.num_types), np.inf)
        for li, layer in enumerate(problem.layers):
            for t, r in enumerate(types):
                if r.name in layer.time_ms:
                    lt = layer.time_ms[r.name]
                    self.compute_ms[li, t] = layer_ms(lt.fixed, lt.per_sample, B)
                    self.fixed_ms[li, t], self.per_sample_ms[li, t] = lt.fixed, lt.per_sample
        self.parallel_fraction = np.array([layer.parallel_fraction for layer in problem.layers])
        # boundary_ms[l, t]: one side's time (type t) on the boundary after layer l
        self.boundary_ms = np.array(
            [
                [boundary_ms(layer.out_bytes_per_sample, B, r.bandwidth_gbps, r.latency_ms) for r in types]
                for layer in problem.layers
            ]
        )
        self.input_ms = np.array([input_ms(problem.input_bytes_per_sample, B, r.io_gbps) for r in types])
        self.ps_type = problem.type_index(problem.ps_resource)
        self.ps_min_shards = problem.ps_min_shards
        self.ps_rows_per_second = problem.ps_rows_per_second  # rows/s per shard
        self.rows_per_sample = float(sum(layer.sparse_rows_per_sample for layer in problem.layers))
        self.compute_safe = np.where(self.runnable, self.compute_ms, 0.0)

    # -- stages --------------------------------------------------------------------------------

    def indices(self, assignment: Sequence[int | str] | np.ndarray) -> list[int]:
        """Type indices per layer from indices or names."""
        if len(assignment) != self.num_layers:
            raise ValueError(
                f"assignment has {len(assignment)} entries, the problem {self.num_layers} layers"
            )
        names = self.problem.type_names
        return [names.index(a) if isinstance(a, str) else int(a) for a in assignment]

    def split_stages(self, assignment: Sequence[int | str]) -> list[tuple[int, int, int]]:
        """(start, end, type) of each maximal run of equal types."""
        a = self.indices(assignment)
        stages, start = [], 0
        for li in range(1, self.num_layers + 1):
            if li == self.num_layers or a[li] != a[start]:
                stages.append((start, li, a[start]))
                start = li
        return stages

    def segment_time(self, start: int, end: int, t: int) -> StageTime:
        """tau and alpha of layers [start, end) as one stage on type t (inf tau if t cannot run one)."""
        c = self.compute_ms[start:end, t]
        compute = float(c.sum())
        tau = compute
        if start > 0:
            tau += float(self.boundary_ms[start - 1, t])
        if end < self.num_layers:
            tau += float(self.boundary_ms[end - 1, t])
        if start == 0:
            tau += float(self.input_ms[t])
        if math.isfinite(compute) and compute > 0.0:
            alpha = float((c * self.parallel_fraction[start:end]).sum()) / compute
        else:
            alpha = 1.0  # no compute: nothing to weight; boundary work is taken as parallel
        return StageTime(start, end, t, tau, alpha)

    def stage_times(self, assignment: Sequence[int | str]) -> list[StageTime]:
        return [self.segment_time(s, e, t) for s, e, t in self.split_stages(assignment)]

    def ps_throughput(self, shards: int) -> float:
        return ps_throughput(shards, self.ps_rows_per_second, self.rows_per_sample)

    def throughput_tables(
        self, stages: Sequence[StageTime], max_replicas: Sequence[int]
    ) -> tuple[list[np.ndarray], float]:
        """Per stage, its throughput with 1..max replicas, and a cap on the plan no count changes
        (inf in the base model); with runtime terms, for shards on actors (runtime_terms.py)."""
        if self.problem.runtime is not None:
            spans = [(s.start, s.end, s.type) for s in stages]
            return throughput_tables(self, spans, [s.alpha for s in stages], max_replicas)
        tables = []
        for st, k_max in zip(stages, max_replicas, strict=True):
            tables.append(stage_throughput(self.batch_size, st.tau_ms, st.alpha, np.arange(1, k_max + 1)))
        return tables, math.inf

    def segment_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """tau[i, j, t] and alpha[i, j, t] of layers i..j (inclusive) as one stage on type t.

        inf tau where j < i or t cannot run one of the layers. Used by exact search.
        """
        L, T = self.num_layers, self.num_types
        zero = np.zeros((1, T))
        pre_c = np.concatenate([zero, np.cumsum(self.compute_safe, axis=0)])  # [L+1, T]
        pre_cp = np.concatenate(
            [zero, np.cumsum(self.compute_safe * self.parallel_fraction[:, None], axis=0)]
        )
        pre_bad = np.concatenate([np.zeros((1, T), int), np.cumsum(~self.runnable, axis=0)])
        i, j = np.arange(L)[:, None], np.arange(L)[None, :]
        compute = pre_c[j + 1] - pre_c[i]  # [L, L, T] (rows i, cols j)
        weighted = pre_cp[j + 1] - pre_cp[i]
        bad = (pre_bad[j + 1] - pre_bad[i]) > 0
        i, j = i[:, :, None], j[:, :, None]
        left = np.where(i > 0, self.boundary_ms[np.maximum(i[:, :, 0] - 1, 0)], self.input_ms[None, None, :])
        right = np.where(j < L - 1, self.boundary_ms[j[:, :, 0]], 0.0)
        tau = compute + left + right
        with np.errstate(invalid="ignore", divide="ignore"):
            alpha = np.where(compute > 0.0, weighted / compute, 1.0)
        tau = np.where(bad | (j < i), np.inf, tau)
        return tau, alpha

    # -- one plan ------------------------------------------------------------------------------

    def evaluate(
        self, assignment: Sequence[int | str], replicas: Sequence[int] | int, ps_shards: int
    ) -> Evaluation:
        """Price one plan: `replicas` per stage (or one count for every stage), `ps_shards` PS shards."""
        a = self.indices(assignment)
        stages = self.stage_times(a)
        counts = [int(replicas)] * len(stages) if isinstance(replicas, int | np.integer) else list(replicas)
        if len(counts) != len(stages):
            raise ValueError(f"{len(counts)} replica counts for {len(stages)} stages")
        runnable = all(self.runnable[li, t] for li, t in enumerate(a))
        terms = None
        if self.problem.runtime is not None and runnable and all(k >= 1 for k in counts):
            terms = limits(
                self, [(s.start, s.end, s.type) for s in stages], counts, [s.alpha for s in stages]
            )
        # shards hosted in DataWorker 0's process start no PS instance: none is paid or counted
        shard_actors = 0 if terms is not None and terms.ps_hosted else int(ps_shards)
        instances = [0] * self.num_types
        instances[self.ps_type] += shard_actors
        priced: list[StageEvaluation] = []
        cost_rate = shard_actors * float(self.price[self.ps_type])
        for st, k in zip(stages, counts, strict=True):
            instances[st.type] += int(k)
            cost_rate += k * float(self.price[st.type])
            tau = st.tau_ms if terms is None else terms.stage_ms[len(priced)]
            if terms is not None:
                theta = terms.stage_throughput[len(priced)]
            else:
                theta = stage_throughput(self.batch_size, tau, st.alpha, k) if k >= 1 else 0.0
            priced.append(StageEvaluation(st.start, st.end, st.type, int(k), tau, st.alpha, theta))
        theta_ps = self.ps_throughput(ps_shards)
        caps = [s.throughput for s in priced]
        if terms is None or not terms.ps_hosted:  # hosted shards: the DataWorker's own time has their work
            caps.append(theta_ps)
        if terms is not None:
            caps += [terms.loop_throughput, terms.host_throughput]
        price = price_plan(caps, cost_rate, self.samples, self.floor, runnable)
        available = (
            all(k >= 1 for k in counts)
            and ps_shards >= self.ps_min_shards
            and all(n <= cap for n, cap in zip(instances, self.max_instances.tolist(), strict=True))
        )
        return Evaluation(
            stages=tuple(priced),
            ps_shards=int(ps_shards),
            ps_throughput=theta_ps,
            throughput=price.throughput,
            cost_rate=price.cost_rate,
            cost=price.cost,
            instances=tuple(instances),
            runnable=runnable,
            available=available,
            meets_floor=price.meets_floor,
            runtime=terms,
        )

    # -- many plans ----------------------------------------------------------------------------

    def evaluate_batch(
        self, assignments: np.ndarray, replicas: np.ndarray, ps_shards: np.ndarray | int
    ) -> BatchEvaluation:
        """Price P plans at once.

        assignments: int[P, L] type index per layer; replicas: int[P, L], the j-th entry is the
        replica count of the j-th stage (entries past the plan's last stage are ignored) — or
        int[P] / int, one count for every stage; ps_shards: int[P] or int.
        """
        a = np.asarray(assignments, dtype=np.int64)
        P, L = a.shape
        if L != self.num_layers:
            raise ValueError(f"assignments have {L} layers, the problem {self.num_layers}")
        k = np.asarray(replicas, dtype=np.int64)
        if k.ndim < 2:
            k = np.broadcast_to(k.reshape(-1, 1) if k.ndim == 1 else k, (P, L))
        m = np.broadcast_to(np.asarray(ps_shards, dtype=np.int64), (P,))
        if self.problem.runtime is not None:
            return self._evaluate_each(a, k, m)
        layer = np.arange(L)

        runnable_lt = self.runnable[layer, a]  # [P, L]
        c = self.compute_safe[layer, a]
        start = np.ones((P, L), dtype=bool)
        start[:, 1:] = a[:, 1:] != a[:, :-1]
        end = np.ones((P, L), dtype=bool)
        end[:, :-1] = start[:, 1:]
        # time on boundaries: the sender side after its last layer, the receiver side before its first
        extra = np.where(end, self.boundary_ms[layer, a], 0.0)
        extra[:, -1] = 0.0
        extra[:, 1:] += np.where(start[:, 1:], self.boundary_ms[layer[:-1], a[:, 1:]], 0.0)
        extra[:, 0] += self.input_ms[a[:, 0]]

        stage_id = np.cumsum(start, axis=1) - 1
        flat = (stage_id + (np.arange(P) * L)[:, None]).ravel()
        tau = np.bincount(flat, (c + extra).ravel(), P * L).reshape(P, L)
        compute = np.bincount(flat, c.ravel(), P * L).reshape(P, L)
        weighted = np.bincount(flat, (c * self.parallel_fraction).ravel(), P * L).reshape(P, L)
        stage_type = np.zeros(P * L, dtype=np.int64)
        stage_type[flat[start.ravel()]] = a[start]
        stage_type = stage_type.reshape(P, L)

        num_stages = stage_id[:, -1] + 1
        valid = layer[None, :] < num_stages[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            alpha = np.where(compute > 0.0, weighted / compute, 1.0)
            k_safe = np.maximum(k, 1)
            theta = stage_throughput(self.batch_size, tau, alpha, k_safe)
        theta = np.where(valid, np.where(k >= 1, theta, 0.0), np.inf)
        if self.rows_per_sample > 0.0:
            theta_ps = m * self.ps_rows_per_second / self.rows_per_sample
        else:
            theta_ps = np.full(P, np.inf)
        runnable = runnable_lt.all(axis=1)

        k_valid = np.where(valid, k, 0)
        cost_rate = (k_valid * self.price[stage_type]).sum(axis=1) + m * self.price[self.ps_type]
        price = price_plan([theta.min(axis=1), theta_ps], cost_rate, self.samples, self.floor, runnable)
        type_flat = (stage_type + (np.arange(P) * self.num_types)[:, None]).ravel()
        instances = np.bincount(type_flat, k_valid.ravel(), P * self.num_types).reshape(P, self.num_types)
        instances[:, self.ps_type] += m
        available = (
            (instances <= self.max_instances).all(axis=1)
            & (m >= self.ps_min_shards)
            & ((k >= 1) | ~valid).all(axis=1)
        )
        return BatchEvaluation(
            throughput=price.throughput,
            cost_rate=cost_rate,
            cost=price.cost,
            num_stages=num_stages,
            runnable=np.asarray(runnable),
            available=available,
            meets_floor=price.meets_floor,
        )

    def _evaluate_each(self, a: np.ndarray, k: np.ndarray, m: np.ndarray) -> BatchEvaluation:
        """evaluate_batch with runtime terms: one plan at a time (their terms couple the stages)."""
        evaluations = []
        for plan in range(len(a)):
            num_stages = len(self.split_stages(a[plan]))
            evaluations.append(self.evaluate(a[plan], k[plan, :num_stages].tolist(), int(m[plan])))
        return BatchEvaluation(
            throughput=np.array([e.throughput for e in evaluations], dtype=np.float64),
            cost_rate=np.array([e.cost_rate for e in evaluations], dtype=np.float64),
            cost=np.array([e.cost for e in evaluations], dtype=np.float64),
            num_stages=np.array([len(e.stages) for e in evaluations], dtype=np.int64),
            runnable=np.array([e.runnable for e in evaluations], dtype=bool),
            available=np.array([e.available for e in evaluations], dtype=bool),
            meets_floor=np.array([e.meets_floor for e in evaluations], dtype=bool),
        )


def evaluate_plan(plan: Plan, problem: Problem) -> Evaluation:
    """Re-price `plan` with the cost model of `problem` (which it must match: check_plan)."""
    from heterps_ray.costmodel.plan import check_plan

    check_plan(plan, problem)
    return CostModel(problem).evaluate(list(plan.assignment), plan.replicas, plan.ps_shards)
