"""Criteo text reading (raw TSV and header CSV), malformed rows, the dense transform and the key hash."""

from __future__ import annotations

import gzip
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from heterps_ray.data.criteo import (
    COLUMNS,
    DENSE_COLUMNS,
    NUM_DENSE,
    NUM_SLOTS,
    SPARSE_COLUMNS,
    BadRows,
    hash_slot,
    read_table,
    read_text,
    table_to_batch,
    write_text,
)
from heterps_ray.errors import DataError


def _lines(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sample_gives_200_rows_a_label_and_39_features(criteo_sample):
    table = read_table(criteo_sample, strict=True)
    assert table.num_rows == 200
    assert table.column_names == COLUMNS and len(DENSE_COLUMNS) + len(SPARSE_COLUMNS) == 39
    batch = table_to_batch(table)
    assert batch["label"].dtype == np.float32 and batch["label"].shape == (200,)
    assert batch["dense"].dtype == np.float32 and batch["dense"].shape == (200, NUM_DENSE)
    assert batch["keys"].dtype == np.int64 and batch["keys"].shape == (200, NUM_SLOTS)
    assert set(np.unique(batch["label"])) == {0.0, 1.0}
    assert batch["label"].flags.writeable
    assert np.isfinite(batch["dense"]).all() and (batch["dense"] >= 0).all()


def test_dense_transform_and_missing_values(criteo_sample):
    # First data row: label 0, I1 missing, I2 3, I3 260.0, I4 missing ... C19 missing.
    table = read_table(criteo_sample)
    first = table.slice(0, 1).to_pylist()[0]
    assert first["label"] == 0 and first["I1"] is None and first["I3"] == 260.0 and first["C19"] is None
    batch = table_to_batch(table.slice(0, 1))
    assert batch["dense"][0, 0] == 0.0  # missing -> 0
    assert batch["dense"][0, 2] == pytest.approx(np.log1p(260.0))
    second = table_to_batch(table.slice(1, 1))
    assert table.slice(1, 1).column("I2")[0].as_py() == -1.0
    assert second["dense"][0, 1] == 0.0  # negative counts clip to 0 before log1p
    # A missing categorical value is the slot's "missing" key: the hash of the empty string.
    missing_key = hash_slot(pa.array([""]), 18)[0]
    assert batch["keys"][0, 18] == missing_key == hash_slot(pa.array([None], pa.string()), 18)[0]


def test_keys_mix_in_the_slot_and_are_pinned():
    same_value = np.array([hash_slot(pa.array(["05db9164"]), s)[0] for s in range(NUM_SLOTS)])
    assert len(set(same_value.tolist())) == NUM_SLOTS
    # The documented hash, pinned: a change here would silently orphan every trained embedding.
    assert int(same_value[0]) == _PINNED_KEY_C1_05db9164


def test_dictionary_and_chunked_values_hash_like_plain_strings():
    plain = pa.array(["a1", None, "b2", "a1", ""], pa.string())
    expected = hash_slot(plain, 7)
    assert expected[1] == expected[4] and expected[0] == expected[3] != expected[2]
    np.testing.assert_array_equal(hash_slot(plain.dictionary_encode(), 7), expected)
    chunked = pa.chunked_array([plain.slice(0, 2).dictionary_encode(), plain.slice(2).dictionary_encode()])
    np.testing.assert_array_equal(hash_slot(chunked, 7), expected)
    assert hash_slot(pa.array([None, None], pa.string()), 7).tolist() == [expected[1]] * 2


def test_keys_hashed_in_c_equal_the_documented_pandas_siphash():
    """The keys are hashed in C from the Arrow buffers (no Python strings, no GIL); they must be
    exactly the documented pandas.util.hash_array keys: every length around SipHash's 8-byte
    blocks, multi-byte UTF-8, empty and missing values, sliced and chunked arrays."""
    from pandas.util import hash_array

    from heterps_ray.data.criteo import _HASH_KEY, splitmix64

    rng = np.random.default_rng(0)
    alphabet = list("abcdef0123456789") + ["é", "中", "😀", " "]
    values = ["".join(rng.choice(alphabet, n)) for n in list(range(25)) * 20] + ["", "x" * 64]
    column = pa.array([*values, None], pa.string())
    for slot in (0, 25):
        pandas = hash_array(np.array([*values, ""], dtype=object), "utf8", _HASH_KEY, categorize=False)
        expected = splitmix64(pandas ^ splitmix64(np.array([slot], np.uint64))).view(np.int64)
        np.testing.assert_array_equal(hash_slot(column, slot), expected)
        np.testing.assert_array_equal(hash_slot(column.slice(37, 101), slot), expected[37:138])
        chunked = pa.chunked_array([column.slice(0, 7), column.slice(7)])
        np.testing.assert_array_equal(hash_slot(chunked, slot), expected)


def test_keys_identical_across_processes(criteo_sample, tmp_path):
    out = tmp_path / "keys.npy"
    code = (
        "import sys, numpy as np\n"
        "from heterps_ray.data.criteo import read_table, table_to_batch\n"
        "np.save(sys.argv[2], table_to_batch(read_table(sys.argv[1]))['keys'])\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")  # Python's own str hash differs from ours
    subprocess.run([sys.executable, "-c", code, str(criteo_sample), str(out)], check=True, env=env)
    here = table_to_batch(read_table(criteo_sample))["keys"]
    np.testing.assert_array_equal(np.load(out), here)
    assert len(np.unique(here)) > 1000


def test_rows_written_as_raw_tsv_read_back_identically(criteo_sample, tmp_path):
    table = read_table(criteo_sample, strict=True)
    tsv = tmp_path / "sample.tsv"
    write_text(table, tsv)
    first = tsv.read_text().split("\n", 1)[0].split("\t")
    assert len(first) == 40 and first[0] == "0" and first[3] == "260"  # raw form: no header, integers
    again = read_table(tsv, strict=True)
    assert again.equals(table)
    for key, value in table_to_batch(table).items():
        np.testing.assert_array_equal(table_to_batch(again)[key], value)


def test_gzip_input_reads_like_plain_text(criteo_sample, tmp_path):
    packed = tmp_path / "sample.txt.gz"
    packed.write_bytes(gzip.compress(criteo_sample.read_bytes()))
    assert read_table(packed, strict=True).equals(read_table(criteo_sample))


def _corrupt(kind: str, fields: list[str]) -> str:
    if kind == "too_few_fields":
        return "\t".join(fields[:39])
    if kind == "too_many_fields":
        return "\t".join([*fields, "extra"])
    if kind == "non_numeric_dense":
        return "\t".join([*fields[:3], "12x", *fields[4:]])
    if kind == "bad_label":
        return "\t".join(["2", *fields[1:]])
    if kind == "missing_label":
        return "\t".join(["", *fields[1:]])
    raise AssertionError(kind)


_EXPECTED_REASON = {
    "too_few_fields": "expected 40 fields, got 39",
    "too_many_fields": "expected 40 fields, got 41",
    "non_numeric_dense": "I3: expected a number, got '12x'",
    "bad_label": "label: expected 0 or 1, got '2'",
    "missing_label": "label: expected 0 or 1, got ''",
}


@pytest.mark.parametrize("kind", list(_EXPECTED_REASON))
def test_malformed_row_is_skipped_with_file_line_or_rejected_when_strict(
    kind, criteo_sample, tmp_path, caplog
):
    good = tmp_path / "good.tsv"
    write_text(read_table(criteo_sample), good)
    lines = _lines(good)
    lines[40] = _corrupt(kind, lines[40].split("\t"))  # line 41
    lines.insert(10, "")  # a blank line is ignored, and must not shift the line numbers: now line 42
    bad = _write(tmp_path / "bad.tsv", lines)

    report = BadRows()
    with caplog.at_level(logging.WARNING, logger="heterps_ray.data.criteo"):
        table = read_table(bad, bad_rows=report)
    assert table.num_rows == 199
    assert report.count == 1 and report.examples == [f"{bad}:42: {_EXPECTED_REASON[kind]}"]
    assert f"{bad}:42" in caplog.text
    assert table.equals(pa.concat_tables([read_table(good).slice(0, 40), read_table(good).slice(41)]))

    with pytest.raises(DataError, match=f"{bad}:42: malformed row: .*strict"):
        read_table(bad, strict=True)


def test_line_numbers_stay_exact_across_reader_blocks(criteo_sample, tmp_path):
    # ~1.2 MB: more than one block of the CSV reader and more than one chunk of ours.
    lines = _lines(criteo_sample)[1:] * 25
    for at in (10, 2500, 3000, 4999):
        lines[at] = lines[at].replace(",", ",x", 1) if at != 2500 else lines[at] + ",more"
    path = _write(tmp_path / "big.csv", [_lines(criteo_sample)[0], *lines])
    report = BadRows()
    rows = sum(t.num_rows for t in read_text(path, bad_rows=report, chunk_rows=1000))
    assert rows == 5000 - 4
    lines_reported = sorted(int(e.split(":")[1]) for e in report.examples)
    assert lines_reported == [12, 2502, 3002, 5001]  # +1 for 0-based, +1 for the header
    assert report.by_reason == {"dense": 3, "field_count": 1}


def test_garbage_file_is_counted_not_listed_row_by_row(tmp_path):
    path = _write(tmp_path / "junk.tsv", ["0\t" + "\t".join(["nan"] * 39)] * 500)
    report = BadRows(keep=5)
    assert read_table(path, bad_rows=report).num_rows == 0
    assert report.count == 500 and len(report.examples) == 5


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_table(tmp_path / "nope.tsv")


def test_header_with_wrong_columns_is_a_data_error(tmp_path):
    path = _write(tmp_path / "h.csv", ["label,I1,I2", "1,2,3"])
    with pytest.raises(DataError, match=r"h\.csv:1: header .*expected the 40 columns"):
        read_table(path)


def test_table_without_criteo_columns_is_a_data_error():
    with pytest.raises(DataError, match="missing columns"):
        table_to_batch(pa.table({"label": pa.array([1], pa.int8())}))


_PINNED_KEY_C1_05db9164 = 779415983913622993
