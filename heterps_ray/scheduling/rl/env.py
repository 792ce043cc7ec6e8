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

What the env knows of one problem (its features, reference plans and memo) is problem_view.py's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from heterps_ray.costmodel import Problem
from heterps_ray.costmodel.formulas import amdahl_replicas
from heterps_ray.scheduling.rl.problem_view import (
    CONTEXT_FEATURES,
    DYNAMIC_WIDTH,
    OBS_CLIP,
    REWARD_CLIP,
    STATIC_WIDTH,
    TYPE_FEATURES,
    EpisodeResult,
    ProblemView,
    better,
)

# what callers import from the env (the problem's view and its features live in problem_view.py)
__all__ = [
    "CONTEXT_FEATURES",
    "PRETRAIN_TYPES",
    "REWARD_CLIP",
    "TYPE_FEATURES",
    "EpisodeResult",
    "ProblemSource",
    "ProblemView",
    "SchedulingEnv",
    "better",
    "replicas_needed",
]

PRETRAIN_TYPES = 8  # pretraining pads every problem's types to this many (masked); planning needs no pad
_TYPES_SCALE = 5.0  # the "types" context feature is types / this (the first policy's padding width)
_UNREACHABLE_REPLICAS = 1.0e3  # stands in for "no replica count reaches the floor" (Amdahl limit)


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
                "type_features": gym.spaces.Box(-OBS_CLIP, OBS_CLIP, (T, nt), np.float32),
                "context": gym.spaces.Box(-OBS_CLIP, OBS_CLIP, (nc,), np.float32),
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
        features[:T, :STATIC_WIDTH] = v.static[layer]
        features[:T, STATIC_WIDTH + DYNAMIC_WIDTH :] = v.runtime_static[layer]
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
            "type_features": np.clip(features, -OBS_CLIP, OBS_CLIP).astype(np.float32),
            "context": np.clip(context, -OBS_CLIP, OBS_CLIP).astype(np.float32),
        }
