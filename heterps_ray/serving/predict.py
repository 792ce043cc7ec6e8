"""`heterps predict`: batch scoring of Parquet rows with a trained model, on Ray Data.

The rows are read with ``ray.data.read_parquet`` and scored by ``map_batches`` over a pool of
scorer actors, each holding the model (so scoring spreads over every node the Ray cluster has;
the model directory and the data must be on storage every node reads). Keys the model never saw
get their initial rows, as in the run's own evaluation. The output has one row per input row, in
input order (split by split, files by name): ``split``, ``label`` (when the input has one),
``logit``, ``probability``. Example::

    result = predict("runs/quickstart", "runs/quickstart/data", "runs/scores.parquet", splits=["eval"])
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from heterps_ray.data.criteo import COLUMNS, LABEL_COLUMN
from heterps_ray.data.layout import SPLITS, is_dataset
from heterps_ray.errors import DataError
from heterps_ray.serving.export import model_dir

log = logging.getLogger(__name__)

DEFAULT_BATCH_ROWS = 4096
OUTPUT_SCHEMA = pa.schema(
    [("split", pa.string()), ("label", pa.float32()), ("logit", pa.float32()), ("probability", pa.float32())]
)


class _Scorer:
    """One Ray Data actor: the model, loaded once, scoring raw-form Arrow batches."""

    def __init__(self, model: str):
        import torch

        from heterps_ray.runtime.checkpoint import load_checkpoint

        torch.set_num_threads(1)
        self.checkpoint = load_checkpoint(model)

    def __call__(self, table: pa.Table) -> pa.Table:
        from heterps_ray.data.criteo import table_to_batch

        labelled = LABEL_COLUMN in table.column_names
        if not labelled:  # serving data: no label to carry, the conversion still wants the column
            table = table.append_column(LABEL_COLUMN, pa.array(np.zeros(table.num_rows, np.int8)))
        batch = table_to_batch(table)
        logit = self.checkpoint.predict(batch).astype(np.float32).ravel()
        probability = (1.0 / (1.0 + np.exp(-logit.astype(np.float64)))).astype(np.float32)
        label = batch["label"] if labelled else np.full(len(logit), np.nan, np.float32)
        return pa.table({"label": label, "logit": logit, "probability": probability})


def predict(
    output_dir: str | Path,
    data: str | Path,
    output: str | Path,
    *,
    splits: list[str] | None = None,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    actors: int = 1,
    address: str | None = None,
) -> dict[str, Any]:
    """Score ``data`` (a dataset directory, or Parquet files of raw Criteo rows) with the model of the run
    in ``output_dir``; write ``output`` (Parquet) and return {"rows", "splits", "metrics"}."""
    import ray

    from heterps_ray.cluster import connect
    from heterps_ray.runtime.evaluation import evaluate_logits
    from heterps_ray.runtime.warm import release_idle

    model = model_dir(output_dir)
    inputs = _inputs(Path(data), splits)
    if actors < 1 or batch_rows < 1:
        raise DataError(f"--actors and --batch-rows: expected positive integers, got {actors} and {batch_rows}")
    out = Path(output)
    if out.is_dir():
        raise DataError(f"{out}: a directory; expected the path of the Parquet file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    owns_ray = connect(None, address)
    # a train() earlier in this driver leaves idle warm actors holding their CPUs: Ray Data's scoring
    # actors would wait for them (up to warm.IDLE_S)
    release_idle()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    counts: dict[str, int] = {}
    metrics: dict[str, dict[str, float]] = {}
    if not log.isEnabledFor(logging.INFO):
        # Ray Data logs progress at INFO and re-reads its level from here whenever it runs: quiet
        # unless the user asked for more (heterps -v).
        os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
        logging.getLogger("ray.data").setLevel(os.environ["RAY_DATA_LOG_LEVEL"])
    try:
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True  # one output row per input row, in input order
        with pq.ParquetWriter(tmp, OUTPUT_SCHEMA) as writer:
            for split, files in inputs.items():
                scored = ray.data.read_parquet([str(f) for f in files], partitioning=None).map_batches(
                    _Scorer,
                    fn_constructor_args=(str(model),),
                    batch_size=batch_rows,
                    batch_format="pyarrow",
                    compute=ray.data.ActorPoolStrategy(size=actors),
                    num_cpus=1,
                )
                labels, logits = [], []
                for block in scored.iter_batches(batch_size=None, batch_format="pyarrow"):
                    part: pa.Table = block.select(["label", "logit", "probability"])  # type: ignore[union-attr]
                    split_column = pa.array([split] * part.num_rows, pa.string())
                    writer.write_table(pa.Table.from_arrays([split_column, *part.columns], schema=OUTPUT_SCHEMA))
                    labels.append(part.column("label").to_numpy())
                    logits.append(part.column("logit").to_numpy())
                label = np.concatenate(labels) if labels else np.zeros(0, np.float32)
                counts[split] = len(label)
                if len(label) and not np.isnan(label).any():
                    metrics[split] = evaluate_logits(label, np.concatenate(logits))
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
        if owns_ray:
            ray.shutdown()
    return {"rows": sum(counts.values()), "splits": counts, "metrics": metrics, "output": str(out)}


def _inputs(data: Path, splits: list[str] | None) -> dict[str, list[Path]]:
    """Files to score per split: a dataset's splits (all, or ``splits``), else the Parquet file(s) at
    ``data`` as one split named "all" (files starting with _ or . skipped, as other readers do)."""
    if is_dataset(data):
        from heterps_ray.data.dataset import Dataset

        dataset = Dataset(data)
        wanted = list(SPLITS) if splits is None else splits
        found = {split: dataset.files(split) for split in wanted}
        inputs = {split: files for split, files in found.items() if files}
    else:
        if splits is not None:
            raise DataError(f"{data}: --split needs a dataset directory (with _meta.json)")
        if data.is_file():
            files = [data]
        else:
            files = sorted(
                p for p in data.rglob("*.parquet")
                if not any(part.startswith(("_", ".")) for part in p.relative_to(data).parts)
            )  # fmt: skip
        inputs = {"all": files} if files else {}
    if not inputs:
        raise DataError(f"{data}: no Parquet rows to score (expected a dataset directory or Parquet files)")
    for files in inputs.values():
        _check_columns(files[0])
    return inputs


def _check_columns(path: Path) -> None:
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    missing = [c for c in COLUMNS if c != LABEL_COLUMN and c not in names]
    if missing:
        raise DataError(f"{path}: missing columns {missing} (expected I1..I13, C1..C26, optionally label)")
