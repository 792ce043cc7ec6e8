"""Tracked runs: scalars per step to TensorBoard event files (and MLflow, when asked and installed).

Tags are namespaced and stable, so two runs compare in TensorBoard or MLflow side by side:
``train/loss``, ``train/samples_per_s``, ``stage{i}/busy_fraction``, ``stage{i}/queue_depth``,
``ps/rows``, ``ps/pull_rate``, ``ps/push_rate``, and at the end ``eval/auc``, ``eval/logloss``.
Live, the driver logs per chunk as it trains; after the fact, :meth:`RunTracker.log_summary` turns a
finished run's ``run_summary.json`` into the same tags. Example::

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

    def log_summary(self, summary: dict[str, Any]) -> None:
        """A finished run's ``run_summary.json`` (:class:`~heterps_ray.runtime.driver.RunSummary` as JSON):
        the loss of every step, samples/s of every chunk, and at the last step each stage's busy fraction
        and peak queue, the PS rows and pull/push rates (keys/s), eval AUC and logloss."""
        losses = summary.get("losses") or []
        for step, loss in enumerate(losses, start=1):
            self.log_scalars(step, {"train/loss": loss})
        steps, samples = int(summary.get("steps") or 0), int(summary.get("samples") or 0)
        batch = samples / steps if steps else 0.0
        done = 0
        for chunk_samples, seconds in (summary.get("extra") or {}).get("chunks") or []:
            done += chunk_samples
            if batch and seconds > 0:
                self.log_scalars(round(done / batch), {"train/samples_per_s": chunk_samples / seconds})
        final: dict[str, float] = {}
        for stage in summary.get("stages") or []:
            i = stage["index"]
            final[f"stage{i}/busy_fraction"] = stage.get("busy", float("nan"))
            peaks = [r.get("peak_pending", 0) for r in stage.get("replica_stats") or []]
            final[f"stage{i}/queue_depth"] = max(peaks) if peaks else float("nan")
        shards = summary.get("ps") or []
        seconds = float(summary.get("seconds") or 0.0)
        if shards:
            final["ps/rows"] = sum(sum((s.get("rows") or {}).values()) for s in shards)
            if seconds > 0:
                final["ps/pull_rate"] = sum(s.get("keys_pulled", 0) for s in shards) / seconds
                final["ps/push_rate"] = sum(s.get("keys_pushed", 0) for s in shards) / seconds
        self.log_scalars(max(steps, self._last_step), final)
        auc, logloss = summary.get("auc"), summary.get("logloss")
        self.log_final({"eval/auc": float("nan") if auc is None else auc,
                        "eval/logloss": float("nan") if logloss is None else logloss})  # fmt: skip

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
