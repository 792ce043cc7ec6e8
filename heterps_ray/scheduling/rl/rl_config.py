"""The RL scheduler's hyper-parameters: every PPO setting in one dataclass, each with a line saying
what it is, and the RLlib config they make."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from heterps_ray.scheduling.rl.env import SchedulingEnv


@dataclass(frozen=True)
class RLConfig:
    """Every PPO hyper-parameter of the RL scheduler (RLlib names in brackets where they differ)."""

    train_batch_size: int = 512
    """env steps (layer decisions) per PPO iteration [train_batch_size_per_learner]"""
    minibatch_size: int = 128
    """steps per SGD minibatch"""
    num_epochs: int = 8
    """SGD passes over each train batch"""
    lr: float = 1e-3
    """Adam learning rate of policy and value networks"""
    lr_end: float = 1.0
    """lr falls linearly to lr * lr_end over lr_decay_steps env steps, then stays (1: constant lr)"""
    lr_decay_steps: int = 0
    """env steps of the linear lr decay (0: constant lr)"""
    gamma: float = 1.0
    """discount; 1 because the only reward is the plan's cost at the end of the episode"""
    lambda_: float = 0.95
    """GAE lambda"""
    clip_param: float = 0.2
    """PPO policy-ratio clip"""
    vf_clip_param: float = 10.0
    """value-loss clip (returns lie in [-6, 3])"""
    vf_loss_coeff: float = 0.5
    """weight of the value loss"""
    entropy_coeff: float = 0.01
    """entropy bonus; keeps sampling alternatives so that good plans are seen"""
    use_kl_loss: bool = False
    """the clipped objective alone, as in CleanRL"""
    grad_clip: float = 0.5
    """global gradient-norm clip"""
    num_envs: int = 8
    """environments stepped together by the one env runner (one forward pass serves all of them)"""
    hidden: int = 64
    """width of the two hidden layers of the type-scoring and value MLPs"""
    set_hidden: int = 32
    """width of the per-type encoder whose mean and max over the types the scorer also reads"""
    rollouts: int = 32
    """plans sampled from the final policy (besides its greedy plan) as candidates"""
    rollout_temperature: float = 0.5
    """softmax temperature of those samples: below 1 they stay near the greedy plan and differ where
    the policy hesitates (issue 26: the cloned policy alone 1.12 against 1.18 at 1 on the wide suite)"""
    polish: bool = True
    """hill-climb from the best plans found (re-type a layer or a stage); see rl/polish.py"""
    polish_starts: int = 4
    """how many of the best distinct plans to hill-climb from"""
    polish_share: float = 0.1
    """share of the training budget kept for polishing (with `iterations`: run to a local optimum)"""
    zero_shot_polish_s: float = 0.5
    """polishing time when planning with a saved policy without training"""
    level_plans_s: float = 0.4
    """time for the level walk's plans before polishing (rl/level_plans.py; 0: none); without a
    polishing deadline (`iterations`) the walk runs to its end"""
    scouted_plans_s: float = 0.7
    """on a problem with runtime terms, time for the plans exact's runtime levels scout, before the
    level walk's (rl/level_plans.scouted_plans; 0: none; without a deadline, all of them)"""

    def ppo_config(self, env_config: dict[str, Any], seed: int) -> Any:
        """The RLlib PPOConfig: one local env runner and one local learner, inside the current Ray."""
        from ray.rllib.algorithms.ppo import PPOConfig
        from ray.rllib.core.rl_module.rl_module import RLModuleSpec

        from heterps_ray.scheduling.rl.module import TypeScoringModule

        return (
            PPOConfig()
            .environment(SchedulingEnv, env_config=env_config)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=self.num_envs)
            .learners(num_learners=0)
            .rl_module(
                rl_module_spec=RLModuleSpec(
                    module_class=TypeScoringModule,
                    model_config={"hidden": self.hidden, "set_hidden": self.set_hidden},
                )
            )
            .training(
                train_batch_size_per_learner=self.train_batch_size,
                minibatch_size=self.minibatch_size,
                num_epochs=self.num_epochs,
                lr=self._lr_schedule(),
                gamma=self.gamma,
                lambda_=self.lambda_,
                clip_param=self.clip_param,
                vf_clip_param=self.vf_clip_param,
                vf_loss_coeff=self.vf_loss_coeff,
                entropy_coeff=self.entropy_coeff,
                use_kl_loss=self.use_kl_loss,
                grad_clip=self.grad_clip,
            )
            .reporting(metrics_num_episodes_for_smoothing=20)
            .debugging(seed=seed, log_level="ERROR")
        )

    def _lr_schedule(self) -> float | list[list[float]]:
        """RLlib's piecewise-linear schedule over sampled env steps, or the constant lr."""
        if self.lr_end == 1.0 or self.lr_decay_steps <= 0:
            return self.lr
        return [[0, self.lr], [self.lr_decay_steps, self.lr * self.lr_end]]
