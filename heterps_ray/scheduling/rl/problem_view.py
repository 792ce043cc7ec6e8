"""One problem as the scheduling env sees it (:class:`ProblemView`): its cost model, the per-(layer, type)
and context features of the observation (their names keep its width in one place), the reference
plans the reward is relative to, and the provisioned assignments met so far; and one finished
episode (:class:`EpisodeResult`). Computed once per problem, shared by every episode on it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from heterps_ray.costmodel import CostModel, Problem
from heterps_ray.scheduling.provisioning import Provisioned, provision_counts

REWARD_CLIP = 3.0  # |log cost ratio| beyond e^3 = 20x carries no more information
OBS_CLIP = 10.0  # every feature is clipped to +-this
_MAX_MEMO = 50_000  # provisioned assignments remembered per problem

# Per (layer, type) features; the names document the observation and keep its width in one place.
_STATIC_TYPE_FEATURES = (  # static per problem (ProblemView._static_features)
    "present",  # the type exists in this problem (padding rows are all zero)
    "can_run",  # the type can run the current layer
    "compute",  # log1p(c(l,t) / budget): replicas the layer alone needs at alpha = 1
    "dollar_ratio",  # log(price*c on t / cheapest price*c over types) for this layer, 0 = cheapest
    "dollar_share",  # log1p(price*c/budget / rate_scale): the layer's weight in the bill
    "cut_after",  # log1p(boundary time after this layer on t / budget): price of ending a stage here
    "next_can_run",  # the type can run the next layer (0 after the last)
    "next_dollar_ratio",  # dollar_ratio of the next layer
    "next_compute",  # compute of the next layer
    "rest_can_run",  # fraction of the remaining layers (this one included) the type can run
    "rest_dollar_ratio",  # log(sum price*c of the remaining layers on t / sum of their cheapest)
    "price",  # price / the problem's highest price
    "capacity",  # log(max_instances) / log(256)
    "bandwidth",  # log(bandwidth / the problem's highest bandwidth)
    "input",  # log1p(input read time on t / budget), first layer only
    "is_ps",  # the PS shards run on this type
)
_DYNAMIC_TYPE_FEATURES = (  # depend on the decisions so far (SchedulingEnv._observation)
    "same_as_prev",  # choosing t continues the current stage
    "stage_time",  # log1p(time of the stage this layer would join or open / budget)
    "stage_replicas",  # log1p(replicas that stage needs at the floor, Amdahl)
    "switch_cost",  # log1p(boundary time both sides pay when switching here / budget)
    "used",  # instances already committed on t / max_instances
    "headroom",  # (max_instances - committed - needed by this choice) / max_instances, clipped
    "marginal_rate",  # estimated $/h this choice adds / rate_scale
)
# the runtime terms (DESIGN.md §3b; all zero for a problem without them) and the table's place: static
# per problem (ProblemView._runtime_features)
_RUNTIME_TYPE_FEATURES = (
    "call_cost",  # log1p(one call's round trip to a stage on t / budget)
    "limits_ahead",  # log1p(replicas the remaining layers would need on t at alpha = 1 / max_instances)
    "table_gpu",  # share of lookups t's GPU memory serves when a one-replica plan starts on t (0: shards)
    "table_ms",  # log1p(the table's ms per batch to a stage 0 on t, hosting its shards / budget)
    "table_memory",  # log1p(the table's rows / the rows t's GPU memory holds; 0: no GPU tier)
)
TYPE_FEATURES = _STATIC_TYPE_FEATURES + _DYNAMIC_TYPE_FEATURES + _RUNTIME_TYPE_FEATURES
_BASE_CONTEXT_FEATURES = (
    "progress",  # layers done / layers
    "layers",  # layers / 30
    "types",  # types / 5
    "first",  # this is the first layer
    "parallel_fraction",  # Amdahl alpha of the current layer
    "stage_alpha",  # alpha of the current stage so far (1 when none)
    "stage_length",  # layers in the current stage / layers
    "stage_replicas",  # log1p(replicas the current stage needs so far)
)
_RUNTIME_CONTEXT_FEATURES = (  # static per problem (ProblemView._runtime_features)
    "runtime",  # the problem has runtime terms
    "asynchronous",  # its runtime trains async
    "micro_batches",  # log2(micro-batches per batch) / 4
    "hosting",  # a one-replica plan hosts its shards in the DataWorker (ps_hosting auto)
)
CONTEXT_FEATURES = _BASE_CONTEXT_FEATURES + _RUNTIME_CONTEXT_FEATURES
STATIC_WIDTH, DYNAMIC_WIDTH = len(_STATIC_TYPE_FEATURES), len(_DYNAMIC_TYPE_FEATURES)


@dataclass(frozen=True)
class EpisodeResult:
    """One finished episode: the assignment (type indices) and what exact provisioning made of it."""

    assignment: tuple[int, ...]
    provisioned: Provisioned
    reward: float

    @property
    def feasible(self) -> bool:
        return self.provisioned.feasible

    @property
    def cost(self) -> float:
        return self.provisioned.cost if self.provisioned.feasible else math.inf


def better(a: EpisodeResult | None, b: EpisodeResult) -> bool:
    """Is `b` better than `a`: feasible beats infeasible; then lower cost; infeasible: faster."""
    if a is None:
        return True
    if a.feasible != b.feasible:
        return b.feasible
    if b.feasible:
        return b.provisioned.cost < a.provisioned.cost
    return b.provisioned.max_throughput > a.provisioned.max_throughput


class ProblemView:
    """Everything the env needs about one problem, computed once: cost model, static features, reference."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.model = model = CostModel(problem)
        self.num_layers, self.num_types = model.num_layers, model.num_types
        # the floor's time budget: ms per batch one replica may take (inf without a floor)
        self.budget_ms = 1000.0 * model.batch_size / model.floor if model.floor > 0 else math.inf
        self._cache: dict[tuple[int, ...], Provisioned] = {}
        self.evaluations = 0
        self.best: EpisodeResult | None = None
        self.ps_shards_needed = self._ps_shards_needed()
        # feature scale: the budget, or the slowest layer when there is no floor
        self.scale_ms = (
            self.budget_ms if math.isfinite(self.budget_ms) else max(float(model.compute_safe.max()), 1e-9)
        )
        self.rate_scale = self._rate_lower_bound()
        self.reference_cost = self._reference_cost()
        self.static = self._static_features()  # [L, T, STATIC_WIDTH]
        self.runtime_static, self.runtime_context = self._runtime_features()
        self.mask = model.runnable.astype(np.float32)  # [L, T]

    # -- evaluation ----------------------------------------------------------------------------

    def provision(self, assignment: Sequence[int]) -> Provisioned:
        """Exact provisioning of an assignment, memoised (PPO revisits assignments often)."""
        key = tuple(int(t) for t in assignment)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= _MAX_MEMO:
                self._cache.clear()  # bounded memory over long pretraining runs; `best` is kept
            hit = self._cache[key] = provision_counts(self.model, key)
            self.evaluations += 1
        return hit

    def reward(self, provisioned: Provisioned) -> float:
        if provisioned.feasible:
            if self.reference_cost is None:
                self.reference_cost = provisioned.cost  # the first feasible plan becomes the reference
            if provisioned.cost <= 0.0 or self.reference_cost <= 0.0:
                return REWARD_CLIP if provisioned.cost < self.reference_cost else 0.0
            return float(np.clip(math.log(self.reference_cost / provisioned.cost), -REWARD_CLIP, REWARD_CLIP))
        reached = provisioned.max_throughput
        shortfall = REWARD_CLIP if reached <= 0.0 else min(REWARD_CLIP, math.log(self.model.floor / reached))
        return -REWARD_CLIP - max(shortfall, 0.0)

    def record(self, assignment: Sequence[int]) -> EpisodeResult:
        provisioned = self.provision(assignment)
        result = EpisodeResult(tuple(int(t) for t in assignment), provisioned, self.reward(provisioned))
        if better(self.best, result):
            self.best = result
        return result

    def top(self, k: int) -> list[EpisodeResult]:
        """The k best distinct assignments evaluated so far (feasible by cost, then the fastest)."""
        results = [EpisodeResult(a, p, 0.0) for a, p in self._cache.items()]
        feasible = sorted(
            (r for r in results if r.feasible), key=lambda r: (r.provisioned.cost, r.assignment)
        )
        if feasible:
            return feasible[:k]
        return sorted(results, key=lambda r: (-r.provisioned.max_throughput, r.assignment))[:k]

    def fastest_seen(self) -> float:
        """The highest throughput any assignment evaluated so far reaches (0 when none runs)."""
        return max((p.max_throughput for p in self._cache.values()), default=0.0)

    def merge(self, other: ProblemView) -> None:
        """Take over another view's evaluations (the same problem seen by another env)."""
        for assignment, provisioned in other._cache.items():
            if assignment not in self._cache:
                self._cache[assignment] = provisioned
                self.evaluations += 1
        if other.best is not None and better(self.best, other.best):
            self.best = other.best

    # -- set-up --------------------------------------------------------------------------------

    def _ps_shards_needed(self) -> int:
        m = self.model
        if m.rows_per_sample <= 0.0 or math.isinf(m.ps_rows_per_second):
            return m.ps_min_shards
        return max(m.ps_min_shards, math.ceil(m.floor * m.rows_per_sample / m.ps_rows_per_second))

    def _rate_lower_bound(self) -> float:
        """$/h if every layer ran on its cheapest type with fractional replicas: the unit of $ features."""
        m = self.model
        dollars = np.where(m.runnable, m.compute_ms * m.price[None, :], np.inf).min(axis=1) / self.scale_ms
        rate = float(dollars.sum()) + self.ps_shards_needed * float(m.price[m.ps_type])
        return max(rate, 1e-9)

    def _reference_cost(self) -> float | None:
        m = self.model
        names = self.problem.type_names
        candidates = {
            f"single:{names[t]}": [t] * self.num_layers
            for t in range(self.num_types)
            if m.runnable[:, t].all()
        }
        compute = np.where(m.runnable, m.compute_ms, np.inf)
        candidates["cheapest_per_layer"] = np.argmin(compute * m.price[None, :], axis=1).tolist()
        candidates["fastest_per_layer"] = np.argmin(compute, axis=1).tolist()
        self.reference_assignments = candidates
        best = None
        for assignment in candidates.values():
            p = self.provision(assignment)
            if p.feasible and (best is None or p.cost < best.cost):
                best = p
        return None if best is None else best.cost

    def _static_features(self) -> np.ndarray:
        m, L, T = self.model, self.num_layers, self.num_types
        budget = self.scale_ms
        runnable = m.runnable
        compute = np.where(runnable, m.compute_ms, 0.0) / budget  # [L, T]
        dollar = compute * m.price[None, :]
        cheapest = np.where(runnable, dollar, np.inf).min(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(runnable, np.log(np.maximum(dollar, 1e-12) / np.maximum(cheapest, 1e-12)), 0.0)
        share = np.log1p(dollar / self.rate_scale)
        # remaining layers l..L-1: suffix sums
        rest_runnable = np.cumsum(runnable[::-1], axis=0)[::-1] / np.arange(L, 0, -1)[:, None]
        rest_dollar = np.cumsum(np.where(runnable, dollar, 0.0)[::-1], axis=0)[::-1]
        rest_cheapest = np.cumsum(np.where(np.isfinite(cheapest), cheapest, 0.0)[::-1], axis=0)[::-1]
        rest_ratio = np.log(np.maximum(rest_dollar, 1e-12) / np.maximum(rest_cheapest, 1e-12))

        f = np.zeros((L, T, STATIC_WIDTH), dtype=np.float64)
        f[:, :T, 0] = 1.0
        f[:, :T, 1] = runnable
        f[:, :T, 2] = np.log1p(compute)
        f[:, :T, 3] = ratio
        f[:, :T, 4] = share
        f[:, :T, 5] = np.log1p(m.boundary_ms / budget)
        f[:-1, :T, 6] = runnable[1:]
        f[:-1, :T, 7] = ratio[1:]
        f[:-1, :T, 8] = np.log1p(compute[1:])
        f[:, :T, 9] = rest_runnable
        f[:, :T, 10] = np.clip(rest_ratio, 0.0, OBS_CLIP)
        top_price = max(float(m.price.max()), 1e-12)
        f[:, :T, 11] = m.price / top_price
        f[:, :T, 12] = np.log(m.max_instances) / math.log(256.0)
        bandwidth = np.array([r.bandwidth_gbps for r in self.problem.resources])
        f[:, :T, 13] = np.log(bandwidth / bandwidth.max())
        f[0, :T, 14] = np.log1p(m.input_ms / budget)
        f[:, m.ps_type, 15] = 1.0
        return np.clip(f, -OBS_CLIP, OBS_CLIP)

    def _runtime_features(self) -> tuple[np.ndarray, np.ndarray]:
        """The static type features after the dynamic ones ([L, T, n]) and the runtime's context: what
        decides plans at size that the base model's features leave out (calls, micro-batches, hosting,
        the instance limits ahead, the table's place and the GPU memory it takes)."""
        from heterps_ray.costmodel.runtime_terms import call_ms, table_rate

        m, L, T, problem = self.model, self.num_layers, self.num_types, self.problem
        n = len(_RUNTIME_TYPE_FEATURES)
        f = np.zeros((L, T, n))
        rest = np.cumsum(np.where(m.runnable, m.compute_ms, 0.0)[::-1], axis=0)[::-1] / self.scale_ms
        f[:, :, 1] = np.log1p(rest / m.max_instances[None, :])
        terms = problem.runtime
        context = np.zeros(len(_RUNTIME_CONTEXT_FEATURES))
        if terms is None:
            return np.clip(f, -OBS_CLIP, OBS_CLIP), context
        table = problem.ps.table
        rows_per_batch = m.rows_per_sample * m.batch_size
        for t, resource in enumerate(problem.resources):
            f[:, t, 0] = math.log1p(call_ms(problem, terms, resource.name) / self.scale_ms)
            if terms.ps_hosting == "auto":
                place = table_rate(problem, terms, resource.name, hosted=True)
                f[:, t, 2] = place.hit_rate if place.place != "ps" else 0.0
                f[:, t, 3] = math.log1p(place.ms_per_row * rows_per_batch / self.scale_ms)
            if table is not None and table.gpu_rows.get(resource.name, 0) > 0:
                f[:, t, 4] = math.log1p(table.rows / table.gpu_rows[resource.name])
        context[:] = (1.0, float(terms.mode == "async"), math.log2(terms.micro_batches) / 4.0,
                      float(terms.ps_hosting == "auto"))  # fmt: skip
        return np.clip(f, -OBS_CLIP, OBS_CLIP), context
