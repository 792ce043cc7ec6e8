"""The RL scheduler: a gymnasium env over the cost model and an RLlib PPO policy with action masking.

Importing this package registers the scheduler "rl" (`get_scheduler("rl", budget_s=60)`).
"""

from heterps_ray.scheduling.rl.env import PRETRAIN_TYPES, EpisodeResult, ProblemView, SchedulingEnv
from heterps_ray.scheduling.rl.rl_config import RLConfig
from heterps_ray.scheduling.rl.rollouts import greedy_rollout
from heterps_ray.scheduling.rl.scheduler import RLScheduler

__all__ = [
    "PRETRAIN_TYPES",
    "EpisodeResult",
    "ProblemView",
    "RLConfig",
    "RLScheduler",
    "SchedulingEnv",
    "greedy_rollout",
]
