"""Where a dataset directory keeps its files, in the layout written now and in the one before it.

Written now (what pandas, pyarrow, DuckDB, Spark and Ray Data read as one table with a ``split``
column: they skip names that start with ``_`` and read ``key=value`` folders as hive partitions)::

    _meta.json
    split=train/part-00000.parquet ...
    split=eval/part-00000.parquet ...

Read too (datasets written before): ``meta.json``, ``train/``, ``eval/``.
"""

from __future__ import annotations

from pathlib import Path

SPLITS = ("train", "eval")
META_FILE = "_meta.json"
LEGACY_META_FILE = "meta.json"
PART_GLOB = "part-*.parquet"
FORMAT = "heterps_ray.dataset/2"


def meta_path(path: Path) -> Path | None:
    """The metadata file of the dataset at ``path`` (either layout), or None when it holds none."""
    for name in (META_FILE, LEGACY_META_FILE):
        if (path / name).is_file():
            return path / name
    return None


def is_dataset(path: str | Path) -> bool:
    """Whether ``path`` holds a dataset directory (either layout)."""
    return meta_path(Path(path)) is not None


def split_dir(path: Path, split: str, legacy: bool = False) -> Path:
    """The folder of ``split``'s partitions: ``split=<name>/`` (``<name>/`` in the legacy layout)."""
    return path / (split if legacy else f"split={split}")


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"
