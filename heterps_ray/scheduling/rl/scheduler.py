"""RLScheduler: an RLlib PPO policy (new API stack, action masking) that plans a problem.

    plan = RLScheduler(budget_s=60, seed=0, checkpoint_dir="runs/rl").schedule(problem)  # train
    plan = RLScheduler.from_checkpoint("runs/rl").schedule(problem)                     # no training
    plan = RLScheduler().schedule(problem)                  # zero-shot, the shipped pretrained policy
    plan = RLScheduler(finetune_s=30).schedule(problem)     # the pretrained policy, fine-tuned first

The policy picks a resource type per layer (masked to the types that can run it); exact
provisioning sets replicas and PS shards. Every plan the policy produces is a candidate: the
episodes PPO sampled while training, the final policy's greedy plan and plans sampled from it,
the env's reference plans (single-type and per-layer heuristics) and the plans of exact's level walk
run with quick levels to a deadline and, with runtime terms, the plans its runtime levels scout
(rl/level_plans.py); the best, optionally hill-climbed (rl/polish.py), is returned. `plan.extra` says which candidate won ("source") and
what the policy alone reached ("policy_cost"), so the share of each part stays visible.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from heterps_ray.costmodel import Problem
from heterps_ray.costmodel.plan import Plan
from heterps_ray.costmodel.pricing import meets_floor
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling.base import Scheduler, register_scheduler
from heterps_ray.scheduling.provisioning import plan_from_counts
from heterps_ray.scheduling.rl.env import EpisodeResult, ProblemView, SchedulingEnv, better
from heterps_ray.scheduling.rl.level_plans import level_plans, scouted_plans
from heterps_ray.scheduling.rl.policy import (
    PRETRAINED_DIR,
    has_policy,
    load_planning_policy,
    load_policy,
)
from heterps_ray.scheduling.rl.polish import polish
from heterps_ray.scheduling.rl.rl_config import RLConfig
from heterps_ray.scheduling.rl.rollouts import policy_rollouts

log = logging.getLogger(__name__)

_MODULE_SUBDIR = Path("learner_group") / "learner" / "rl_module" / "default_policy"
_STATE_FILE = "rl_scheduler.json"  # beside RLlib's files: config, seed and the best plans found
_BOUND_RTOL = 1e-9  # a plan within this of the throughput bound reaches the highest throughput


@register_scheduler("rl")
class RLScheduler(Scheduler):
    """PPO over the scheduling env. What `schedule` does depends on the arguments:

    * ``budget_s`` or ``iterations``: train a fresh policy on the problem (issue 4);
    * ``finetune_s`` (or ``policy`` with ``iterations``): start from a saved policy, then train;
    * neither: plan zero-shot with the pretrained policy shipped in the package (or, when there
      is none, train a fresh policy for 60 s).

    Same seed and same `iterations` give the same plan. `checkpoint_dir` keeps the trained policy
    (RLlib checkpoint) and the best plan found, for :meth:`from_checkpoint`.
    """

    name = "rl"

    def __init__(
        self,
        budget_s: float | None = None,
        seed: int = 0,
        config: RLConfig | None = None,
        iterations: int | None = None,
        checkpoint_dir: str | Path | None = None,
        policy: str | Path | None = None,
        finetune_s: float | None = None,
    ):
        self.budget_s, self.seed, self.iterations = budget_s, int(seed), iterations
        self.finetune_s = finetune_s
        self.policy = Path(policy) if policy is not None else None
        if self.policy is not None and not has_policy(self.policy):
            raise ConfigError(
                None,
                "policy",
                "a directory with policy.pt and policy.json (scripts/train_policy.py)",
                str(policy),
            )
        self.config = config or RLConfig()
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._module: Any = None  # set by from_checkpoint: plan with it instead of training
        self.module: Any = None  # the policy after the last training run (an RLModule)
        self._known: dict[str, list[int]] = {}  # problem fingerprint -> best assignment found in training
        self.history: list[dict[str, float]] = []  # per iteration: seconds, reward mean, best cost

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> RLScheduler:
        """A scheduler that plans with a policy saved by `checkpoint_dir`, without training."""
        from ray.rllib.core.rl_module.rl_module import RLModule

        path = Path(path)
        state = json.loads((path / _STATE_FILE).read_text())
        known = {f.name for f in fields(RLConfig)}
        scheduler = cls(
            seed=state["seed"],
            config=RLConfig(**{k: v for k, v in state["config"].items() if k in known}),
            iterations=state["iterations"],
        )
        scheduler._module = RLModule.from_checkpoint(str((path / _MODULE_SUBDIR).resolve()))
        scheduler._known = {k: list(v) for k, v in state.get("best_assignments", {}).items()}
        return scheduler

    @property
    def mode(self) -> str:
        """checkpoint | finetune | train | zero-shot: what `schedule` will do."""
        if self._module is not None:
            return "checkpoint"
        if self.finetune_s is not None or (self.policy is not None and self.iterations is not None):
            return "finetune"
        if self.budget_s is not None or self.iterations is not None:
            return "train"
        return "zero-shot" if has_policy(self.policy or PRETRAINED_DIR) else "train"

    # -- planning ------------------------------------------------------------------------------

    def schedule(self, problem: Problem) -> Plan:
        started = time.perf_counter()
        mode = self.mode
        if mode in ("checkpoint", "zero-shot"):
            module = (
                self._module if mode == "checkpoint" else load_planning_policy(self.policy or PRETRAINED_DIR)
            )
            view = ProblemView(problem)
            candidates = self._rollouts(module, view)
            stored = self._known.get(problem_fingerprint(problem))
            if stored is not None:
                candidates["trained"] = view.record(stored)
            return self._plan(
                view, candidates, started, {"mode": mode, "trained": False}, self.config.zero_shot_polish_s
            )

        initial = load_policy(self.policy or PRETRAINED_DIR) if mode == "finetune" else None
        zero_shot = None
        if initial is not None:  # what zero-shot planning returns: fine-tuning never ends worse
            zero_view = ProblemView(problem)
            _, zero_shot = self._best(
                zero_view,
                self._rollouts(initial, zero_view),
                time.perf_counter() + self.config.zero_shot_polish_s,
            )
        budget = self.finetune_s if mode == "finetune" else self.budget_s
        if budget is None and self.iterations is None:
            budget = 60.0
        view, module, info = self._train(problem, started, budget, initial)
        info["mode"] = mode
        sampled = view.best
        candidates = self._rollouts(module, view)
        if sampled is not None:
            candidates["sampled"] = sampled
        if initial is not None:  # fine-tuning never ends worse than the policy it started from
            for name, result in self._rollouts(initial, view).items():
                candidates[f"pretrained-{name}"] = result
        if zero_shot is not None:
            candidates["zero-shot"] = view.record(zero_shot.assignment)
        polish_s = math.inf if budget is None else max(started + budget - time.perf_counter(), 0.0)
        plan = self._plan(view, candidates, started, info, polish_s)
        if self.checkpoint_dir is not None:
            self._save_state(problem, plan, info)
        return plan

    def _train(
        self, problem: Problem, started: float, budget_s: float | None, initial: Any
    ) -> tuple[ProblemView, Any, dict[str, Any]]:
        import torch

        _ensure_ray()
        # One thread: these networks are tiny, and on a busy machine a second thread only waits.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        from tqdm import tqdm

        config = self.config
        if initial is not None:  # the network must have the saved policy's widths (a tuned one may differ)
            config = replace(
                config,
                hidden=int(initial.score[0].out_features),
                set_hidden=int(initial.encode[0].out_features),
            )
        algo = config.ppo_config({"problems": [problem]}, self.seed).build_algo()
        # A bar on a terminal only (disable=None): iterations when counted, else PPO iterations so far.
        bar = tqdm(total=self.iterations, desc="rl training", unit="iter", disable=None, leave=False)
        try:
            if initial is not None:
                set_weights(algo, initial.state_dict())
            # The envs RLlib built play every episode; their views have seen all of them as candidates.
            envs = _local_envs(algo)
            views = [env.problem_view(0) for env in envs]
            training_s = math.inf if budget_s is None else budget_s * (1.0 - self._polish_share())
            iteration, last = 0, 0.0
            while True:
                if self.iterations is not None:
                    if iteration >= self.iterations:
                        break
                elif iteration > 0 and time.perf_counter() - started + last > training_s:
                    break  # (at least one iteration, even when building the algorithm used the budget)
                t0 = time.perf_counter()
                result = algo.train()
                last = time.perf_counter() - t0
                iteration += 1
                bar.update(1)
                bar.set_postfix(episode_return=f"{_episode_return_mean(result):.3f}", refresh=False)
                log.info(
                    "rl iteration %d: %.1f s, return %.3f", iteration, last, _episode_return_mean(result)
                )
                self.history.append(
                    {
                        "iteration": iteration,
                        "seconds": time.perf_counter() - started,
                        "episode_return_mean": float(_episode_return_mean(result)),
                        "best_cost": min(
                            (v.best.cost for v in views if v.best is not None), default=math.inf
                        ),
                    }
                )
            if self.checkpoint_dir is not None:
                self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                algo.save_to_path(str(self.checkpoint_dir.resolve()))
            module = self.module = algo.get_module()
            info = {"trained": True, "iterations": iteration, "episodes": sum(env.episodes for env in envs)}
        finally:
            bar.close()
            algo.stop()
            torch.set_num_threads(threads)
        view = ProblemView(problem)
        for sampled in views:
            view.merge(sampled)
        return view, module, info

    def _rollouts(self, module: Any, view: ProblemView) -> dict[str, EpisodeResult]:
        """The policy's greedy plan and the best of `config.rollouts` plans sampled from it."""
        greedy, *sampled = policy_rollouts(
            module, view, self.config.rollouts, self.seed, self.config.rollout_temperature
        )
        candidates = {"greedy": greedy}
        best = None
        for result in sampled:
            if better(best, result):
                best = result
        if best is not None:
            candidates["rollouts"] = best
        return candidates

    def _polish_share(self) -> float:
        return self.config.polish_share if self.config.polish else 0.0

    def _plan(
        self,
        view: ProblemView,
        candidates: dict[str, EpisodeResult],
        started: float,
        info: dict[str, Any],
        polish_s: float,
    ) -> Plan:
        policy_best = None
        for name in ("greedy", "rollouts", "sampled", "trained", "pretrained-greedy", "pretrained-rollouts"):
            if name in candidates and better(policy_best, candidates[name]):
                policy_best = candidates[name]
        deadline = math.inf if self.iterations is not None else time.perf_counter() + polish_s
        source, best = self._best(view, candidates, deadline)
        best_throughput: float | None = None
        refusal: dict[str, Any] = {}
        if not best.feasible:
            # Before saying "infeasible": a bound, or else the exact search for the fastest plan,
            # decides whether any plan reaches the floor (see _fastest)
            source, best, best_throughput, refusal = self._fastest(view, candidates, source, best)
        extra = dict(info)
        extra.update(refusal)
        extra.update(
            counts="exact provisioning of the policy's assignment",  # replicas and PS shards never come from the policy
            source=source,
            seed=self.seed,
            greedy_cost=_json_cost(candidates["greedy"]),
            sampled_cost=_json_cost(candidates.get("sampled")),
            policy_cost=_json_cost(policy_best),
            polished_cost=_json_cost(candidates.get("polished")),
            reference_cost=view.reference_cost,
        )
        return plan_from_counts(
            view.problem,
            view.model,
            best.assignment,
            best.provisioned,
            scheduler=self.name,
            seconds=time.perf_counter() - started,
            plans_evaluated=view.evaluations,
            best_throughput=best_throughput,
            extra=extra,
        )

    def _best(
        self, view: ProblemView, candidates: dict[str, EpisodeResult], deadline: float
    ) -> tuple[str, EpisodeResult]:
        """Add the env's reference plans and the polished plan to `candidates`; the best of them (by name)."""
        # The reference plans are candidates too: the RL scheduler never returns a plan worse than
        # the heuristics its reward is measured against.
        for name, assignment in view.reference_assignments.items():
            candidates.setdefault(f"reference:{name}", view.record(assignment))
        searches = (
            ("scouted", scouted_plans, self.config.scouted_plans_s),
            ("levels", level_plans, self.config.level_plans_s),
        )
        for source, plans_of, seconds in searches:
            if seconds <= 0.0:
                continue
            began = time.perf_counter()
            for result in plans_of(view, began + seconds if math.isfinite(deadline) else math.inf):
                if better(candidates.get(source), result):
                    candidates[source] = result
            deadline += time.perf_counter() - began  # polishing keeps its own time
        if self.config.polish:  # the best plans found first, then the policy's greedy plan
            starts = view.top(self.config.polish_starts) + [candidates["greedy"]]
            polished = polish(view, starts, deadline)
            if polished is not None:
                candidates["polished"] = polished
        source, best = "", None
        for name, result in candidates.items():
            if better(best, result):
                source, best = name, result
        assert best is not None
        return source, best

    def _fastest(
        self, view: ProblemView, candidates: dict[str, EpisodeResult], source: str, best: EpisodeResult
    ) -> tuple[str, EpisodeResult, float | None, dict[str, Any]]:
        """(source, best, highest reachable throughput or None, what decided) once no candidate meets
        the floor.

        First exact.throughput_bounds (no ILP, well under a second at 120 layers x 8 types): when its
        upper bound on every plan's throughput is below the floor, no plan meets it and the refusal
        rests on that bound (extra["refusal"] = "bound"; the plan is the fastest found, and the
        highest throughput is known to lie between it and the bound). Otherwise the exact search for
        the fastest plan decides (extra["refusal"] = "search" when it finds none meeting the floor);
        a plan it finds that meets the floor is a candidate (and a start for polishing)."""
        from heterps_ray.scheduling.exact import fastest_plan, throughput_bounds

        started = time.perf_counter()
        bounds = throughput_bounds(view.problem, view.model)
        if not meets_floor(bounds.upper, view.model.floor):
            reached = max(best.provisioned.max_throughput, 0.0)
            exact = reached >= bounds.upper * (1.0 - _BOUND_RTOL)  # the bound is reached: it is the max
            refusal = {
                "refusal": "bound",
                "refusal_s": time.perf_counter() - started,
                "throughput_bound": bounds.upper,
                "infeasible_by": "exact.throughput_bounds (an upper bound on every plan's throughput)",
            }
            return source, best, bounds.upper if exact else None, refusal
        known = max([view.fastest_seen()] + [r.provisioned.max_throughput for r in candidates.values()])
        theta_max, assignment = fastest_plan(view.problem, view.model, known)
        refusal = {
            "refusal": "search",
            "refusal_s": time.perf_counter() - started,
            "infeasible_by": "exact.fastest_plan (the level search exact runs; ILP levels with runtime "
            "terms), the bound being above the floor",
        }
        if assignment is None:
            return source, best, theta_max, refusal
        fastest = candidates["fastest"] = view.record(assignment)
        if not fastest.feasible:  # no plan meets the floor: the search's highest throughput stands
            chosen = ("fastest", fastest) if better(best, fastest) else (source, best)
            return chosen[0], chosen[1], theta_max, refusal
        if self.config.polish:  # the fastest plan meets the floor; a cheaper one is usually a few moves away
            deadline = time.perf_counter() + max(self.config.zero_shot_polish_s, 0.1)
            polished = polish(view, [fastest], deadline)
            if polished is not None and better(fastest, polished):
                candidates["polished-fastest"] = polished
                return "polished-fastest", polished, None, {}
        return "fastest", fastest, None, {}

    def _save_state(self, problem: Problem, plan: Plan, info: dict[str, Any]) -> None:
        assert self.checkpoint_dir is not None
        path = self.checkpoint_dir / _STATE_FILE
        state = json.loads(path.read_text()) if path.exists() else {}
        best = state.get("best_assignments", {})
        best[problem_fingerprint(problem)] = [problem.type_index(t) for t in plan.assignment]
        state.update(
            config=asdict(self.config),
            seed=self.seed,
            iterations=info["iterations"],
            best_assignments=best,
            history=self.history,
        )
        path.write_text(json.dumps(state, indent=1) + "\n")



def problem_fingerprint(problem: Problem) -> str:
    """A stable id of a problem's content (what a stored plan is valid for)."""
    text = json.dumps(problem.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def set_weights(algo: Any, state: dict[str, Any]) -> None:
    """Start training from saved weights: the learner's module and the env runner's copy."""
    algo.learner_group.set_weights({"default_policy": {k: v.numpy() for k, v in state.items()}})
    algo.get_module().load_state_dict(state)


def _local_envs(algo: Any) -> list[SchedulingEnv]:
    """The SchedulingEnvs inside the algorithm's local env runner (num_env_runners=0)."""
    return [env.unwrapped for env in algo.env_runner.env.unwrapped.envs]


def _episode_return_mean(result: dict[str, Any]) -> float:
    return result.get("env_runners", {}).get("episode_return_mean", np.nan)


def _json_cost(result: EpisodeResult | None) -> float | None:
    if result is None or not result.feasible:
        return None
    return float(result.provisioned.cost)


def _ensure_ray() -> None:
    """RLlib runs inside the caller's Ray; start a small local one when there is none (the CLI)."""
    from heterps_ray.cluster import connect

    connect(None)
