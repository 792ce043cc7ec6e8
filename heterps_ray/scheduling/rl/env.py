"""The scheduling problem as a gymnasium environment: assign a resource type to each layer, in order.

One step = one layer. The observation describes the current layer on every resource type by
features (times relative to the floor's time budget, prices, bandwidths, limits, what is already
used), never by position or name, so one policy applies to any number of layers and of types, listed
in any order. The env pads the types to its `pad_types` (RLlib needs one observation shape for a
training run: PRETRAIN_TYPES when pretraining); planning with a saved policy uses exactly the
problem's types. After the last layer, exact provisioning (the shared step every scheduler uses)
sets replicas and PS shards, and the reward is the cost relative to a per-problem reference.

Reward (terminal only; why this shape):
* feasible: ``log(ref_cost / cost)``, clipped to +-REWARD_CLIP. A log ratio is scale free (problems
  cost cents or thousands of dollars) and symmetric (2x cheaper and 2x dearer weigh the same), and
  near the optimum it is the relative cost gap, which is what the benchmark measures.
* infeasible: ``-REWARD_CLIP - min(REWARD_CLIP, log(floor / reached))`` — below every feasible
  plan, but still graded by the throughput shortfall, so the policy is pulled towards the floor
  before it has ever met it.
The reference is the cheapest feasible plan among the single-type plans and two per-layer
heuristics (cheapest $ per layer, fastest per layer); without a feasible one, the first feasible
plan the env meets. PPO standardises advantages, so only the ordering of returns and their spread
matter; gamma = 1 makes every step share the episode's return.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from heterps_ray.costmodel import CostModel, Problem
from heterps_ray.costmodel.formulas import amdahl_replicas
from heterps_ray.scheduling.provisioning import Provisioned, provision_counts

PRETRAIN_TYPES = 8  # pretraining pads every problem's types to this many (masked); planning needs no pad
_TYPES_SCALE = 5.0  # the "types" context feature is types / this (the first policy's padding width)
REWARD_CLIP = 3.0  # |log cost ratio| beyond e^3 = 20x carries no more information
_OBS_CLIP = 10.0  # every feature is clipped to +-this
_MAX_MEMO = 50_000  # provisioned assignments remembered per problem
_UNREACHABLE_REPLICAS = 1.0e3  # stands in for "no replica count reaches the floor" (Amdahl limit)

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
_STATIC, _DYNAMIC = len(_STATIC_TYPE_FEATURES), len(_DYNAMIC_TYPE_FEATURES)


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
        self.static = self._static_features()  # [L, T, _STATIC]
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

        f = np.zeros((L, T, _STATIC), dtype=np.float64)
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
        f[:, :T, 10] = np.clip(rest_ratio, 0.0, _OBS_CLIP)
        top_price = max(float(m.price.max()), 1e-12)
        f[:, :T, 11] = m.price / top_price
        f[:, :T, 12] = np.log(m.max_instances) / math.log(256.0)
        bandwidth = np.array([r.bandwidth_gbps for r in self.problem.resources])
        f[:, :T, 13] = np.log(bandwidth / bandwidth.max())
        f[0, :T, 14] = np.log1p(m.input_ms / budget)
        f[:, m.ps_type, 15] = 1.0
        return np.clip(f, -_OBS_CLIP, _OBS_CLIP)

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
            return np.clip(f, -_OBS_CLIP, _OBS_CLIP), context
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
        return np.clip(f, -_OBS_CLIP, _OBS_CLIP), context


def replicas_needed(tau_ms: float, alpha: float, budget_ms: float) -> float:
    """Fractional Amdahl replica count reaching the floor (budget_ms per batch), capped for features."""
    return min(amdahl_replicas(tau_ms, alpha, budget_ms), _UNREACHABLE_REPLICAS)


ProblemSource = Callable[[np.random.Generator], Problem]


class SchedulingEnv(gym.Env):
    """Assign layers to resource types one by one; the terminal reward prices the provisioned plan.

    env_config: ``problem`` (one Problem), or ``problems`` (a list, one drawn per episode), or
    ``problem_source`` (a callable rng -> Problem, a fresh problem per episode: pretraining);
    ``pad_types``: the width of the observation's type axis (default: the most types of
    `problems`, PRETRAIN_TYPES with a `problem_source`). The network scores each type with shared
    weights, so the width only serves RLlib's fixed spaces; padded types are masked.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, config: dict[str, Any] | None = None):
        config = dict(config or {})
        self._source: ProblemSource | None = config.get("problem_source")
        self.problems: list[Problem] = list(
            config.get("problems") or ([config["problem"]] if "problem" in config else [])
        )
        if not self.problems and self._source is None:
            raise ValueError("SchedulingEnv needs env_config 'problem', 'problems' or 'problem_source'")
        widest = max((p.num_types for p in self.problems), default=0)
        self.pad_types = int(config.get("pad_types") or max(widest, 0 if self.problems else PRETRAIN_TYPES))
        if widest > self.pad_types:
            raise ValueError(f"pad_types {self.pad_types} is below a problem's {widest} resource types")
        self._views: dict[int, ProblemView] = {}  # built on first use: a pretraining pool is large
        self.observation_space, self.action_space = self.spaces(self.pad_types)
        self.view: ProblemView | None = None
        self.last_result: EpisodeResult | None = None
        self.episodes = 0

    def problem_view(self, index: int) -> ProblemView:
        """The view of problems[index]; it keeps every plan this env evaluated for that problem."""
        if index not in self._views:
            self._views[index] = ProblemView(self.problems[index])
        return self._views[index]

    @staticmethod
    def spaces(pad_types: int = PRETRAIN_TYPES) -> tuple[gym.spaces.Dict, gym.spaces.Discrete]:
        """(observation space, action space) for a type axis of `pad_types` (any problem up to that)."""
        nt, nc, T = len(TYPE_FEATURES), len(CONTEXT_FEATURES), int(pad_types)
        observation = gym.spaces.Dict(
            {
                "action_mask": gym.spaces.Box(0.0, 1.0, (T,), np.float32),
                "type_present": gym.spaces.Box(0.0, 1.0, (T,), np.float32),
                "type_features": gym.spaces.Box(-_OBS_CLIP, _OBS_CLIP, (T, nt), np.float32),
                "context": gym.spaces.Box(-_OBS_CLIP, _OBS_CLIP, (nc,), np.float32),
            }
        )
        return observation, gym.spaces.Discrete(T)

    # -- gymnasium API -------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if options and "problem" in options:
            self.view = (
                options["problem"]
                if isinstance(options["problem"], ProblemView)
                else ProblemView(options["problem"])
            )
        elif self._source is not None:
            self.view = ProblemView(self._source(self.np_random))
        else:
            self.view = self.problem_view(int(self.np_random.integers(len(self.problems))))
        v = self.view
        if v.num_types > self.pad_types:
            raise ValueError(
                f"a problem of {v.num_types} resource types in an env padded to {self.pad_types}"
            )
        self.assignment: list[int] = []
        self.layer = 0
        self.used = np.zeros(v.num_types)
        self.used[v.model.ps_type] = v.ps_shards_needed
        self.stage_type = -1
        self.stage_start = 0
        self.stage_compute = 0.0
        self.stage_weighted = 0.0
        self.stage_tau = 0.0  # compute + incoming boundary + input, without the closing boundary
        return self._observation(), {}

    def step(self, action: int):
        v, layer, t = self.view, self.layer, int(action)
        assert v is not None, "call reset() first"
        if not (t < v.num_types and v.model.runnable[layer, t]):
            raise ValueError(f"action {t} is masked for layer {layer} ({v.problem.layer_names[layer]!r})")
        c = float(v.model.compute_ms[layer, t])
        if t == self.stage_type:
            self.stage_compute += c
            self.stage_weighted += c * v.model.parallel_fraction[layer]
            self.stage_tau += c
        else:
            if self.stage_type >= 0:
                self._close_stage(closing_ms=float(v.model.boundary_ms[layer - 1, self.stage_type]))
            self.stage_type, self.stage_start = t, layer
            self.stage_compute, self.stage_weighted = c, c * v.model.parallel_fraction[layer]
            self.stage_tau = c + (
                float(v.model.boundary_ms[layer - 1, t]) if layer > 0 else float(v.model.input_ms[t])
            )
        self.assignment.append(t)
        self.layer += 1
        if self.layer < v.num_layers:
            return self._observation(), 0.0, False, False, {}
        result = v.record(self.assignment)
        self.last_result = result
        self.episodes += 1
        info = {"cost": result.provisioned.cost, "feasible": result.feasible}
        return self._observation(terminal=True), result.reward, True, False, info

    def fork(self) -> SchedulingEnv:
        """This episode at its current layer, as an env that steps on alone (a prefix branched by type):
        `step` rebinds every other field it changes, so only these two are copied."""
        other = copy.copy(self)
        other.assignment, other.used = list(self.assignment), self.used.copy()
        return other

    # -- features ------------------------------------------------------------------------------

    def _stage_alpha(self) -> float:
        return self.stage_weighted / self.stage_compute if self.stage_compute > 0.0 else 1.0

    def _close_stage(self, closing_ms: float) -> None:
        assert self.view is not None
        k = replicas_needed(self.stage_tau + closing_ms, self._stage_alpha(), self.view.budget_ms)
        self.used[self.stage_type] += math.ceil(k) if k < _UNREACHABLE_REPLICAS else k

    def _observation(self, terminal: bool = False) -> dict[str, np.ndarray]:
        v = self.view
        assert v is not None, "call reset() first"
        nt, nc = len(TYPE_FEATURES), len(CONTEXT_FEATURES)
        P = self.pad_types
        features = np.zeros((P, nt))
        context = np.zeros(nc)
        mask = np.zeros(P, dtype=np.float32)
        present = np.zeros(P, dtype=np.float32)
        present[: v.num_types] = 1.0
        if terminal:
            # RLlib reads the final observation only for bootstrapping values; any legal shape works
            mask[: v.num_types] = 1.0
            return self._pack(mask, present, features, context)
        layer, m, budget = self.layer, v.model, v.budget_ms
        T = v.num_types
        mask[:T] = v.mask[layer]
        features[:T, :_STATIC] = v.static[layer]
        features[:T, _STATIC + _DYNAMIC :] = v.runtime_static[layer]
        scale = v.scale_ms
        alpha_l = float(m.parallel_fraction[layer])
        stage_alpha = self._stage_alpha()
        k_current = replicas_needed(self.stage_tau, stage_alpha, budget) if self.stage_type >= 0 else 0.0
        for t in range(T):
            if not m.runnable[layer, t]:
                features[t, 20] = self.used[t] / m.max_instances[t]
                continue
            c = float(m.compute_ms[layer, t])
            if t == self.stage_type:
                tau = self.stage_tau + c
                weighted = self.stage_weighted + c * alpha_l
                alpha = weighted / (self.stage_compute + c) if self.stage_compute + c > 0 else 1.0
                switch = 0.0
            else:
                incoming = float(m.boundary_ms[layer - 1, t]) if layer > 0 else float(m.input_ms[t])
                tau, alpha = c + incoming, alpha_l
                switch = (
                    float(m.boundary_ms[layer - 1, t] + m.boundary_ms[layer - 1, self.stage_type])
                    if layer > 0
                    else 0.0
                )
            k = replicas_needed(tau, alpha, budget)
            if t == self.stage_type:
                marginal = m.price[t] * (k - k_current)
            else:
                closing = float(m.boundary_ms[layer - 1, self.stage_type]) if layer > 0 else 0.0
                k_closed = (
                    replicas_needed(self.stage_tau + closing, stage_alpha, budget) if layer > 0 else 0.0
                )
                marginal = m.price[t] * k + (
                    m.price[self.stage_type] * (k_closed - k_current) if layer > 0 else 0.0
                )
            committed = self.used[t] + (k_current if t == self.stage_type else 0.0)
            features[t, 16] = float(t == self.stage_type)
            features[t, 17] = math.log1p(tau / scale)
            features[t, 18] = math.log1p(k)
            features[t, 19] = math.log1p(switch / scale)
            features[t, 20] = self.used[t] / m.max_instances[t]
            features[t, 21] = (m.max_instances[t] - committed - k) / m.max_instances[t]
            features[t, 22] = marginal / v.rate_scale
        context[:] = (
            layer / v.num_layers,
            v.num_layers / 30.0,
            T / _TYPES_SCALE,
            float(layer == 0),
            alpha_l,
            stage_alpha,
            (layer - self.stage_start) / v.num_layers if self.stage_type >= 0 else 0.0,
            math.log1p(k_current),
            *v.runtime_context,
        )
        return self._pack(mask, present, features, context)

    @staticmethod
    def _pack(mask, present, features, context) -> dict[str, np.ndarray]:
        return {
            "action_mask": mask,
            "type_present": present,
            "type_features": np.clip(features, -_OBS_CLIP, _OBS_CLIP).astype(np.float32),
            "context": np.clip(context, -_OBS_CLIP, _OBS_CLIP).astype(np.float32),
        }
