"""Ray Tune plumbing shared by the experiments (compare, sweep, policy_search): run trials quietly with a
progress bar, read their results from memory, size trials to the cluster. Imports none of them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

RL_CPUS = 1.0  # RLlib inside a trial keeps one CPU busy


def fit(trainable: Any, **options: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run the trials (`options` as :func:`tune_results`); (config, last reported metrics) per trial."""
    return [(dict(r.config or {}), dict(r.metrics or {})) for r in tune_results(trainable, **options)]


def tune_results(
    trainable: Any,
    *,
    param_space: dict[str, Any],
    storage_path: str | Path,
    name: str,
    num_samples: int = 1,
    metric: str | None = None,
    search_alg: Any = None,
    scheduler: Any = None,
    max_concurrent: int = 0,
    keep_checkpoints: int | None = None,
    total_trials: int,
    verbose: bool = False,
) -> list[Any]:
    """Run the trials; Tune's Result per trial (config, last metrics, latest checkpoint). A failed trial
    raises. Quiet unless `verbose`: a progress bar over trials instead of Tune's status tables."""
    from ray import tune

    # No TensorBoard/CSV/JSON loggers: results are read from memory, not from trial folders.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    storage = Path(storage_path).resolve()
    storage.mkdir(parents=True, exist_ok=True)
    progress = _trial_progress(total_trials, name)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            num_samples=num_samples,
            metric=metric,
            mode="min" if metric else None,
            search_alg=search_alg,
            scheduler=scheduler,
            max_concurrent_trials=max_concurrent or None,
            # a trial that ASHA stops must not leave its RLlib algorithm behind in a reused actor
            reuse_actors=scheduler is None,
        ),
        run_config=tune.RunConfig(
            storage_path=str(storage),
            name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
            verbose=1 if verbose else 0,
            callbacks=[progress],
            checkpoint_config=tune.CheckpointConfig(num_to_keep=keep_checkpoints),
        ),
    )
    with _quiet_tune(not verbose):
        results = tuner.fit()
    progress.close()
    if results.errors:
        raise RuntimeError(
            f"{len(results.errors)} Tune trial(s) of {name!r} failed; the first: {results.errors[0]!r}"
        )
    return [results[i] for i in range(len(results))]


@contextmanager
def _quiet_tune(quiet: bool) -> Iterator[None]:
    """Tune's new console output prints tables even at verbose=0; the old engine at 0 is silent.
    Its INFO lines and the warnings about trial folders without result files (we read results
    from memory) are hidden too."""
    if not quiet:
        yield
        return
    previous = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    tune_log = logging.getLogger("ray.tune")
    level = tune_log.level
    tune_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tune_log.setLevel(level)
        if previous is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = previous


def _trial_progress_class() -> type:
    from ray.tune import Callback

    class TrialProgress(Callback):
        """A tqdm bar that advances as trials finish."""

        def __init__(self, total: int, name: str):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=name, unit="trial", leave=False)

        def __getstate__(self) -> dict[str, Any]:
            # Tune pickles its callbacks with the experiment state; a bar holds the terminal stream.
            return {"bar": None}

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            if self.bar is not None:
                self.bar.update(1)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.on_trial_complete(iteration, trials, trial)

        def close(self) -> None:
            if self.bar is not None:
                self.bar.close()

    return TrialProgress


def _trial_progress(total: int, name: str) -> Any:
    """A TrialProgress callback (its class is built on first use: Tune is imported lazily)."""
    return _trial_progress_class()(total, name)


def cpus_available() -> float:
    import ray

    return float(ray.cluster_resources().get("CPU", 1.0))


def plain(value: Any) -> Any:
    """numpy scalars as Python numbers, for printing and JSON."""
    return value.item() if isinstance(value, np.generic) else value
