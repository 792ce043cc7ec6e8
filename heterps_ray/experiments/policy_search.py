"""Picking the pretrained RL policy's hyper-parameters: Ray Tune with ASHA over pretraining runs
(tune_policy), and shipping the winner's weights (ship_policy); scripts/train_policy.py --tune runs it.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pandas as pd

from heterps_ray.costmodel import Problem
from heterps_ray.errors import ConfigError
from heterps_ray.experiments.trials import RL_CPUS, cpus_available, plain, tune_results
from heterps_ray.scheduling import get_scheduler

# What each policy-search trial reports at every validation point (besides its settings).
POLICY_METRICS = (
    "mean_ratio",
    "median_ratio",
    "worst_ratio",
    "greedy_median_ratio",
    "missed",
    "problems",
    "iterations",
    "env_steps",
    "final_return",
    "seconds",
)
# The shipped run's length: 320 PPO iterations of 1024 env steps.
FULL_ENV_STEPS = 327_680


@dataclass
class PolicySearch:
    """A policy search: one row per trial (full-length trials first, best first), each trial's validation
    history and final checkpoint, and the winner: the best trial among those that ran the full length."""

    table: pd.DataFrame
    trials: list[dict[str, Any]]
    best_config: dict[str, Any]
    best_mean_ratio: float
    best_checkpoint: Path
    settings: dict[str, Any]


def policy_search_space() -> dict[str, Any]:
    """Pretraining settings (fields of RLConfig) the policy search samples."""
    from ray import tune

    return {
        "lr": tune.loguniform(1e-4, 3e-3),
        "lr_end": tune.choice([1.0, 0.1]),
        "entropy_coeff": tune.loguniform(1e-3, 3e-2),
        "train_batch_size": tune.choice([512, 1024, 2048]),
        "minibatch_size": tune.choice([128, 256]),
        "num_epochs": tune.choice([4, 6, 10]),
        "hidden": tune.choice([64, 128]),
    }


def asha_milestones(max_env_steps: int, grace_env_steps: int, reduction_factor: float) -> list[int]:
    """The env steps at which ASHA compares trials (its rungs), then the full length."""
    rungs, t = [], float(grace_env_steps)
    while t < max_env_steps:
        rungs.append(int(t))
        t *= reduction_factor
    return [*rungs, int(max_env_steps)]


def tune_policy(
    *,
    num_samples: int = 6,
    max_env_steps: int = FULL_ENV_STEPS,
    report_every: int = 32_768,
    grace_env_steps: int = 98_304,
    reduction_factor: float = 3.0,
    max_concurrent: int = 2,
    pool_size: int = 1000,
    validation: int = 30,
    seed: int = 0,
    layers: tuple[int, int] = (3, 30),
    types: tuple[int, int] = (2, 5),
    search_space: Mapping[str, Any] | None = None,
    base: Any = None,
    include_current: bool = True,
    storage_path: str | Path = "runs/tune",
    between_iterations: Any = None,
    verbose: bool = False,
) -> PolicySearch:
    """Ray Tune with ASHA over the pretraining hyper-parameters, trials as long as a full pretraining run.

    Each trial pretrains a fresh policy (seeded by `seed`) for up to `max_env_steps` env steps on the
    training pool (`pool_size` problems of `layers` x `types`, scheduling.rl.pretrain). Every
    `report_every` env steps, and at its end, it scores the policy alone, zero-shot, on `validation`
    held-out problems (policy_only_score: mean of best-of-33-plans / exact optimum, MISSED_RATIO where it
    misses; minimised) and saves its weights as a Tune checkpoint (policy.pt + policy.json).
    ASHA (time = env steps) stops the trials behind at its rungs (asha_milestones); only a trial that ran
    the full length can win. `base` (an RLConfig; default PRETRAIN_CONFIG) is changed by the sampled
    fields; `include_current` makes base itself the first trial. A linear lr decay (`lr_end`) ends at
    `max_env_steps`.
    """
    import dataclasses

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from heterps_ray.scheduling.rl import RLConfig
    from heterps_ray.scheduling.rl.pretrain import PRETRAIN_CONFIG, training_pool, validation_problems

    space = dict(search_space or policy_search_space())
    known = {f.name for f in fields(RLConfig)}
    unknown = sorted(set(space) - known)
    if unknown:
        raise ConfigError(None, "search_space", f"fields of RLConfig ({sorted(known)})", unknown)
    held_out = validation_problems(validation, layers, types)
    exact_costs = {p.name: _exact_cost(p) for p in held_out}
    if all(c is None for c in exact_costs.values()):
        raise ConfigError(
            None, "validation", "a validation set with at least one feasible problem", validation
        )
    base = dataclasses.replace(base or PRETRAIN_CONFIG, lr_decay_steps=max_env_steps)
    current = {k: v for k, v in dataclasses.asdict(base).items() if k in space}
    milestones = asha_milestones(max_env_steps, grace_env_steps, reduction_factor)
    settings: dict[str, Any] = {
        "num_samples": num_samples,
        "max_env_steps": max_env_steps,
        "report_every": report_every,
        "grace_env_steps": grace_env_steps,
        "reduction_factor": reduction_factor,
        "max_concurrent": max_concurrent,
        "pool_size": pool_size,
        "validation": validation,
        "seed": seed,
        "layers": list(layers),
        "types": list(types),
        "milestones": milestones,
    }
    trainable = tune.with_parameters(
        _policy_trial,
        pool=training_pool(pool_size, seed, layers, types),
        validation=held_out,
        exact_costs=exact_costs,
        base=base,
        max_env_steps=max_env_steps,
        report_every=report_every,
        seed=seed,
        description={"pool": pool_size, "layers": list(layers), "types": list(types)},
        between_iterations=between_iterations,
    )
    results = tune_results(
        tune.with_resources(trainable, {"cpu": min(RL_CPUS, cpus_available())}),
        param_space=space,
        storage_path=storage_path,
        name="tune-policy",
        num_samples=num_samples,
        metric="mean_ratio",
        search_alg=BasicVariantGenerator(
            points_to_evaluate=[current] if include_current else None,
            max_concurrent=max_concurrent,
            random_state=seed,
        ),
        scheduler=ASHAScheduler(
            time_attr="env_steps",
            max_t=max_env_steps,
            grace_period=grace_env_steps,
            reduction_factor=reduction_factor,
        ),
        max_concurrent=max_concurrent,
        keep_checkpoints=1,
        total_trials=num_samples,
        verbose=verbose,
    )
    trials = [_policy_trial_record(r, space, current if include_current else None) for r in results]
    table = _policy_table(trials, milestones)
    if not table["full_length"].iloc[0]:
        raise RuntimeError("no policy-search trial ran the full length (every trial was stopped)")
    best = next(t for t in trials if t["trial"] == table["trial"].iloc[0])
    return PolicySearch(
        table=table,
        trials=trials,
        best_config=best["config"],
        best_mean_ratio=float(best["final"]["mean_ratio"]),
        best_checkpoint=best["checkpoint"],
        settings=settings,
    )


def ship_policy(search: PolicySearch, directory: str | Path, command: str) -> Path:
    """Copy the winning trial's final weights to `directory` (policy.pt, its numpy mirror policy.npz when
    the trial wrote one, and policy.json); policy.json keeps
    the trial's own record (config, seed, curve, validation history) and adds the Tune command and table."""
    import shutil

    from heterps_ray.scheduling.rl.policy import policy_metadata

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = policy_metadata(search.best_checkpoint)
    for name in ("policy.pt", "policy.npz"):  # zero-shot planning reads the .npz (it checks its .pt hash)
        if (search.best_checkpoint / name).exists():
            shutil.copyfile(search.best_checkpoint / name, directory / name)
    meta["command"] = command
    meta["tune"] = {
        "picked": search.best_config,
        "mean_ratio": search.best_mean_ratio,
        "settings": search.settings,
        "trials": [_trial_summary(t) for t in search.trials],
    }
    (directory / "policy.json").write_text(json.dumps(meta, indent=1, default=float) + "\n")
    return directory


def _exact_cost(problem: Problem) -> float | None:
    plan = get_scheduler("exact").schedule(problem)
    return float(plan.cost) if plan.feasible else None


def _policy_trial(
    config: dict[str, Any],
    pool: list[Problem],
    validation: list[Problem],
    exact_costs: dict[str, float | None],
    base: Any,
    max_env_steps: int,
    report_every: int,
    seed: int,
    description: dict[str, Any],
    between_iterations: Any,
) -> None:
    import dataclasses
    import tempfile

    from ray import tune

    from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES
    from heterps_ray.scheduling.rl.policy import save_policy
    from heterps_ray.scheduling.rl.pretrain import policy_only_score, pretrain

    settings = dataclasses.replace(base, **config)
    iterations = math.ceil(max_env_steps / settings.train_batch_size)
    started = time.perf_counter()
    curve: list[dict[str, float]] = []
    history: list[dict[str, float]] = []
    next_report = report_every

    def validate(iteration: int, module: Any, point: dict[str, float]) -> None:
        nonlocal next_report
        curve.append(point)
        # RLlib samples a few env steps over train_batch_size per iteration: a trial may reach the full
        # length an iteration early, and ASHA stops it there.
        if point["env_steps"] < min(next_report, max_env_steps) and iteration < iterations:
            return
        while next_report <= point["env_steps"]:
            next_report += report_every
        score = policy_only_score(module, validation, exact_costs, rollouts=settings.rollouts, seed=seed)
        returns = [p["episode_return_mean"] for p in curve[-5:] if math.isfinite(p["episode_return_mean"])]
        metrics = {
            **score,
            "iterations": iteration,
            "env_steps": int(point["env_steps"]),
            "final_return": float(statistics.fmean(returns)) if returns else math.nan,
            "seconds": time.perf_counter() - started,
        }
        history.append(metrics)
        meta = {
            "hidden": settings.hidden,
            "type_features": list(TYPE_FEATURES),
            "context_features": list(CONTEXT_FEATURES),
            "config": dataclasses.asdict(settings),
            "seed": seed,
            **description,
            "iterations": iteration,
            "planned_iterations": iterations,
            "max_env_steps": max_env_steps,
            "curve": curve,
            "validation": history,
        }
        with tempfile.TemporaryDirectory() as folder:
            save_policy(module, folder, meta)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

    pretrain(
        settings,
        pool,
        seed,
        iterations=iterations,
        on_iteration=validate,
        between_iterations=between_iterations,
    )


def _policy_trial_record(
    result: Any, space: Mapping[str, Any], current: dict[str, Any] | None
) -> dict[str, Any]:
    """A finished (or stopped) trial: its config, validation history and final checkpoint folder."""
    from heterps_ray.scheduling.rl.policy import policy_metadata

    if result.checkpoint is None:
        raise RuntimeError(f"policy-search trial {result.path} reported no checkpoint")
    checkpoint = Path(result.checkpoint.path)
    meta = policy_metadata(checkpoint)
    config = {k: plain(result.config[k]) for k in space}
    return {
        "trial": str(result.metrics["trial_id"]),
        "path": str(result.path),
        "config": config,
        "current": current is not None and all(config[k] == current[k] for k in space),
        "history": meta["validation"],
        "final": meta["validation"][-1],
        "full_length": meta["validation"][-1]["env_steps"] >= meta["max_env_steps"]
        or meta["iterations"] >= meta["planned_iterations"],
        "iterations": meta["iterations"],
        "planned_iterations": meta["planned_iterations"],
        "checkpoint": checkpoint,
    }


def _policy_table(trials: list[dict[str, Any]], milestones: list[int]) -> pd.DataFrame:
    """One row per trial: settings, final scores, the mean ratio at each ASHA milestone it reached."""
    records = []
    for t in trials:
        row: dict[str, Any] = {"trial": t["trial"], "current": t["current"], **t["config"]}
        row.update({k: t["final"][k] for k in POLICY_METRICS})
        row["full_length"] = t["full_length"]
        for m in milestones:
            reached = [h for h in t["history"] if h["env_steps"] >= m]
            row[f"mean_ratio@{m}"] = reached[0]["mean_ratio"] if reached else math.nan
        records.append(row)
    table = pd.DataFrame.from_records(records)
    order = table.sort_values(["full_length", "mean_ratio", "median_ratio"], ascending=[False, True, True])
    return order.reset_index(drop=True)


def _trial_summary(trial: dict[str, Any]) -> dict[str, Any]:
    """A trial as plain JSON: its settings, whether it ran the full length, its validation history."""
    keys = (
        "trial",
        "path",
        "config",
        "current",
        "full_length",
        "iterations",
        "planned_iterations",
        "history",
    )
    return {k: trial[k] for k in keys}
