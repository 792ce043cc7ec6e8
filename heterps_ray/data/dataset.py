"""A dataset directory: ``_meta.json`` and the Parquet partitions of each split (``split=train/``,
``split=eval/``; see :mod:`heterps_ray.data.layout`, which also reads the older ``meta.json`` +
``train/`` + ``eval/`` layout).

Parquet holds the raw Criteo form (:data:`~heterps_ray.data.criteo.RAW_SCHEMA`); batches are
made on read by :func:`~heterps_ray.data.criteo.table_to_batch`. Order is deterministic: files
sorted by name, rows in file order. Other readers open the directory as one table with a
``split`` column: ``pandas.read_parquet(path)``, ``pyarrow.dataset.dataset(path, partitioning="hive")``.
Example::

    ds = Dataset("data/synth-1m")
    for batch in ds.iter_batches("train", 512, files=partition_files(ds.files("train"), 2, 0)):
        ...
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
    SPARSE_COLUMNS,
    Batch,
    table_to_batch,
)
from heterps_ray.data.layout import (
    LEGACY_META_FILE,
    META_FILE,
    PART_GLOB,
    SPLITS,
    is_dataset,
    meta_path,
    part_name,
    split_dir,
)
from heterps_ray.data.synth import synthesize
from heterps_ray.errors import DataError
from heterps_ray.paths import inside

READ_ROWS = 1 << 16  # rows read and converted at a time by iter_batches


class Dataset:
    """A dataset directory written by ``heterps data convert`` or ``heterps data synth``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        found = meta_path(self.path)
        if found is None:
            raise DataError(
                f"{self.path}: not a dataset directory (expected {META_FILE}, split=train/ and split=eval/, "
                f"or the older {LEGACY_META_FILE}, train/ and eval/; "
                "make one with `heterps data convert` or `heterps data synth`)"
            )
        self._meta_file = found
        self._legacy = found.name == LEGACY_META_FILE
        try:
            self._meta = json.loads(found.read_text())
        except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8 text
            raise DataError(f"{found}: unreadable ({exc})") from None
        if not isinstance(self._meta, dict):
            raise DataError(f"{found}: expected a JSON object, got {type(self._meta).__name__}")

    @property
    def meta(self) -> dict[str, Any]:
        return self._meta

    def files(self, split: str) -> list[Path]:
        """The Parquet partitions of ``split``, sorted by name; a DataError if one the metadata counts is gone."""
        if split not in SPLITS:
            raise DataError(f"{self.path}: unknown split {split!r} (expected one of {list(SPLITS)})")
        folder = split_dir(self.path, split, self._legacy)
        field = f"files.{split}"
        counts = self._meta.get("files") or {}
        expected = counts.get(split) if isinstance(counts, dict) else counts
        counted = isinstance(expected, int) and not isinstance(expected, bool) and expected >= 0
        if expected is not None and not counted:
            # The metadata counts partitions, it never names them: a name in it would point anywhere.
            raise DataError(
                f"{self._meta_file}: field '{field if isinstance(counts, dict) else 'files'}': expected "
                f"the number of {split} partitions (they are {folder.name}/{PART_GLOB}), got {expected!r}"
            )
        # A partition (or its split folder) that is a symlink out of the dataset is refused.
        found = [
            inside(self.path, p.relative_to(self.path).as_posix(), source=self._meta_file, field=field)
            for p in sorted(folder.glob(PART_GLOB))
        ]
        if isinstance(expected, int):
            # A lost partition would otherwise train on fewer rows without a word.
            names = {p.name for p in found}
            missing = [n for n in (part_name(i) for i in range(expected)) if n not in names]
            if missing:
                raise DataError(
                    f"{folder / missing[0]}: missing ({len(missing)} of the {expected} {split} "
                    f"partitions {self._meta_file.name} lists are gone: {missing[:5]})"
                )
        return found

    def verify(self) -> Dataset:
        """Check every partition is there and is a readable Parquet file with the raw columns (DataError
        naming the file), so a bad part stops a job before any actor starts."""
        for split in SPLITS:
            for f in self.files(split):
                _open_part(f)
        return self

    def num_rows(self, split: str, files: list[Path] | None = None) -> int:
        """Rows of ``split`` (or of ``files``), from the Parquet metadata."""
        chosen = self.files(split) if files is None else [Path(f) for f in files]
        return sum(_parquet_file(f).metadata.num_rows for f in chosen)

    def load(self, split: str, files: list[Path] | None = None) -> Batch:
        """All rows of ``split`` (or of ``files``, in that order) as one in-memory Batch."""
        parts = [table_to_batch(t) for t in self._tables(split, files)]
        if not parts:
            return _empty_batch()
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def iter_batches(
        self,
        split: str,
        batch_size: int,
        files: list[Path] | None = None,
        drop_last: bool = True,
        workers: int = 1,
        skip: int = 0,
    ) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows in deterministic order; a batch may span two files.
        `workers` > 1: that many threads convert the read chunks (key hashing and the dense transform
        release the GIL), up to `workers` chunks ahead; the batches are the same. `skip`: start at batch
        `skip`, its rows before it neither converted nor read where the files' metadata can skip them
        (a resume deep into an epoch of millions of rows must not convert them all again)."""
        if batch_size < 1:
            raise DataError(f"batch_size: expected a positive integer, got {batch_size}")
        rest: Batch | None = None
        for chunk in self._converted(split, files, workers, skip * batch_size):
            if rest is not None:
                chunk = {k: np.concatenate([rest[k], chunk[k]]) for k in chunk}
            n = len(chunk["label"])
            full = n - n % batch_size
            for start in range(0, full, batch_size):
                yield {k: v[start : start + batch_size] for k, v in chunk.items()}
            rest = {k: v[full:] for k, v in chunk.items()} if full < n else None
        if rest is not None and not drop_last:
            yield rest

    def _converted(
        self, split: str, files: list[Path] | None, workers: int, skip_rows: int = 0
    ) -> Iterator[Batch]:
        """Each read chunk as a Batch, in order, converted by `workers` threads."""
        if workers <= 1:
            yield from (table_to_batch(table) for table in self._tables(split, files, skip_rows))
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="convert") as pool:
            pending: deque[Future[Batch]] = deque()
            for table in self._tables(split, files, skip_rows):
                pending.append(pool.submit(table_to_batch, table))
                if len(pending) > workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def _tables(self, split: str, files: list[Path] | None, skip_rows: int = 0) -> Iterator[pa.Table]:
        """The raw rows in read chunks, from row `skip_rows` on: whole files and row groups before it
        skipped by their metadata, the rest of the way sliced off unconverted."""
        for f in self.files(split) if files is None else [Path(f) for f in files]:
            parquet = _open_part(f)
            if skip_rows >= parquet.metadata.num_rows:
                skip_rows -= parquet.metadata.num_rows
                continue
            groups = list(range(parquet.num_row_groups))
            while groups and 0 < parquet.metadata.row_group(groups[0]).num_rows <= skip_rows:
                skip_rows -= parquet.metadata.row_group(groups.pop(0)).num_rows
            for record_batch in parquet.iter_batches(batch_size=READ_ROWS, columns=COLUMNS, row_groups=groups):
                if skip_rows >= record_batch.num_rows:
                    skip_rows -= record_batch.num_rows
                    continue
                if skip_rows:
                    record_batch, skip_rows = record_batch.slice(skip_rows), 0
                yield pa.Table.from_batches([record_batch])


def prepare_dataset(data: DataConfig, seed: int = 0) -> Dataset:
    """The job's dataset; generated first when its directory holds none and ``data.synth_rows`` is set.

    The one place a job's data comes from (``heterps run``, ``train``, ``reference``, ``profile``).
    """
    path = Path(data.path)
    if not is_dataset(path) and data.synth_rows:
        synthesize(path, data.synth_rows, seed=seed)
    return Dataset(path).verify()


def partition_files(files: list[Path], n: int, i: int) -> list[Path]:
    """Partition ``i`` of ``n`` disjoint, deterministic ones (round robin over sorted names).

    Partitions are empty when ``n`` exceeds the number of files.
    """
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"partition {i} of {n}: expected n >= 1 and 0 <= i < n")
    return sorted(files, key=lambda p: Path(p).name)[i::n]


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
