"""Playing the policy: episodes of the scheduling env driven by a policy's type logits, greedy or
sampled at a temperature, all played in lockstep (one batched forward per layer). The RL scheduler,
pretraining and imitation learning all plan through these."""

from __future__ import annotations

from typing import Any

import numpy as np

from heterps_ray.scheduling.rl.env import EpisodeResult, ProblemView, SchedulingEnv
from heterps_ray.scheduling.rl.policy import NumpyPolicy


def greedy_rollout(module: Any, view: ProblemView) -> EpisodeResult:
    """Play one episode choosing the policy's most likely (unmasked) type at every layer."""
    return policy_rollouts(module, view, samples=0)[0]


def policy_rollouts(
    module: Any, view: ProblemView, samples: int, seed: int = 0, temperature: float = 1.0
) -> list[EpisodeResult]:
    """The greedy episode, then `samples` episodes drawn from the policy (its softmax at `temperature`);
    all played in lockstep. `module`: a NumpyPolicy, a PolicyNetwork or the trained TypeScoringModule."""
    envs = [SchedulingEnv({"problems": [view.problem]}) for _ in range(samples + 1)]
    observations = [env.reset(options={"problem": view})[0] for env in envs]
    return play_out(module, view, envs, observations, np.random.default_rng(seed), temperature)


def play_out(
    module: Any,
    view: ProblemView,
    envs: list[SchedulingEnv],
    observations: list,
    rng: np.random.Generator,
    temperature: float = 1.0,
    greedy: int = 1,
    trace: list[tuple[list, list[int], list[int]]] | None = None,
) -> list[EpisodeResult]:
    """Play `envs` (all at the same layer of `view`, `observations` their current ones) to the end in
    lockstep: the first `greedy` by the policy's greedy type, the others sampled at `temperature`.
    `trace`: per layer, (what each episode saw, each one's greedy type, the type it took) is appended."""
    threads = None
    if isinstance(module, NumpyPolicy):
        score = module.logits
    else:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: on a busy machine more threads only wait for each other
        score = _torch_logits(module)
    try:
        for _ in range(envs[0].layer, view.num_layers):  # every episode has one step per layer
            batch = {k: np.stack([o[k] for o in observations]) for k in observations[0]}
            z = np.asarray(score(batch), dtype=np.float64) / temperature  # the greedy type is the same
            z = np.exp(z - z.max(axis=-1, keepdims=True))
            probabilities = z / z.sum(axis=-1, keepdims=True)
            actions = [int(np.argmax(p)) for p in probabilities[:greedy]]
            actions += [int(rng.choice(len(p), p=p / p.sum())) for p in probabilities[greedy:]]
            if trace is not None:
                trace.append((observations, [int(np.argmax(p)) for p in probabilities], actions))
            observations = [env.step(a)[0] for env, a in zip(envs, actions, strict=True)]
    finally:
        if threads is not None:
            torch.set_num_threads(threads)
    results = [env.last_result for env in envs]
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def _torch_logits(module: Any) -> Any:
    """A torch module's type logits as a function of a numpy batch (no gradients)."""
    import torch

    def logits(batch: dict[str, np.ndarray]) -> np.ndarray:
        with torch.no_grad():
            return module.logits({k: torch.as_tensor(v) for k, v in batch.items()}).double().numpy()

    return logits
