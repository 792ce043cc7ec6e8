"""Writes a dataset directory (the layout of :mod:`heterps_ray.data.layout`) from raw-form rows.

``heterps data convert`` and ``heterps data synth`` write through :class:`DatasetWriter`; the
reader, :class:`~heterps_ray.data.dataset.Dataset`, lives apart so neither imports the other's
callers (synth writes, and the reader generates synthetic data on first use).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from heterps_ray.data.criteo import COLUMNS, NUM_SLOTS, RAW_SCHEMA, SPARSE_COLUMNS
from heterps_ray.data.layout import FORMAT, META_FILE, SPLITS, is_dataset, part_name, split_dir
from heterps_ray.errors import ConfigError, DataError


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
        self._distinct = [DistinctCounter() for _ in range(NUM_SLOTS)]
        self._tmp = self.output.parent / f".{self.output.name}.tmp-{os.getpid()}"
        shutil.rmtree(self._tmp, ignore_errors=True)
        try:
            self._parts = {s: _PartWriter(split_dir(self._tmp, s), rows_per_part) for s in SPLITS}
        except OSError as exc:
            raise DataError(f"{self.output}: cannot write there ({exc.strerror})") from None

    def write(self, table: pa.Table) -> None:
        """Append raw-form rows (:data:`~heterps_ray.data.criteo.RAW_SCHEMA`)."""
        table = table.select(COLUMNS).cast(RAW_SCHEMA)
        n = table.num_rows
        for name, counter in zip(SPARSE_COLUMNS, self._distinct, strict=True):
            counter.add(table.column(name))
        if self.eval_every > 0:
            index = np.arange(self.rows_written, self.rows_written + n)
            to_eval = index % self.eval_every == self.eval_every - 1
            self._parts["eval"].write(table.filter(pa.array(to_eval)))
            self._parts["train"].write(table.filter(pa.array(~to_eval)))
        else:
            self._parts["train"].write(table)
        self.rows_written += n

    def close(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Finish the files, write _meta.json (with row and file counts) and move into place."""
        meta = dict(meta)
        meta["format"] = FORMAT
        meta["rows"] = {s: w.rows for s, w in self._parts.items()}
        meta["files"] = {s: w.close() for s, w in self._parts.items()}
        # the keys each slot gives the sparse table (train and eval): the table's expected rows
        meta["distinct_values"] = {
            name: c.count() for name, c in zip(SPARSE_COLUMNS, self._distinct, strict=True)
        }
        meta["distinct_values_total"] = sum(meta["distinct_values"].values())
        meta["distinct_values_method"] = DistinctCounter.METHOD
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
                path = self.folder / part_name(self._files)
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


class DistinctCounter:
    """How many distinct values one slot's column has had (a missing value counts as the empty
    string, as the keys do, so it is the number of keys the sparse table sees): exact while at most
    ``EXACT_MAX`` (the distinct values are kept), then a HyperLogLog estimate (Flajolet et al.
    2007) with 2^16 one-byte registers, updated in C (heterps_ray.ps._rows.hll_add_strings), so a
    slot of 10M values costs 64 KiB and about 10 ns per value (relative error about
    1.04/sqrt(2^16) = 0.4%)."""

    EXACT_MAX = 100_000
    _P = 16  # register index bits
    METHOD = f"exact up to {EXACT_MAX:,} per slot, else HyperLogLog with 2^{_P} registers (about 0.5% error)"

    def __init__(self) -> None:
        self._exact: pa.Array | None = pa.array([], pa.string())
        self._registers = np.zeros(1 << self._P, dtype=np.uint8)

    def add(self, values: pa.Array | pa.ChunkedArray) -> None:
        """Count the values of a string column (nulls: the empty string)."""
        chunked = values if isinstance(values, pa.ChunkedArray) else pa.chunked_array([values])
        if not pa.types.is_string(chunked.type):
            chunked = pc.cast(chunked, pa.string())
        if self._exact is not None:
            seen = pc.unique(pa.chunked_array([self._exact, pc.fill_null(pc.unique(chunked), "")]))
            if len(seen) <= self.EXACT_MAX:
                self._exact = seen
                return
            self._exact, chunked = None, pa.chunked_array([seen])
        from heterps_ray.ps._rows import hll_add_strings

        for chunk in chunked.chunks:
            validity, offsets, data = chunk.buffers()
            hll_add_strings(
                self._registers, self._P, offsets, data, validity if chunk.null_count else None,
                chunk.offset, len(chunk),
            )  # fmt: skip

    def count(self) -> int:
        if self._exact is not None:
            return len(self._exact)
        m = float(len(self._registers))
        estimate = (
            0.7213 / (1 + 1.079 / m) * m * m / float(np.sum(np.exp2(-self._registers.astype(np.float64))))
        )
        zeros = int((self._registers == 0).sum())
        if estimate <= 2.5 * m and zeros:  # small range: linear counting
            estimate = m * np.log(m / zeros)
        return int(round(estimate))


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
    if output.is_dir() and is_dataset(output):
        if overwrite:
            return
        raise DataError(f"{output}: a dataset is already there (pass --overwrite to replace it)")
    raise DataError(f"{output}: exists and is not a dataset directory; choose another --output")
