"""A dataset directory: ``train/part-*.parquet``, ``eval/part-*.parquet`` and ``meta.json``.

Parquet holds the raw Criteo form (:data:`~heterps_ray.data.criteo.RAW_SCHEMA`); batches are
made on read by :func:`~heterps_ray.data.criteo.table_to_batch`. Order is deterministic: files
sorted by name, rows in file order. Example::

    ds = Dataset("data/synth-1m")
    for batch in ds.iter_batches("train", 512, files=partition_files(ds.files("train"), 2, 0)):
        ...
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from heterps_ray.config import DataConfig
from heterps_ray.data.criteo import (
    COLUMNS,
    NUM_DENSE,
    NUM_SLOTS,
    RAW_SCHEMA,
    SPARSE_COLUMNS,
    Batch,
    table_to_batch,
)
from heterps_ray.errors import ConfigError, DataError

SPLITS = ("train", "eval")
META_FILE = "meta.json"
PART_GLOB = "part-*.parquet"
FORMAT = "heterps_ray.dataset/1"
_READ_ROWS = 1 << 16  # rows read and converted at a time by iter_batches


class Dataset:
    """A dataset directory written by ``heterps data convert`` or ``heterps data synth``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            raise DataError(
                f"{self.path}: not a dataset directory (expected {META_FILE}, train/ and eval/; "
                "make one with `heterps data convert` or `heterps data synth`)"
            )
        try:
            self._meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"{meta_path}: unreadable ({exc})") from None
        if not isinstance(self._meta, dict):
            raise DataError(f"{meta_path}: expected a JSON object, got {type(self._meta).__name__}")

    @property
    def meta(self) -> dict[str, Any]:
        return self._meta

    def files(self, split: str) -> list[Path]:
        """The Parquet partitions of ``split``, sorted by name; a DataError if one meta.json counts is gone."""
        if split not in SPLITS:
            raise DataError(f"{self.path}: unknown split {split!r} (expected one of {list(SPLITS)})")
        found = sorted((self.path / split).glob(PART_GLOB))
        expected = (self._meta.get("files") or {}).get(split)
        if isinstance(expected, int):
            # A lost partition would otherwise train on fewer rows without a word.
            names = {p.name for p in found}
            missing = [n for n in (_part_name(i) for i in range(expected)) if n not in names]
            if missing:
                raise DataError(
                    f"{self.path / split / missing[0]}: missing ({len(missing)} of the {expected} {split} "
                    f"partitions {META_FILE} lists are gone: {missing[:5]})"
                )
        return found

    def verify(self) -> Dataset:
        """Check every partition is there and is a readable Parquet file with the raw columns (DataError
        naming the file), so a bad part stops a job before any actor starts."""
        for split in SPLITS:
            for f in self.files(split):
                _open_part(f)
        return self

    def num_rows(self, split: str) -> int:
        return sum(_parquet_file(f).metadata.num_rows for f in self.files(split))

    def load(self, split: str, files: list[Path] | None = None) -> Batch:
        """All rows of ``split`` (or of ``files``, in that order) as one in-memory Batch."""
        parts = [table_to_batch(t) for t in self._tables(split, files)]
        if not parts:
            return _empty_batch()
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def iter_batches(
        self, split: str, batch_size: int, files: list[Path] | None = None, drop_last: bool = True
    ) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows in deterministic order; a batch may span two files."""
        if batch_size < 1:
            raise DataError(f"batch_size: expected a positive integer, got {batch_size}")
        rest: Batch | None = None
        for table in self._tables(split, files):
            chunk = table_to_batch(table)
            if rest is not None:
                chunk = {k: np.concatenate([rest[k], chunk[k]]) for k in chunk}
            n = len(chunk["label"])
            full = n - n % batch_size
            for start in range(0, full, batch_size):
                yield {k: v[start : start + batch_size] for k, v in chunk.items()}
            rest = {k: v[full:] for k, v in chunk.items()} if full < n else None
        if rest is not None and not drop_last:
            yield rest

    def _tables(self, split: str, files: list[Path] | None) -> Iterator[pa.Table]:
        for f in self.files(split) if files is None else [Path(f) for f in files]:
            parquet = _open_part(f)
            for record_batch in parquet.iter_batches(batch_size=_READ_ROWS, columns=COLUMNS):
                yield pa.Table.from_batches([record_batch])


def prepare_dataset(data: DataConfig, seed: int = 0) -> Dataset:
    """The job's dataset; generated first when its directory holds none and ``data.synth_rows`` is set.

    The one place a job's data comes from (``heterps run``, ``train``, ``reference``, ``profile``).
    """
    path = Path(data.path)
    if not (path / META_FILE).is_file() and data.synth_rows:
        from heterps_ray.data.synth import synthesize  # synth writes through this module

        synthesize(path, data.synth_rows, seed=seed)
    return Dataset(path).verify()


class DatasetWriter:
    """Writes a dataset directory: rows in order, every ``eval_every``-th row to eval.

    Row ``i`` (0-based, counting every row written) goes to eval when
    ``eval_every > 0 and i % eval_every == eval_every - 1``, else to train. Each split is cut
    into parts of ``rows_per_part`` rows. Files go to a temporary sibling directory that
    replaces ``output`` only when :meth:`close` succeeds, so a failed run leaves nothing behind.
    """

    def __init__(self, output: str | Path, *, rows_per_part: int, eval_every: int, overwrite: bool = False):
        if rows_per_part < 1:
            raise ConfigError(None, "rows_per_part", "a positive integer", rows_per_part)
        self.output = Path(output)
        _check_output(self.output, overwrite)
        self.eval_every = eval_every
        self.rows_written = 0
        self._tmp = self.output.parent / f".{self.output.name}.tmp-{os.getpid()}"
        shutil.rmtree(self._tmp, ignore_errors=True)
        try:
            self._parts = {s: _PartWriter(self._tmp / s, rows_per_part) for s in SPLITS}
        except OSError as exc:
            raise DataError(f"{self.output}: cannot write there ({exc.strerror})") from None

    def write(self, table: pa.Table) -> None:
        """Append raw-form rows (:data:`~heterps_ray.data.criteo.RAW_SCHEMA`)."""
        table = table.select(COLUMNS).cast(RAW_SCHEMA)
        n = table.num_rows
        if self.eval_every > 0:
            index = np.arange(self.rows_written, self.rows_written + n)
            to_eval = index % self.eval_every == self.eval_every - 1
            self._parts["eval"].write(table.filter(pa.array(to_eval)))
            self._parts["train"].write(table.filter(pa.array(~to_eval)))
        else:
            self._parts["train"].write(table)
        self.rows_written += n

    def close(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Finish the files, write meta.json (with row and file counts) and move into place."""
        meta = dict(meta)
        meta["format"] = FORMAT
        meta["rows"] = {s: w.rows for s, w in self._parts.items()}
        meta["files"] = {s: w.close() for s, w in self._parts.items()}
        meta["split_rule"] = {
            "eval_every": self.eval_every,
            "rule": "row i (0-based) goes to eval when eval_every > 0 and i % eval_every == eval_every - 1",
        }
        (self._tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if self.output.exists():
            shutil.rmtree(self.output)
        self._tmp.rename(self.output)
        return meta

    def abort(self) -> None:
        for w in self._parts.values():
            w.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


class _PartWriter:
    def __init__(self, folder: Path, rows_per_part: int):
        self.folder, self.rows_per_part = folder, rows_per_part
        self.rows = 0
        self._files = 0
        self._writer: pq.ParquetWriter | None = None
        self._in_file = 0
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self._writer is None:
                path = self.folder / _part_name(self._files)
                self._writer = pq.ParquetWriter(path, RAW_SCHEMA)
                self._files += 1
                self._in_file = 0
            take = min(table.num_rows, self.rows_per_part - self._in_file)
            self._writer.write_table(table.slice(0, take))
            table = table.slice(take)
            self._in_file += take
            self.rows += take
            if self._in_file == self.rows_per_part:
                self._writer.close()
                self._writer = None

    def close(self) -> int:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self._files


def eval_every(eval_fraction: float) -> int:
    """Every how many rows one goes to eval, for a wanted fraction (0 -> no eval split)."""
    if not 0 <= eval_fraction <= 0.5:
        raise ConfigError(None, "eval_fraction", "a number in [0, 0.5]", eval_fraction)
    return round(1 / eval_fraction) if eval_fraction > 0 else 0


def _check_output(output: Path, overwrite: bool) -> None:
    if not output.exists():
        return
    if output.is_dir() and not any(output.iterdir()):
        return
    if output.is_dir() and (output / META_FILE).is_file():
        if overwrite:
            return
        raise DataError(f"{output}: a dataset is already there (pass --overwrite to replace it)")
    raise DataError(f"{output}: exists and is not a dataset directory; choose another --output")


def partition_files(files: list[Path], n: int, i: int) -> list[Path]:
    """Partition ``i`` of ``n`` disjoint, deterministic ones (round robin over sorted names).

    Partitions are empty when ``n`` exceeds the number of files.
    """
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"partition {i} of {n}: expected n >= 1 and 0 <= i < n")
    return sorted(files, key=lambda p: Path(p).name)[i::n]


def _part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _open_part(path: Path) -> pq.ParquetFile:
    """A partition opened for reading, with the raw columns checked first (pyarrow raises a bare
    KeyError when a dictionary column is absent)."""
    missing = [c for c in COLUMNS if c not in _parquet_file(path).schema_arrow.names]
    if missing:
        raise DataError(f"{path}: missing columns {missing} (expected label, I1..I13, C1..C26)")
    return _parquet_file(path, read_dictionary=SPARSE_COLUMNS)


def _parquet_file(path: Path, read_dictionary: list[str] | None = None) -> pq.ParquetFile:
    # Categorical columns read as dictionaries: hashing then touches each distinct value once.
    try:
        return pq.ParquetFile(path, read_dictionary=read_dictionary)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None


def _empty_batch() -> Batch:
    return {
        "label": np.zeros(0, dtype=np.float32),
        "dense": np.zeros((0, NUM_DENSE), dtype=np.float32),
        "keys": np.zeros((0, NUM_SLOTS), dtype=np.int64),
    }
