"""Tracked runs: scalars per step to TensorBoard event files (and MLflow, when asked and installed).

Tags are namespaced and stable, so two runs compare in TensorBoard or MLflow side by side:
``train/loss``, ``train/samples_per_s``, ``stage{i}/busy_fraction``, ``stage{i}/queue_depth``,
``ps/rows``, ``ps/pull_rate``, ``ps/push_rate``, and at the end ``eval/auc``, ``eval/logloss``.
Example::

    with RunTracker(job.output_dir) as tracker:
        tracker.log_scalars(step, {"train/loss": 0.47, "train/samples_per_s": 24_800})
        tracker.log_final({"eval/auc": 0.7658, "eval/logloss": 0.4755})
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any

from heterps_ray.errors import ConfigError

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"


class RunTracker:
    """Writes a run's scalars to ``output_dir/tensorboard`` (and to the active MLflow run with ``mlflow=True``).

    ``mlflow=True`` without the package installed logs a warning and tracks to TensorBoard only: the
    run must not fail for want of a tracker. Non-finite values are skipped (TensorBoard plots them as gaps
    anyway, MLflow refuses them).
    """

    def __init__(self, output_dir: str | Path, mlflow: bool = False, run_name: str | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(output_dir) / TENSORBOARD_DIR
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))
        self._last_step = 0
        self._mlflow: Any = None
        if mlflow:
            if importlib.util.find_spec("mlflow") is None:
                log.warning("mlflow is not installed (pip install 'heterps_ray[mlflow]'): TensorBoard only")
            else:
                import mlflow as mlflow_module

                self._mlflow = mlflow_module
                mlflow_module.start_run(run_name=run_name)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Scalars at global step ``step`` (batches trained so far)."""
        if step < 0:
            raise ConfigError(None, "step", "a non-negative integer", step)
        finite = _finite(scalars)
        for tag, value in finite.items():
            self._writer.add_scalar(tag, value, global_step=step)
        if self._mlflow is not None and finite:
            self._mlflow.log_metrics(finite, step=step)
        self._last_step = max(self._last_step, step)

    def log_final(self, metrics: dict[str, float]) -> None:
        """End-of-run metrics (AUC, logloss, ...), at the last step logged."""
        self.log_scalars(self._last_step, metrics)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the event files in ``log_dir``: tag -> [(step, value), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _finite(scalars: dict[str, float]) -> dict[str, float]:
    out = {}
    for tag, value in scalars.items():
        number = float(value)
        if math.isfinite(number):
            out[tag] = number
    return out
