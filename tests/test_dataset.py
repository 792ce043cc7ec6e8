"""`heterps data convert` and the dataset directory: round trip, order, partitions, bad input, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from heterps_ray.cli import main
from heterps_ray.data.convert import convert
from heterps_ray.data.criteo import read_table, table_to_batch, write_text
from heterps_ray.data.dataset import Dataset, partition_files
from heterps_ray.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def sample_dataset(criteo_sample, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "sample"
    convert([criteo_sample], out, rows_per_part=50, eval_fraction=0.1, strict=True)
    return Dataset(out)


def _concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_convert_round_trip_splits_every_tenth_row_to_eval(sample_dataset, criteo_sample):
    ds = sample_dataset
    assert ds.num_rows("train") == 180 and ds.num_rows("eval") == 20
    assert [f.name for f in ds.files("train")] == [f"part-{i:05d}.parquet" for i in range(4)]
    assert len(ds.files("eval")) == 1
    assert ds.meta["rows"] == {"train": 180, "eval": 20} and ds.meta["files"] == {"train": 4, "eval": 1}
    assert ds.meta["bad_rows"]["count"] == 0 and ds.meta["source"] == [str(criteo_sample.resolve())]

    everything = table_to_batch(read_table(criteo_sample))
    to_eval = np.arange(200) % 10 == 9
    for split, rows in (("train", ~to_eval), ("eval", to_eval)):
        loaded = ds.load(split)
        for key, value in everything.items():
            np.testing.assert_array_equal(loaded[key], value[rows])


def test_iter_batches_keeps_order_across_files_and_drops_the_last_partial_batch(sample_dataset):
    ds = sample_dataset
    whole = ds.load("train")
    batches = list(ds.iter_batches("train", 64))  # 180 rows over files of 50: batches span files
    assert [len(b["label"]) for b in batches] == [64, 64]
    for key, value in _concat(batches).items():
        np.testing.assert_array_equal(value, whole[key][:128])
    kept = list(ds.iter_batches("train", 64, drop_last=False))
    assert [len(b["label"]) for b in kept] == [64, 64, 52]
    for key, value in _concat(kept).items():
        np.testing.assert_array_equal(value, whole[key])
    assert list(ds.iter_batches("train", 64)) and kept[0]["keys"].dtype == np.int64


def test_several_converting_threads_give_the_same_batches(tmp_path, monkeypatch):
    """A DataWorker converts its read chunks in several threads (runtime.readers): the same batches,
    in the same order, across chunk boundaries."""
    import heterps_ray.data.dataset as dataset_module
    from heterps_ray.data.synth import synthesize

    synthesize(tmp_path / "d", 3_000, seed=2, rows_per_part=1_000)
    ds = Dataset(tmp_path / "d")
    monkeypatch.setattr(dataset_module, "READ_ROWS", 256)  # many chunks, batches spanning them
    one = list(ds.iter_batches("train", 100))
    three = list(ds.iter_batches("train", 100, workers=3))
    assert len(one) == len(three) == 27
    for a, b in zip(one, three, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_a_resume_starts_at_its_batch_without_converting_the_rows_before_it(tmp_path, monkeypatch):
    """iter_batches(skip=k) is the batches from k on, whatever file, row group or read chunk batch k
    starts in; the rows before it are not converted (a resume deep into a 45M-row epoch converted them
    all again: seconds to minutes per fault)."""
    import pyarrow.parquet as pq

    import heterps_ray.data.dataset as dataset_module
    from heterps_ray.data.synth import synthesize

    synthesize(tmp_path / "d", 3_000, seed=2, rows_per_part=1_000)
    ds = Dataset(tmp_path / "d")
    assert sum(pq.ParquetFile(f).num_row_groups for f in ds.files("train")) >= 3
    monkeypatch.setattr(dataset_module, "READ_ROWS", 256)
    whole = list(ds.iter_batches("train", 100))
    converted: list[int] = []
    real = dataset_module.table_to_batch
    monkeypatch.setattr(dataset_module, "table_to_batch", lambda t: converted.append(t.num_rows) or real(t))
    for skip in (0, 1, 3, 9, 10, 17, 26, 27, 40):
        converted.clear()
        rest = list(ds.iter_batches("train", 100, skip=skip, workers=2 if skip % 2 else 1))
        assert len(rest) == max(len(whole) - skip, 0), skip
        for a, b in zip(whole[skip:], rest, strict=True):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
        assert sum(converted) <= ds.num_rows("train") - min(skip * 100, ds.num_rows("train")), (skip, converted)


def test_partitions_are_disjoint_deterministic_and_cover_the_split(sample_dataset):
    files = sample_dataset.files("train")
    parts = [partition_files(files, 3, i) for i in range(3)]
    assert parts == [partition_files(list(reversed(files)), 3, i) for i in range(3)]
    assert sorted(f for p in parts for f in p) == files
    assert all(set(a).isdisjoint(b) for a in parts for b in parts if a is not b)
    rows = sum(len(sample_dataset.load("train", files=p)["label"]) for p in parts)
    assert rows == 180
    assert partition_files(files, 8, 7) == []
    with pytest.raises(ValueError):
        partition_files(files, 2, 2)


def test_bad_rows_are_reported_in_meta_or_stop_a_strict_convert(criteo_sample, tmp_path):
    tsv = tmp_path / "day.tsv"
    write_text(read_table(criteo_sample), tsv)
    lines = tsv.read_text().split("\n")
    lines[6] = "1\t2\t3"  # line 7: wrong field count
    tsv.write_text("\n".join(lines))
    meta = convert([tsv], tmp_path / "out")
    assert meta["rows"]["train"] + meta["rows"]["eval"] == 199
    assert meta["bad_rows"]["examples"] == [f"{tsv}:7: expected 40 fields, got 3"]
    assert json.loads((tmp_path / "out" / "_meta.json").read_text())["bad_rows"]["count"] == 1

    with pytest.raises(DataError, match=f"{tsv}:7"):
        convert([tsv], tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dir left


def test_missing_inputs_and_outputs_are_data_errors(criteo_sample, tmp_path):
    with pytest.raises(DataError, match="no such file"):
        convert([tmp_path / "missing.tsv"], tmp_path / "out")
    with pytest.raises(DataError, match="not a dataset directory"):
        Dataset(tmp_path / "nothing-here")
    convert([criteo_sample], tmp_path / "ok")
    with pytest.raises(DataError, match="unknown split"):
        Dataset(tmp_path / "ok").files("test")
    with pytest.raises(DataError, match="already there"):
        convert([criteo_sample], tmp_path / "ok")
    assert convert([criteo_sample], tmp_path / "ok", eval_fraction=0.5, overwrite=True)["rows"]["eval"] == 100
    with pytest.raises(ConfigError, match="eval_fraction"):
        convert([criteo_sample], tmp_path / "x", eval_fraction=0.9)


def test_cli_convert_and_info_exit_codes(criteo_sample, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["data", "convert", str(criteo_sample), "--output", str(out), "--rows-per-part", "64"]) == 0
    assert "train 180 rows in 3 files, eval 20 rows in 1 files" in capsys.readouterr().out
    assert main(["data", "info", str(out)]) == 0
    assert "train: 180 rows in 3 files" in capsys.readouterr().out

    assert main(["data", "convert", str(tmp_path / "nope.tsv"), "-o", str(tmp_path / "o2")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.tsv"
    bad.write_text("0\t1\n")
    assert main(["data", "convert", str(bad), "-o", str(tmp_path / "o3"), "--strict"]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
    assert main(["data", "convert", str(bad), "-o", str(tmp_path / "o4")]) == 2  # nothing valid left
    assert (
        main(["data", "convert", str(criteo_sample), "-o", str(tmp_path / "o5"), "--eval-fraction", "2"]) == 2
    )
    with pytest.raises(SystemExit) as exc:
        main(["data", "convert", str(criteo_sample), "-o", str(out), "--rows-per-part", "0"])
    assert exc.value.code == 2


# -- the layout other readers open ------------------------------------------------------------


def test_pandas_and_pyarrow_defaults_read_the_directory_as_one_table_with_a_split_column(sample_dataset):
    import pandas as pd
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    path = sample_dataset.path
    assert sorted(p.name for p in path.iterdir()) == ["_meta.json", "split=eval", "split=train"]
    frame = pd.read_parquet(path)
    assert len(frame) == 200 and frame["split"].astype(str).value_counts().to_dict() == {"train": 180, "eval": 20}
    hive = pads.dataset(path, partitioning="hive").to_table()
    assert hive.num_rows == 200 and "split" in hive.column_names
    assert pq.read_table(path).num_rows == 200 and pads.dataset(path).count_rows() == 200
    # The same rows the Dataset reader gives, split by split, in its order.
    for split in ("train", "eval"):
        rows = pads.dataset(path, partitioning="hive").to_table(filter=pads.field("split") == split)
        np.testing.assert_array_equal(
            rows.column("label").to_numpy(), sample_dataset.load(split)["label"]
        )


def _to_legacy_layout(dataset: Dataset, folder):
    """The directory as versions before the hive layout wrote it: meta.json, train/, eval/."""
    import shutil

    old = folder / "legacy"
    old.mkdir()
    shutil.copy(dataset.path / "_meta.json", old / "meta.json")
    for split in ("train", "eval"):
        shutil.copytree(dataset.path / f"split={split}", old / split)
    return old


def test_datasets_in_the_older_layout_still_read_the_same(sample_dataset, tmp_path):
    from heterps_ray.data.layout import is_dataset

    old = Dataset(_to_legacy_layout(sample_dataset, tmp_path))
    assert is_dataset(old.path) and old.num_rows("train") == 180 and old.num_rows("eval") == 20
    assert [f.parent.name for f in old.files("train")] == ["train"] * 4
    assert old.meta == sample_dataset.meta
    for split in ("train", "eval"):
        for key, value in sample_dataset.load(split).items():
            np.testing.assert_array_equal(old.load(split)[key], value)
    batches = list(old.iter_batches("train", 64, files=old.files("train")[1:], drop_last=True))
    assert [len(b["label"]) for b in batches] == [64, 64]
    (old.path / "train" / "part-00002.parquet").unlink()
    with pytest.raises(DataError, match=r"missing \(1 of the 4 train partitions meta.json lists"):
        old.files("train")


def test_overwrite_replaces_a_dataset_in_the_older_layout(sample_dataset, criteo_sample, tmp_path):
    old = _to_legacy_layout(sample_dataset, tmp_path)
    with pytest.raises(DataError, match="already there"):
        convert([criteo_sample], old)
    convert([criteo_sample], old, overwrite=True)
    assert sorted(p.name for p in old.iterdir()) == ["_meta.json", "split=eval", "split=train"]
    assert Dataset(old).num_rows("train") == 180


# -- files stay inside the dataset directory -------------------------------------------------------


def _copy(dataset: Dataset, folder):
    import shutil

    return Path(shutil.copytree(dataset.path, folder / "copy", symlinks=True))


def test_partitions_that_lead_out_of_the_dataset_are_refused_naming_the_file_and_field(
    sample_dataset, tmp_path, capsys
):
    import shutil

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # A part that is a symlink to a file outside the dataset.
    path = _copy(sample_dataset, tmp_path)
    part = path / "split=train" / "part-00001.parquet"
    shutil.move(part, outside / part.name)
    part.symlink_to(outside / part.name)
    with pytest.raises(DataError, match=r"_meta.json: field 'files.train': expected a file inside") as exc:
        Dataset(path).files("train")
    assert "split=train/part-00001.parquet" in str(exc.value) and str(outside) in str(exc.value)
    assert main(["data", "info", str(path)]) == 2
    assert "field 'files.train'" in capsys.readouterr().err
    # A split folder that is a symlink out of the dataset.
    shutil.rmtree(path)
    path = _copy(sample_dataset, tmp_path)
    shutil.move(path / "split=eval", outside / "split=eval")
    (path / "split=eval").symlink_to(outside / "split=eval")
    with pytest.raises(DataError, match=r"field 'files.eval'.*outside the directory"):
        Dataset(path).verify()


@pytest.mark.parametrize("files", [{"train": "/etc/passwd"}, {"train": ["../other/part-00000.parquet"]},
                                   {"train": -1}, ["split=train/part-00000.parquet"]])  # fmt: skip
def test_meta_json_counts_partitions_and_names_none(sample_dataset, tmp_path, files):
    path = _copy(sample_dataset, tmp_path)
    meta = json.loads((path / "_meta.json").read_text())
    (path / "_meta.json").write_text(json.dumps({**meta, "files": files}))
    field = "files.train" if isinstance(files, dict) else "files"
    expected = rf"_meta.json: field '{field}': expected the number of train partitions"
    with pytest.raises(DataError, match=expected):
        Dataset(path).files("train")


def test_a_part_symlinked_inside_the_dataset_still_loads(sample_dataset, tmp_path):
    import shutil

    path = _copy(sample_dataset, tmp_path)
    store = path / "_store"  # other readers skip names starting with _
    store.mkdir()
    part = path / "split=train" / "part-00000.parquet"
    shutil.move(part, store / part.name)
    part.symlink_to(Path("..") / "_store" / part.name)
    copy = Dataset(path).verify()
    assert copy.files("train")[0] == part
    for key, value in sample_dataset.load("train").items():
        np.testing.assert_array_equal(copy.load("train")[key], value)


def test_the_writer_and_the_synthetic_generator_do_not_import_the_reader():
    """data/dataset.py generates synthetic data on first use; synth.py writes: no import cycle."""
    import subprocess
    import sys

    code = (
        "import sys, heterps_ray.data.synth, heterps_ray.data.convert; "
        "assert 'heterps_ray.data.dataset' not in sys.modules, 'cycle'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
