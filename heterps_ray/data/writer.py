"""Writes a dataset directory (the layout of :mod:`heterps_ray.data.layout`) from raw-form rows.

``heterps data convert`` and ``heterps data synth`` write through :class:`DatasetWriter`; the
reader, :class:`~heterps_ray.data.dataset.Dataset`, lives apart so neither imports the other's
callers (synth writes, and the reader generates synthetic data on first use).

Besides the rows, ``_meta.json`` says what the sparse table will hold (costmodel/table_memory.py):
``distinct_values``, each slot's distinct values in both splits (:class:`DistinctCounter`), and
``train_keys_at_least``, per slot how many keys the train split shows in at least n rows, n = 1..8
(:class:`KeyFrequencies`): with admission a key gets a row at its ``admit_after``-th pull, so these
give the rows a table admits and the keys left waiting.
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

from heterps_ray.data.criteo import COLUMNS, NUM_SLOTS, RAW_SCHEMA, SPARSE_COLUMNS, hash_slot, splitmix64
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
        self._frequent = [KeyFrequencies(slot) for slot in range(NUM_SLOTS)]
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
        train = table
        if self.eval_every > 0:
            index = np.arange(self.rows_written, self.rows_written + n)
            to_eval = index % self.eval_every == self.eval_every - 1
            train = table.filter(pa.array(~to_eval))
            self._parts["eval"].write(table.filter(pa.array(to_eval)))
        self._parts["train"].write(train)
        for name, frequencies in zip(SPARSE_COLUMNS, self._frequent, strict=True):
            frequencies.add(train.column(name))
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
        # per slot: keys the train split shows in at least 1, 2, ..., MAX_N rows (admission's rows)
        meta["train_keys_at_least"] = {
            name: f.at_least() for name, f in zip(SPARSE_COLUMNS, self._frequent, strict=True)
        }
        meta["train_keys_at_least_method"] = KeyFrequencies.METHOD
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


class KeyFrequencies:
    """How many of one slot's keys (the sparse table's, heterps_ray.data.criteo.hash_slot) the rows
    added show in at least n rows, n = 1..``MAX_N``: with admission a key gets a row at the
    ``admit_after``-th pull call that shows it, so these count the rows a table admits and the keys
    left waiting.

    Exact while the slot has at most ``EXACT_MAX`` keys (each key's count is kept). Beyond, a hash
    sample (Gibbons' distinct sampling, VLDB 2001): only the keys whose hash falls under 2^-level are
    kept, with every occurrence of them counted, so their counts are distributed as the slot's; the
    level rises by one whenever more than ``EXACT_MAX`` are kept, and the figures are scaled by
    2^level. At most 64K keys a slot (1 MiB); the relative error of a figure is about
    1/sqrt(sampled keys it counts): 1% at 10,000 (a Criteo-sized slot's keys seen twice, say)."""

    EXACT_MAX = 1 << 16
    MAX_N = 8
    METHOD = (
        f"keys of the train split in at least n rows, n = 1..{MAX_N}: exact up to {EXACT_MAX:,} keys a slot, "
        "else a hash sample of the keys scaled up (about 1% error)"
    )
    _SALT = np.uint64(0x6A09E667F3BCC909)  # the sample's hash, apart from the table's and the shards'

    def __init__(self, slot: int, exact_max: int = EXACT_MAX):
        self.slot, self.exact_max = slot, exact_max
        self.level = 0  # keys kept: those whose hash's top `level` bits are all zero
        self._keys = np.zeros(0, dtype=np.uint64)
        self._counts = np.zeros(0, dtype=np.int64)

    def add(self, values: pa.Array | pa.ChunkedArray) -> None:
        """Count a string column's values (nulls: the empty string's key, as the reader hashes them)."""
        if len(values) == 0:
            return
        counted = pc.value_counts(values)  # each distinct value once, in C++
        keys = hash_slot(counted.field("values"), self.slot).view(np.uint64)
        counts = counted.field("counts").to_numpy()
        kept = self._sampled(keys)
        keys, inverse = np.unique(np.concatenate([self._keys, keys[kept]]), return_inverse=True)
        weights = np.concatenate([self._counts, counts[kept]]).astype(np.float64)
        self._keys, self._counts = keys, np.bincount(inverse, weights, len(keys)).astype(np.int64)
        while len(self._keys) > self.exact_max:
            self.level += 1
            kept = self._sampled(self._keys)
            self._keys, self._counts = self._keys[kept], self._counts[kept]

    def at_least(self) -> list[int]:
        """Keys seen in at least n rows, for n = 1..MAX_N (the first: the slot's distinct keys)."""
        scale = float(2**self.level)
        return [int(round(np.count_nonzero(self._counts >= n) * scale)) for n in range(1, self.MAX_N + 1)]

    def _sampled(self, keys: np.ndarray) -> np.ndarray:
        if self.level == 0:
            return np.ones(len(keys), dtype=bool)
        return (splitmix64(keys ^ self._SALT) >> np.uint64(64 - self.level)) == 0


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
