"""Pretrain one RL scheduling policy across many generated problems and ship it in the package.

    python scripts/train_policy.py --minutes 40 --seed 0
    python scripts/train_policy.py --iterations 5 --pool 20 --out /tmp/policy     # a smoke run

PPO (RLlib) on SchedulingEnv over a pool of generated problems (3..30 layers, 2..5 types by
default), one problem drawn per episode. The reward is the log cost ratio to each problem's best
heuristic plan, so the training curve (`curve` in policy.json) reads as "how much cheaper than the
best simple plan, on average". The pool is drawn from seed + 1_000_000, so problems generated
from small integer seeds (the benchmarks) are unseen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from heterps_ray.scheduling.generator import generate_problem
from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES
from heterps_ray.scheduling.rl.policy import PRETRAINED_DIR, load_policy, save_policy
from heterps_ray.scheduling.rl.scheduler import RLConfig, set_weights

# Pretraining defaults: bigger batches and a smaller step than per-problem training (many problems).
PRETRAIN_CONFIG = RLConfig(
    train_batch_size=1024, minibatch_size=256, num_epochs=6, lr=3e-4, entropy_coeff=0.01, num_envs=8
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    parser.add_argument("--iterations", type=int, default=None, help="stop after this many PPO iterations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool", type=int, default=1000, help="generated training problems")
    parser.add_argument("--layers", default="3,30", help="inclusive range of layers per problem")
    parser.add_argument("--types", default="2,5", help="inclusive range of resource types per problem")
    parser.add_argument("--out", type=Path, default=PRETRAINED_DIR, help="where policy.pt / policy.json go")
    parser.add_argument("--save-every", type=int, default=10, help="iterations between saves")
    parser.add_argument(
        "--init", type=Path, default=None, help="start from this saved policy (continue training)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override an RLConfig field"
    )
    args = parser.parse_args(argv)

    import ray
    import torch

    config = _override(PRETRAIN_CONFIG, args.set)
    layers = _int_range(args.layers)
    types = _int_range(args.types)
    rng = np.random.default_rng(args.seed + 1_000_000)
    started = time.perf_counter()
    pool = [
        generate_problem(rng, num_layers=layers, num_types=types, name=f"train-{i}") for i in range(args.pool)
    ]
    print(f"generated {len(pool)} problems in {time.perf_counter() - started:.0f} s", flush=True)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny networks: a second thread only waits
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    algo = config.ppo_config({"problems": pool}, args.seed).build_algo()
    if args.init is not None:
        set_weights(algo, load_policy(args.init).state_dict())
    curve: list[dict[str, float]] = []
    metadata = {
        "hidden": config.hidden,
        "type_features": list(TYPE_FEATURES),
        "context_features": list(CONTEXT_FEATURES),
        "config": dataclasses.asdict(config),
        "seed": args.seed,
        "pool": args.pool,
        "layers": list(layers),
        "types": list(types),
        "command": "python scripts/train_policy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "init": None if args.init is None else str(args.init),
        "curve": curve,
    }
    deadline = started + 60.0 * args.minutes
    iteration = 0
    try:
        while (args.iterations is None or iteration < args.iterations) and time.perf_counter() < deadline:
            result = algo.train()
            iteration += 1
            runners = result.get("env_runners", {})
            curve.append(
                {
                    "iteration": iteration,
                    "seconds": round(time.perf_counter() - started, 1),
                    "env_steps": int(runners.get("num_env_steps_sampled_lifetime", 0)),
                    "episode_return_mean": float(runners.get("episode_return_mean", float("nan"))),
                }
            )
            print(json.dumps(curve[-1]), flush=True)
            if iteration % args.save_every == 0:
                save_policy(algo.get_module(), args.out, {**metadata, "iterations": iteration})
        save_policy(algo.get_module(), args.out, {**metadata, "iterations": iteration})
    finally:
        algo.stop()
        torch.set_num_threads(threads)
    print(f"saved {args.out} after {iteration} iterations", flush=True)
    return 0


def _int_range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def _override(config: RLConfig, assignments: list[str]) -> RLConfig:
    types = {f.name: f.type for f in dataclasses.fields(RLConfig)}
    changes = {}
    for item in assignments:
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"--set {item}: unknown RLConfig field (known: {sorted(types)})")
        kind = type(getattr(config, name))
        changes[name] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    return dataclasses.replace(config, **changes)


if __name__ == "__main__":
    sys.exit(main())
