"""Criteo columns, the text reader (raw TSV or header CSV), and the one batch conversion.

Forms read by :func:`read_text` (detected from the first line):

* raw TSV (Criteo's day files): no header, 40 tab-separated fields per line:
  ``label, I1..I13 (integers), C1..C26 (8-hex strings)``; an empty field is a missing value.
* header CSV (``tests/data/criteo_sample.txt``): a first line ``label,I1,...,C26``, then rows.

The first line is a header when its first field is ``label``; the separator is a tab when the
first line holds one, else a comma. Gzip/bz2/zstd input is decompressed by file extension.
Blank lines are ignored. A malformed row (wrong field count, label not 0/1, non-numeric or
non-finite dense value, bytes that are not UTF-8) is counted in a :class:`BadRows` with its
``file:line`` and skipped with a warning, or raises :class:`~heterps_ray.errors.DataError`
when ``strict``.

The raw form (:data:`RAW_SCHEMA`: label int8, I1..I13 float64 with nulls, C1..C26 strings with
nulls) is what Parquet stores. :func:`table_to_batch` turns it into a :data:`Batch`:

* ``dense = log1p(max(x, 0))``, missing -> 0 (Criteo's usual transform; negatives clip to 0).
* ``keys``: one stable 64-bit key per slot. With ``v`` the value's UTF-8 bytes (missing -> the
  empty string) and ``s`` the slot index (C1 -> 0 ... C26 -> 25)::

      key = splitmix64(siphash24(v, key=b"heterps_ray_keys") XOR splitmix64(s))

  ``siphash24`` is SipHash-2-4 as computed by ``pandas.util.hash_array`` (not Python's
  ``hash()``, which is salted per process); splitmix64 is Vigna's 64-bit finaliser. The
  slot is mixed in so all slots can share one sparse table; the uint64 is stored as int64
  (same 64 bits). Each distinct value of a chunk is hashed once.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from heterps_ray.errors import DataError

log = logging.getLogger(__name__)

NUM_DENSE = 13
NUM_SLOTS = 26
LABEL_COLUMN = "label"
DENSE_COLUMNS = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_COLUMNS = [f"C{i}" for i in range(1, NUM_SLOTS + 1)]
COLUMNS = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]
NUM_FIELDS = len(COLUMNS)

RAW_SCHEMA = pa.schema(
    [pa.field(LABEL_COLUMN, pa.int8(), nullable=False)]
    + [pa.field(c, pa.float64()) for c in DENSE_COLUMNS]
    + [pa.field(c, pa.string()) for c in SPARSE_COLUMNS]
)

# A Batch: {"label": float32[B], "dense": float32[B, 13], "keys": int64[B, 26]}.
Batch = dict[str, np.ndarray]

_HASH_KEY = "heterps_ray_keys"  # 16 characters: the SipHash key
_NUMBER = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"
_CHUNK_ROWS = 1 << 18  # rows checked and yielded at once: ~60 MiB of text, bounded memory
_BLOCK_BYTES = 1 << 20  # pyarrow.csv block: longer than any Criteo line, small enough to stream
_LOGGED_BAD_ROWS = 10  # per BadRows: the first few are logged one by one, the rest counted


@dataclass
class BadRows:
    """Malformed rows met while reading: the count by reason and the first ``keep`` locations."""

    keep: int = 100
    count: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # "file:line: reason"

    def add(self, path: Path, line: int, kind: str, reason: str) -> None:
        self.count += 1
        self.by_reason[kind] = self.by_reason.get(kind, 0) + 1
        where = f"{path}:{line}: {reason}"
        if len(self.examples) < self.keep:
            self.examples.append(where)
        if self.count <= _LOGGED_BAD_ROWS:
            log.warning("skipping malformed row %s", where)

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "by_reason": dict(self.by_reason), "examples": list(self.examples)}


# ---------------------------------------------------------------------------------------------
# Text -> raw Arrow table


def read_text(
    path: str | Path,
    *,
    strict: bool = False,
    bad_rows: BadRows | None = None,
    chunk_rows: int = _CHUNK_ROWS,
) -> Iterator[pa.Table]:
    """Stream a Criteo text file as raw-form tables (:data:`RAW_SCHEMA`) of about ``chunk_rows``.

    Memory stays bounded whatever the file size. Malformed rows go to ``bad_rows`` (and are
    skipped) or, with ``strict``, raise DataError naming ``file:line``.
    """
    path = Path(path)
    bad_rows = bad_rows if bad_rows is not None else BadRows()
    before = bad_rows.count
    if not path.is_file():
        raise DataError(f"{path}: no such file (expected a Criteo TSV or header CSV file)")
    head = _head(path)
    if not head.strip():
        return
    sep, has_header = _detect_form(path, head)
    lines = _LineMap(first_data_line=2 if has_header else 1)

    def on_wrong_field_count(row: Any) -> str:
        lines.wrong.append((row.number, row.actual_columns))
        return "skip"

    read_options = pa_csv.ReadOptions(
        column_names=COLUMNS, block_size=_BLOCK_BYTES, use_threads=False, skip_rows=int(has_header)
    )
    # Blank lines come through as rows of empty fields (dropped later) so every physical line is
    # either a row or a wrong-field-count report: that is what makes line numbers exact.
    parse_options = pa_csv.ParseOptions(
        delimiter=sep, quote_char=False, ignore_empty_lines=False, invalid_row_handler=on_wrong_field_count
    )
    # Everything is read as bytes (checked here, not by the CSV reader, so a bad value costs one
    # row, not the file); an empty field is null, a missing value in Criteo.
    convert_options = pa_csv.ConvertOptions(
        column_types={c: pa.binary() for c in COLUMNS}, strings_can_be_null=True, null_values=[""]
    )
    pending: list[pa.RecordBatch] = []
    ordinal = 0  # rows the CSV reader produced before `pending`
    try:
        with pa.input_stream(str(path), compression="detect") as stream:
            for batch in _batches(path, stream, read_options, parse_options, convert_options):
                lines.report_wrong(path, bad_rows, strict)
                pending.append(batch)
                if sum(b.num_rows for b in pending) >= chunk_rows:
                    table = pa.Table.from_batches(pending)
                    yield _validate(table, ordinal, lines, path, bad_rows, strict)
                    ordinal += table.num_rows
                    pending = []
    except pa.ArrowException as exc:
        raise DataError(f"{path}: cannot read as Criteo text ({exc})") from None
    lines.report_wrong(path, bad_rows, strict)
    if pending:
        yield _validate(pa.Table.from_batches(pending), ordinal, lines, path, bad_rows, strict)
    skipped = bad_rows.count - before
    if skipped:
        log.warning("%s: skipped %d malformed rows (see the bad-row report)", path, skipped)


def _batches(path: Path, stream: Any, *options: Any) -> Iterator[pa.RecordBatch]:
    """The CSV reader's batches; a row with the wrong field count that is not UTF-8 text is a DataError.

    pyarrow decodes such a row as UTF-8 before it calls the invalid-row handler; when that fails it prints
    the UnicodeDecodeError as an "Exception ignored" traceback (sys.unraisablehook) and stops the read
    with a parse error. The hook is caught while the reader runs, so the user sees one message, no
    traceback.
    """
    undecodable: list[UnicodeDecodeError] = []
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, UnicodeDecodeError):
            undecodable.append(unraisable.exc_value)
        else:
            previous(unraisable)

    def pull(step: Callable[[], Any]) -> Any:
        sys.unraisablehook = hook
        try:
            return step()
        except pa.ArrowException as exc:
            if undecodable:
                raise DataError(
                    f"{path}: not UTF-8 text: a row holds bytes that are not UTF-8 and has the wrong number "
                    f"of fields ({exc}); expected a Criteo TSV or header CSV file"
                ) from None
            raise
        finally:
            sys.unraisablehook = previous

    reader = pull(lambda: pa_csv.open_csv(stream, *options))
    while True:
        try:
            batch = pull(reader.read_next_batch)
        except StopIteration:
            return
        yield batch


def read_table(path: str | Path, *, strict: bool = False, bad_rows: BadRows | None = None) -> pa.Table:
    """Read a whole (small) Criteo text file into one raw-form table."""
    tables = list(read_text(path, strict=strict, bad_rows=bad_rows))
    return pa.concat_tables(tables) if tables else RAW_SCHEMA.empty_table()


def _head(path: Path) -> bytes:
    try:
        with pa.input_stream(str(path), compression="detect") as stream:
            return stream.read(_BLOCK_BYTES)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: cannot read ({exc})") from None


def _detect_form(path: Path, head: bytes) -> tuple[str, bool]:
    """(separator, has header) from the first line (the first non-blank one for the separator)."""
    text = head.decode("utf-8", errors="replace")
    first = text.split("\n", 1)[0].rstrip("\r")
    sample = first if first.strip() else text.strip().split("\n", 1)[0]
    sep = "\t" if "\t" in sample else ","
    fields = [f.strip() for f in first.split(sep)]
    if fields[0].lower() != LABEL_COLUMN:
        return sep, False
    if fields != COLUMNS:
        raise DataError(
            f"{path}:1: header has {len(fields)} columns starting {fields[:3]}; "
            f"expected the {NUM_FIELDS} columns label, I1..I13, C1..C26 in that order"
        )
    return sep, True


class _LineMap:
    """Physical line numbers of the rows the CSV reader produced, knowing the skipped lines."""

    def __init__(self, first_data_line: int):
        self.first_data_line = first_data_line
        self.wrong: list[tuple[int, int]] = []  # (line, fields found), appended by the reader
        self._reported = 0
        self._skipped: list[int] = []

    def report_wrong(self, path: Path, bad_rows: BadRows, strict: bool) -> None:
        for line, found in self.wrong[self._reported :]:
            reason = f"expected {NUM_FIELDS} fields, got {found}"
            if strict:
                raise DataError(f"{path}:{line}: malformed row: {reason} (strict mode)")
            bad_rows.add(path, line, "field_count", reason)
            self._skipped.append(line)
        self._reported = len(self.wrong)

    def line_of(self, ordinals: np.ndarray) -> np.ndarray:
        # Rows produced before skipped line j: skipped[j] - first_data_line - j.
        skipped = np.asarray(self._skipped, dtype=np.int64)
        rows_before = skipped - self.first_data_line - np.arange(len(skipped))
        return self.first_data_line + ordinals + np.searchsorted(rows_before, ordinals, side="right")


def _validate(
    table: pa.Table, ordinal: int, lines: _LineMap, path: Path, bad_rows: BadRows, strict: bool
) -> pa.Table:
    """Check and convert one chunk of 40 binary columns (empty -> null) to the raw form, vectorised."""
    problems: list[tuple[np.ndarray, str, Any]] = []
    cols = []
    for name in COLUMNS:
        col, broken = _to_utf8(table.column(name).combine_chunks())
        cols.append(col)
        problems.append((broken, "encoding", lambda i, name=name: f"{name}: not UTF-8 text"))
    bad = np.zeros(table.num_rows, dtype=bool)
    for rows, _, _ in problems:
        bad[rows] = True

    no_label = np.flatnonzero(cols[0].is_null().to_numpy(zero_copy_only=False))
    blank = no_label[[all(c[int(i)].as_py() is None for c in cols) for i in no_label]]
    bad[blank] = True  # a blank line: ignored, not reported

    label_ok = pc.is_in(cols[0], value_set=pa.array(["0", "1"])).to_numpy(zero_copy_only=False)
    label_bad = ~label_ok & ~bad
    problems.append(
        (np.flatnonzero(label_bad), "label", _reason(cols[0], "label: expected 0 or 1, got {!r}"))
    )
    bad |= label_bad

    dense_cols = []
    for j, name in enumerate(DENSE_COLUMNS, start=1):
        values, col_bad = _to_float(cols[j])
        problems.append(
            (np.flatnonzero(col_bad), "dense", _reason(cols[j], name + ": expected a number, got {!r}"))
        )
        bad |= col_bad
        dense_cols.append(values)

    _report(problems, ordinal, lines, path, bad_rows, strict)

    arrays = [cols[0], *dense_cols, *cols[1 + NUM_DENSE :]]
    if bad.any():
        good = pa.array(~bad)
        arrays = [pc.filter(a, good) for a in arrays]
    arrays[0] = pc.cast(arrays[0], pa.int8())
    return pa.Table.from_arrays(arrays, schema=RAW_SCHEMA)


def _to_float(col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """A dense column as float64 (nulls kept), and the rows whose value is not a finite number."""
    try:
        values = pc.cast(col, pa.float64())
        if pc.all(pc.fill_null(pc.is_finite(values), True)).as_py():
            return values, np.zeros(len(col), dtype=bool)
    except pa.ArrowInvalid:
        pass
    # Slow path, only for a chunk holding a malformed value: trim, match, cast what is valid.
    text = pc.utf8_trim_whitespace(col)
    numeric = pc.fill_null(pc.match_substring_regex(text, _NUMBER), True).to_numpy(zero_copy_only=False)
    values = pc.cast(pc.if_else(pa.array(numeric), text, pa.scalar(None, pa.string())), pa.float64())
    return values, ~numeric


def _to_utf8(col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """The column as strings, and the rows whose value is not UTF-8 (those become empty)."""
    try:
        return pc.cast(col, pa.string()), np.empty(0, dtype=np.int64)
    except pa.ArrowInvalid:
        pass
    # Rare (corrupt input): find the offending values one by one.
    values = col.to_pylist()
    broken = []
    for i, value in enumerate(values):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            broken.append(i)
            values[i] = b""
    return pc.cast(pa.array(values, pa.binary()), pa.string()), np.array(broken, dtype=np.int64)


def _reason(values: pa.Array, template: str) -> Any:
    """The reason text of row i, built only for the rows that are described one by one."""
    return lambda i: template.format(values[int(i)].as_py() or "")


def _report(
    problems: list[tuple[np.ndarray, str, Any]],
    ordinal: int,
    lines: _LineMap,
    path: Path,
    bad_rows: BadRows,
    strict: bool,
) -> None:
    """Record each bad row once (its first problem), in line order; raise on the first if strict."""
    rows = np.concatenate([p[0] for p in problems])
    if not len(rows):
        return
    which = np.concatenate([np.full(len(p[0]), k) for k, p in enumerate(problems)])
    rows, first = np.unique(rows, return_index=True)  # sorted by line; the first problem wins
    which = which[first]
    if strict:
        line = lines.line_of(ordinal + rows[:1])[0]
        raise DataError(f"{path}:{line}: malformed row: {problems[which[0]][2](rows[0])} (strict mode)")
    # Rows beyond those described one by one are only counted, so a garbage file stays fast.
    detailed = max(bad_rows.keep - len(bad_rows.examples), _LOGGED_BAD_ROWS - bad_rows.count, 0)
    line_no = lines.line_of(ordinal + rows[:detailed])
    for i, k, line in zip(rows[:detailed], which[:detailed], line_no, strict=True):
        _, kind, reason = problems[k]
        bad_rows.add(path, int(line), kind, reason(i))
    for k, extra in enumerate(np.bincount(which[detailed:], minlength=len(problems))):
        if extra:
            kind = problems[k][1]
            bad_rows.count += int(extra)
            bad_rows.by_reason[kind] = bad_rows.by_reason.get(kind, 0) + int(extra)


# ---------------------------------------------------------------------------------------------
# Raw Arrow table -> text


def write_text(table: pa.Table, path: str | Path, *, header: bool = False, sep: str = "\t") -> None:
    """Write a raw-form table as Criteo text: raw TSV by default, or with a header line."""
    table = _check_raw(table, str(path))
    with open(path, "wb") as out:
        if header:
            out.write((sep.join(COLUMNS) + "\n").encode())
        for batch in table.to_batches(max_chunksize=1 << 18):
            # float64 -> string is the shortest round-tripping form ("260", not "260.0").
            cols = [pc.fill_null(pc.cast(batch.column(i), pa.string()), "") for i in range(NUM_FIELDS)]
            lines = pc.binary_join_element_wise(*cols, sep)
            if len(lines):
                out.write("\n".join(lines.to_pylist()).encode() + b"\n")


# ---------------------------------------------------------------------------------------------
# Raw Arrow table -> Batch


def table_to_batch(table: pa.Table | pa.RecordBatch) -> Batch:
    """The one conversion from raw rows to a Batch: dense transform and key hashing."""
    table = _check_raw(table, "table")
    n = table.num_rows
    label_col = table.column(LABEL_COLUMN)
    if label_col.null_count:
        raise DataError(f"column '{LABEL_COLUMN}': expected no missing labels, got {label_col.null_count}")
    label = np.array(pc.cast(label_col, pa.float32()).to_numpy(), dtype=np.float32)  # a writable copy
    dense = np.empty((n, NUM_DENSE), dtype=np.float32)
    for j, name in enumerate(DENSE_COLUMNS):
        values = pc.fill_null(pc.cast(table.column(name), pa.float64()), 0.0).to_numpy()
        dense[:, j] = np.log1p(np.maximum(values, 0.0))
    keys = np.empty((n, NUM_SLOTS), dtype=np.int64)
    for s, name in enumerate(SPARSE_COLUMNS):
        keys[:, s] = hash_slot(table.column(name), s)
    return {"label": label, "dense": dense, "keys": keys}


def hash_slot(values: pa.Array | pa.ChunkedArray, slot: int) -> np.ndarray:
    """Stable int64 keys of one slot's categorical values (see the module docstring).

    Strings or dictionary-encoded strings (as Parquet can hand them over, unique values only).
    """
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    keys = [_hash_chunk(chunk, slot) for chunk in chunks]
    return keys[0] if len(keys) == 1 else np.concatenate(keys) if keys else np.zeros(0, np.int64)


def _hash_chunk(values: pa.Array, slot: int) -> np.ndarray:
    if not pa.types.is_dictionary(values.type):
        if not pa.types.is_string(values.type):
            values = pc.cast(values, pa.string())
        values = values.dictionary_encode()  # hash each distinct value once
    dictionary = values.dictionary
    if not pa.types.is_string(dictionary.type):
        dictionary = pc.cast(dictionary, pa.string())
    if dictionary.null_count:
        dictionary = pc.fill_null(dictionary, "")
    # A missing value is the empty string: its key is appended as the last entry.
    keys = _keys_of(dictionary, slot)
    indices = pc.fill_null(values.indices, len(keys) - 1)
    return keys[indices.to_numpy(zero_copy_only=False)]


def _keys_of(values: pa.StringArray, slot: int) -> np.ndarray:
    """int64 keys of `values` (no nulls) and, last, of the empty string. SipHash-2-4 runs in C on
    the Arrow buffers without the GIL (heterps_ray.ps._rows.siphash_strings): through Python
    strings (pandas.util.hash_array) a Criteo-shaped chunk's ~10^5 distinct values held the GIL
    for tenths of a second, and a DataWorker's reader thread stalled its training thread by that
    much (BENCHMARKS.md "The Criteo-shaped epoch"). The final mixing is pandas' own."""
    try:
        from heterps_ray.ps._rows import siphash_strings
    except ImportError as exc:  # pragma: no cover - an extension built before the hashing moved to C
        raise ImportError(
            "heterps_ray.ps._rows is not built, or was built from an older _rows.c: rebuild it with "
            "`pip install -e .` (or `python setup.py build_ext --inplace`) in the repository"
        ) from exc

    n = len(values)
    hashed = np.zeros(n + 1, dtype=np.uint64)  # the last: SipHash of b""
    _, offsets, data = values.buffers()
    siphash_strings(hashed[:n], _HASH_KEY.encode(), offsets, data, values.offset, n)
    siphash_strings(hashed[n:], _HASH_KEY.encode(), np.zeros(2, np.int32), None, 0, 1)
    # pandas.util.hash_array's redistribution of the 64-bit values (its _hash_ndarray)
    hashed ^= hashed >> np.uint64(30)
    hashed *= np.uint64(0xBF58476D1CE4E5B9)
    hashed ^= hashed >> np.uint64(27)
    hashed *= np.uint64(0x94D049BB133111EB)
    hashed ^= hashed >> np.uint64(31)
    salt = splitmix64(np.array([slot], dtype=np.uint64))
    return splitmix64(hashed ^ salt).view(np.int64)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vigna's splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _check_raw(table: pa.Table | pa.RecordBatch, where: str) -> pa.Table:
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"{where}: missing columns {missing} (expected label, I1..I13, C1..C26)")
    return table.select(COLUMNS)
