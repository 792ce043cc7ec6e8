"""heterps_ray.data: Criteo text and Parquet readers, the dataset directory, synthetic data.

The names below import their module on first use, so the CLI starts without loading pyarrow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

DEFAULT_ROWS_PER_PART = 100_000
DEFAULT_EVAL_FRACTION = 0.1

_LAZY = {
    "Batch": "criteo",
    "BadRows": "criteo",
    "read_text": "criteo",
    "read_table": "criteo",
    "write_text": "criteo",
    "table_to_batch": "criteo",
    "Dataset": "dataset",
    "DatasetWriter": "writer",
    "is_dataset": "layout",
    "partition_files": "dataset",
    "convert": "convert",
    "synthesize": "synth",
    "SynthSpec": "synth",
}

if TYPE_CHECKING:
    from heterps_ray.data.convert import convert
    from heterps_ray.data.criteo import BadRows, Batch, read_table, read_text, table_to_batch, write_text
    from heterps_ray.data.dataset import Dataset, partition_files
    from heterps_ray.data.layout import is_dataset
    from heterps_ray.data.synth import SynthSpec, synthesize
    from heterps_ray.data.writer import DatasetWriter


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"heterps_ray.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'heterps_ray.data' has no attribute {name!r}")


__all__ = [
    "DEFAULT_EVAL_FRACTION",
    "DEFAULT_ROWS_PER_PART",
    "BadRows",
    "Batch",
    "Dataset",
    "DatasetWriter",
    "SynthSpec",
    "convert",
    "is_dataset",
    "partition_files",
    "read_table",
    "read_text",
    "synthesize",
    "table_to_batch",
    "write_text",
]
