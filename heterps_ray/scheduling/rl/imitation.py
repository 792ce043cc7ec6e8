"""A policy taught by the solver: behaviour cloning of exact's plans, then DAgger on the policy's own states.

    labels = exact_labels(problems, time_limit_s=10)       # {fingerprint: exact's assignment}, cacheable
    states = demonstrations(problems, labels)              # the env's observations along exact's plans
    clone(module, states)                                  # cross-entropy on the type logits
    states += dagger_states(module, problems, labels)      # the policy's own states, labelled by exact
    clone(module, states)

An episode assigns a type per layer, in order, so exact's plan is one action sequence: replaying it
in the env gives every (observation, action) pair of the expert's episode (behaviour cloning). A
policy that errs once then sees states exact's episode never visits; DAgger rolls the policy itself
out, keeps the states it visits, and labels each with exact's type for that layer: the continuation
that returns to the optimal plan (relabelling each state with a fresh optimum of its prefix would
need a constrained exact search per state). The module is the PPO module's network (same layers as
`module.TypeScoringModule`), so the result ships and fine-tunes like any pretrained policy; only the
scoring layers (`encode`, `score`) learn, the value head is PPO's.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from heterps_ray.costmodel import Problem
from heterps_ray.scheduling.rl.env import ProblemView, SchedulingEnv
from heterps_ray.scheduling.rl.level_plans import level_plans
from heterps_ray.scheduling.rl.rollouts import play_out
from heterps_ray.scheduling.rl.scheduler import problem_fingerprint

Labels = dict[str, list[int] | None]  # problem fingerprint -> exact's assignment (type indices), None: none


def _solve(problem: Problem) -> list[int] | None:
    from heterps_ray.scheduling import get_scheduler

    plan = get_scheduler("exact").schedule(problem)
    return [problem.type_index(t) for t in plan.assignment] if plan.feasible else None


def _solve_into(problem: Problem, connection: Any) -> None:
    connection.send(_solve(problem))
    connection.close()


def exact_assignment(problem: Problem, time_limit_s: float | None = None) -> list[int] | None:
    """Exact's optimal assignment (type index per layer), or None when no plan meets the floor or the
    search runs past `time_limit_s`. With a limit the search runs in a forked process that is killed
    at the limit (a solver call in C cannot be interrupted from Python)."""
    if time_limit_s is None:
        return _solve(problem)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_solve_into, args=(problem, send), daemon=True)
    process.start()
    send.close()
    try:
        if receive.poll(time_limit_s):
            return receive.recv()
        return None
    except EOFError:  # the search failed in the child: no label
        return None
    finally:
        process.kill()
        process.join()
        receive.close()


def exact_labels(
    problems: Sequence[Problem],
    labels: Labels | None = None,
    time_limit_s: float | None = None,
    on_label: Callable[[Problem, list[int] | None, float], None] | None = None,
) -> Labels:
    """`labels` (by problem fingerprint) extended with exact's assignment of every problem not in it yet."""
    labels = {} if labels is None else labels
    for problem in problems:
        key = problem_fingerprint(problem)
        if key in labels:
            continue
        started = time.perf_counter()
        labels[key] = exact_assignment(problem, time_limit_s)
        if on_label is not None:
            on_label(problem, labels[key], time.perf_counter() - started)
    return labels


@dataclass
class States:
    """Observations (stacked per key, type axis padded to `pad`) and the label type of each."""

    observations: dict[str, np.ndarray]
    actions: np.ndarray

    def __len__(self) -> int:
        return len(self.actions)

    def head(self, n: int) -> States:
        return States({k: v[:n] for k, v in self.observations.items()}, self.actions[:n])

    def __add__(self, other: States) -> States:
        pad = max(self.observations["action_mask"].shape[1], other.observations["action_mask"].shape[1])
        a, b = _padded(self.observations, pad), _padded(other.observations, pad)
        return States(
            {k: np.concatenate([a[k], b[k]]) for k in a}, np.concatenate([self.actions, other.actions])
        )


def _padded(observations: dict[str, np.ndarray], pad: int) -> dict[str, np.ndarray]:
    width = observations["action_mask"].shape[1]
    if width == pad:
        return observations
    out = {}
    for key, value in observations.items():
        if key == "context":
            out[key] = value
            continue
        shape = list(value.shape)
        shape[1] = pad - width
        out[key] = np.concatenate([value, np.zeros(shape, dtype=value.dtype)], axis=1)
    return out


def _stack(observations: list[dict[str, np.ndarray]], actions: list[int], pad: int) -> States:
    stacked = {k: np.stack([o[k] for o in observations]) for k in observations[0]}
    return States(_padded(stacked, pad), np.asarray(actions, dtype=np.int64))


def _labelled(
    problems: Sequence[Problem], labels: Mapping[str, list[int] | None]
) -> Iterator[tuple[Problem, list[int]]]:
    """The problems exact solved, each with its plan's assignment."""
    for problem in problems:
        assignment = labels.get(problem_fingerprint(problem))
        if assignment is not None:
            yield problem, assignment


def demonstrations(problems: Sequence[Problem], labels: Mapping[str, list[int] | None]) -> States:
    """Every (observation, exact's action) of exact's episode on each labelled problem."""
    observations: list[dict[str, np.ndarray]] = []
    actions: list[int] = []
    pad = max(p.num_types for p in problems)
    for problem, assignment in _labelled(problems, labels):
        env = SchedulingEnv({"problem": problem, "pad_types": pad})
        obs, _ = env.reset()
        for t in assignment:
            observations.append(obs)
            actions.append(t)
            obs, *_ = env.step(t)
    if not actions:
        raise ValueError("no problem with an exact plan to learn from")
    return _stack(observations, actions, pad)


def dagger_states(
    module: Any,
    problems: Sequence[Problem],
    labels: Mapping[str, list[int] | None],
    samples: int = 2,
    seed: int = 0,
) -> States:
    """The states the policy visits itself (its greedy episode and `samples` sampled ones per problem),
    each labelled with exact's type for that layer (or, where the layer's state masks it, none: skipped)."""
    rng = np.random.default_rng(seed)
    observations: list[dict[str, np.ndarray]] = []
    actions: list[int] = []
    pad = max(p.num_types for p in problems)
    for problem, assignment in _labelled(problems, labels):
        _, steps = _episodes(module, ProblemView(problem), pad, samples, 1.0, rng)
        for layer, (current, _, chosen) in enumerate(steps):
            target = assignment[layer]
            for obs, action in zip(current, chosen, strict=True):
                if obs["action_mask"][target] > 0.5 and action != target:
                    observations.append(obs)  # a state where the policy leaves exact's plan
                    actions.append(target)
    if not actions:
        return _stack([_empty_obs(pad)], [0], pad).head(0)
    return _stack(observations, actions, pad)


Step = tuple[list[dict[str, np.ndarray]], list[int], list[int]]  # per episode: observation, greedy, chosen


def _episodes(
    module: Any, view: ProblemView, pad: int, samples: int, temperature: float, rng: np.random.Generator
) -> tuple[list[SchedulingEnv], list[Step]]:
    """The policy's greedy episode and `samples` episodes sampled at `temperature` (scheduler.play_out):
    the finished envs (their `assignment`s) and, per layer, what each episode saw and did."""
    envs = [SchedulingEnv({"problem": view.problem, "pad_types": pad}) for _ in range(samples + 1)]
    current = [env.reset(options={"problem": view})[0] for env in envs]
    steps: list[Step] = []
    play_out(module, view, envs, current, rng, temperature, trace=steps)
    return envs, steps


def _empty_obs(pad: int) -> dict[str, np.ndarray]:
    space, _ = SchedulingEnv.spaces(pad)
    return {k: np.zeros(space[k].shape or (), dtype=np.float32) for k in space.keys()}


def clone(
    module: Any,
    states: States,
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 256,
    seed: int = 0,
    log: Callable[[int, float, float], None] | None = None,
) -> dict[str, float]:
    """Fit the module's type logits to `states` (cross-entropy), in place; returns the final loss and
    the share of states where the greedy type is the label. Only the scoring layers learn."""
    import torch

    torch.manual_seed(seed)
    params = [p for name, p in module.named_parameters() if not name.startswith("value.")]
    optimiser = torch.optim.Adam(params, lr=lr)
    obs = {k: torch.as_tensor(v) for k, v in states.observations.items()}
    target = torch.as_tensor(states.actions)
    n = len(states)
    generator = torch.Generator().manual_seed(seed)
    loss_value, accuracy = math.nan, math.nan
    module.train()
    for epoch in range(epochs):
        order = torch.randperm(n, generator=generator)
        total, hits = 0.0, 0
        for start in range(0, n, batch_size):
            index = order[start : start + batch_size]
            logits = module.logits({k: v[index] for k, v in obs.items()})
            loss = torch.nn.functional.cross_entropy(logits, target[index])
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            total += loss.item() * len(index)
            hits += int((logits.argmax(dim=-1) == target[index]).sum())
        loss_value, accuracy = total / n, hits / n
        if log is not None:
            log(epoch + 1, loss_value, accuracy)
    module.eval()
    return {"loss": loss_value, "accuracy": accuracy, "states": float(n)}


def priced_states(
    module: Any,
    problems: Sequence[Problem],
    labels: Mapping[str, list[int] | None],
    samples: int = 1,
    temperature: float = 0.5,
    seed: int = 0,
    own: bool = True,
    walk_steps: int = 0,
    walks: int = 2,
    rollouts: int = 0,
) -> States:
    """The states the policy visits itself (its greedy episode and `samples` episodes sampled at
    `temperature`), each labelled by priced completions: for every type the layer can take, the plans
    "the policy's prefix, that type, then exact's types for the remaining layers" and (`own`) "... then
    the policy's own remaining types in that episode" are provisioned, and the label is the type of the
    cheapest feasible one (see `_priced_label`; a state where none is feasible gets no label). Unlike
    exact's type for the layer (`dagger_states`), the label accounts for where the prefix already
    stands: after a wrong type earlier it picks the type that still meets the floor.
    `walk_steps` > 0: a state that no such completion labels (exact's remaining types cannot make up for
    the prefix) is completed by exact's level walk on the remaining layers (`_walked`: the prefix held,
    `walk_steps` quick levels), at most `walks` times per episode; that plan's types then complete the
    episode's later states too.
    `rollouts` > 0: at that many layers of each episode (drawn at random) every type is also priced by
    the policy's own greedy completion after it (`_rollout_costs`): the label then improves on the
    policy where it stands, not only on exact's path back."""
    rng = np.random.default_rng(seed)
    picker = np.random.default_rng(seed + 7_919)
    observations: list[dict[str, np.ndarray]] = []
    actions: list[int] = []
    pad = max(p.num_types for p in problems)
    for problem, assignment in _labelled(problems, labels):
        view = ProblemView(problem)
        # the episodes are played first: a label may price an episode's future (`own`)
        envs, steps = _episodes(module, view, pad, samples, temperature, rng)
        walked: list[list[int] | None] = [None] * len(envs)  # per episode: its walk's plan
        left = [walks if walk_steps > 0 else 0] * len(envs)
        n = min(rollouts, view.num_layers)
        rolled = [set(picker.choice(view.num_layers, n, replace=False).tolist()) for _ in envs]
        for layer, (current, greedy, _) in enumerate(steps):
            for e, (env, obs, preferred) in enumerate(zip(envs, current, greedy, strict=True)):
                plan = env.assignment
                suffixes = [assignment[layer + 1 :]] + ([plan[layer + 1 :]] if own else [])
                walk = walked[e]
                if walk is not None:
                    suffixes.append(walk[layer + 1 :])
                costs = _completion_costs(view, plan[:layer], suffixes)
                expert = assignment[layer]
                if layer in rolled[e]:
                    for t, c in _rollout_costs(module, view, pad, plan[:layer]).items():
                        costs[t] = min(c, costs.get(t, math.inf))
                if not costs and left[e] > 0:
                    left[e] -= 1
                    walk = walked[e] = _walked(problem, plan[:layer], walk_steps)
                    if walk is not None:
                        costs = _completion_costs(view, plan[:layer], [walk[layer + 1 :]])
                        expert = walk[layer]
                if costs:
                    observations.append(obs)
                    actions.append(_priced_label(costs, preferred, expert))
    if not actions:
        return _stack([_empty_obs(pad)], [0], pad).head(0)
    return _stack(observations, actions, pad)


def _rollout_costs(module: Any, view: ProblemView, pad: int, prefix: Sequence[int]) -> dict[int, float]:
    """Per type the layer after `prefix` can take, the cost of "prefix, that type, then the policy's
    greedy choices" when that plan meets the floor (the branches played in lockstep)."""
    base = SchedulingEnv({"problem": view.problem, "pad_types": pad})
    base.reset(options={"problem": view})
    for t in prefix:
        base.step(t)
    types = np.flatnonzero(view.mask[len(prefix)] > 0.5).tolist()
    envs, current = [], []
    for t in types:
        env = base.fork()  # the prefix's state, stepped on by each type
        envs.append(env)
        current.append(env.step(t)[0])
    results = play_out(module, view, envs, current, np.random.default_rng(0), greedy=len(envs))
    return {t: r.cost for t, r in zip(types, results, strict=True) if r.feasible}


def _walked(problem: Problem, prefix: Sequence[int], steps: int) -> list[int] | None:
    """The cheapest plan meeting the floor among those of exact's level walk (`level_plans`: the relaxed
    grid, then `steps` quick levels, no deadline, so the same on every run) on `problem` with its first
    layers held to `prefix`'s types; None when none of them meets the floor."""
    names = [r.name for r in problem.resources]
    held = tuple(
        layer.model_copy(update={"time_ms": {names[t]: layer.time_ms[names[t]]}})
        for layer, t in zip(problem.layers, prefix, strict=False)
    )
    view = ProblemView(problem.model_copy(update={"layers": held + problem.layers[len(prefix) :]}))
    level_plans(view, math.inf, steps)
    best = view.best
    return list(best.assignment) if best is not None and best.feasible else None


_TIE_RTOL = 1e-6  # completions within this of the cheapest are as good as it


def _completion_costs(
    view: ProblemView, prefix: Sequence[int], suffixes: Sequence[Sequence[int]]
) -> dict[int, float]:
    """Per type the layer can take, the cost of its cheapest feasible completion (prefix, type, one of
    `suffixes`); a type with none is left out (empty: the remaining types cannot make up for the prefix)."""
    costs: dict[int, float] = {}
    for t in np.flatnonzero(view.mask[len(prefix)] > 0.5).tolist():
        for suffix in suffixes:
            result = view.record([*prefix, t, *suffix])
            if result.feasible and result.cost < costs.get(t, math.inf):
                costs[t] = result.cost
    return costs


def _priced_label(costs: Mapping[int, float], preferred: int, expert: int) -> int:
    """The type of the cheapest completion (`_completion_costs`, not empty); among equally cheap ones
    the policy's own `preferred` type, then exact's (no label where no completion is feasible, rather
    than "the fastest")."""
    cheapest = min(costs.values())
    tied = [t for t, c in costs.items() if c <= cheapest * (1.0 + _TIE_RTOL)]
    for choice in (preferred, expert):
        if choice in tied:
            return choice
    return tied[0]
