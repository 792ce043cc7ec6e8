"""Bad input through the real `heterps` CLI: every case exits non-zero (2 bad input, 3 no plan meets
the floor) with a message that names the file, the field and what was expected, and leaves what was
already written byte-identical: malformed configs, plans that do not match the model, unreachable
floors, missing or unreadable data, malformed rows, corrupted checkpoints and snapshots, and an
output directory that already holds a run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from heterps_ray.cli import main
from heterps_ray.errors import ConfigError, DataError, HeterPSError, InfeasibleError
from heterps_ray.ps.atomic import write_npz_atomic
from heterps_ray.ps.shard import PSShard
from heterps_ray.ps.spec import TableSpec
from heterps_ray.runtime.checkpoint import CHECKPOINTS_DIR, MANIFEST, load_checkpoint, write_manifest
from heterps_ray.runtime.driver import SUMMARY_FILE

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "configs" / "clusters" / "local.yaml"
PLAN = REPO / "configs" / "plans" / "small_three_stage.json"  # embedding | fc1 fc2 | logit, 2 PS shards
PROBLEM = REPO / "configs" / "problems" / "ctr_dnn_cloud.yaml"
MODEL = {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]}  # layers: embedding, fc1, fc2, logit
STEPS, EVERY = 4, 2  # the checkpointed run: batches, and a checkpoint every EVERY batches


# -- helpers -----------------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `root`: compared before and after a refusal."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def _previous_run(out: Path) -> dict[str, bytes | None]:
    """What an earlier run left in `out` (the files `heterps train --overwrite` would replace)."""
    (out / "model").mkdir(parents=True)
    (out / SUMMARY_FILE).write_text('{"steps": 7}\n')
    write_npz_atomic(out / "model" / "dense.npz", {"w": np.arange(6.0)})
    (out / "notes.txt").write_text("the user's own notes\n")
    return _tree(out)


def _write_job(folder: Path, data: Path, **changes: Any) -> Path:
    job = {
        "name": "bad-input",
        "model": MODEL,
        "cluster": str(CLUSTER),
        "data": {"path": str(data)},
        "batch_size": 64,
        "samples": 10_000,
        "throughput_min": 0,
        "mode": "sync",
        "output_dir": str(folder / "out"),
        "seed": 3,
    }
    job.update(changes)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _refused(argv: list[str], capsys: Any, code: int = 2) -> str:
    """Run the CLI in-process, expect exit `code`, return what it printed on stderr."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """1,080 train rows in three parts (two of 400, one of 280), 120 eval rows in one."""
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("bad_input") / "data"
    synthesize(path, 1_200, seed=3, rows_per_part=400)
    return path


# -- malformed configs -------------------------------------------------------------------------


def _cluster_with_negative_price(folder: Path) -> dict[str, Any]:
    cluster = yaml.safe_load(CLUSTER.read_text())
    cluster["resource_types"][1]["price_per_hour"] = -0.5
    (folder / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    return {"cluster": "cluster.yaml"}


CONFIG_CASES = [
    ("unknown field", lambda f: {"batchsize": 64}, "job.yaml", "batchsize", "unknown field"),
    ("wrong type", lambda f: {"batch_size": "big"}, "job.yaml", "batch_size", "valid integer"),
    (
        "wrong nested type",
        lambda f: {"runtime": {"max_in_flight": "four"}},
        "job.yaml",
        "runtime.max_in_flight",
        "valid integer",
    ),
    (
        "negative price",
        _cluster_with_negative_price,
        "cluster.yaml",
        "resource_types.1.price_per_hour",
        "greater than or equal to 0",
    ),
    ("unknown mode", lambda f: {"mode": "fast"}, "job.yaml", "mode", "'sync' or 'async'"),
]


@pytest.mark.parametrize(
    ("case", "changes", "file", "field", "expected"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES]
)
def test_malformed_config_exits_2_and_destroys_nothing(
    dataset, tmp_path, capsys, case, changes, file, field, expected
):
    job = _write_job(tmp_path, dataset, **changes(tmp_path))
    before = _previous_run(tmp_path / "out")
    err = _refused(["train", str(job), "--plan", str(PLAN), "--overwrite", "--no-progress"], capsys)
    assert str(tmp_path / file) in err and f"field '{field}'" in err and expected in err, err
    assert _tree(tmp_path / "out") == before


# -- plans that do not match the model ---------------------------------------------------------


def _stage(i: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda plan: plan["stages"][i].update(fields)


def _retype_middle_stage(plan: dict[str, Any]) -> None:
    plan["stages"][1]["type"] = "h100"
    plan["assignment"][1:3] = ["h100", "h100"]


PLAN_CASES = [
    # (case, edit, field, expected in the message)
    ("layer count", lambda p: p["assignment"].pop(), "assignment", "expected 4 entries, one per layer"),
    (
        "stages out of order",
        _stage(1, layers=["fc2", "fc1"]),
        "stages.1.layers",
        "the next layers of 'ctr_dnn' in order: ['fc1', 'fc2']",
    ),
    (
        "stages not covering all layers",
        lambda p: p["stages"].pop(),
        "stages",
        "stages covering all 4 layers",
    ),
    (
        "a layer counted twice",
        _stage(2, layers=["fc2", "logit"]),
        "stages.2.layers",
        "the next layers of 'ctr_dnn' in order: ['logit']",
    ),
    (
        "a layer the model lacks",
        _stage(1, layers=["fc1", "fc9"]),
        "stages.1.layers",
        "it has no layer 'fc9'",
    ),
    ("no replicas", _stage(1, replicas=0), "stages.1.replicas", "greater than or equal to 1"),
    ("replicas not a number", _stage(1, replicas="two"), "stages.1.replicas", "a valid integer"),
    (
        "unknown resource type",
        _retype_middle_stage,
        "stages.1.type",
        "a resource type of cluster 'local-two-cpu', one of ['cpu_small', 'cpu_big']",
    ),
    (
        "stage type disagrees with the assignment",
        lambda p: p["assignment"].__setitem__(0, "cpu_big"),
        "stages.0.type",
        "the type of its layers in `assignment`",
    ),
    ("unknown PS type", lambda p: p.update(ps_type="h100"), "ps_type", "a resource type of cluster"),
    ("no PS shards", lambda p: p.update(ps_shards=0), "ps_shards", "greater than or equal to 1"),
    ("a required field missing", lambda p: p.pop("stages"), "stages", "the field is required"),
]


@pytest.mark.parametrize(("case", "edit", "field", "expected"), PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_that_does_not_match_the_model_exits_2(dataset, tmp_path, capsys, case, edit, field, expected):
    plan = json.loads(PLAN.read_text())
    edit(plan)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    job = _write_job(tmp_path, dataset)
    before = _previous_run(tmp_path / "out")
    err = _refused(["train", str(job), "--plan", str(plan_file), "--overwrite", "--no-progress"], capsys)
    assert str(plan_file) in err and f"field '{field}'" in err and expected in err, err
    assert _tree(tmp_path / "out") == before


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", "valid JSON"), ("[1, 2]", "a JSON object"), (None, "a readable plan JSON file")],
    ids=["empty", "a list", "missing"],
)
def test_unreadable_plan_file_exits_2(dataset, tmp_path, capsys, text, expected):
    plan_file = tmp_path / "plan.json"
    if text is not None:
        plan_file.write_text(text)
    before = _previous_run(tmp_path / "out")
    argv = ["train", str(_write_job(tmp_path, dataset)), "--plan", str(plan_file), "--overwrite"]
    err = _refused(argv, capsys)
    assert str(plan_file) in err and "field '<file>'" in err and expected in err, err
    assert _tree(tmp_path / "out") == before


# -- a throughput floor no plan reaches ---------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["exact", "rl"])
def test_plan_with_unreachable_floor_exits_3_and_keeps_the_old_output(tmp_path, capsys, scheduler):
    problem = yaml.safe_load(PROBLEM.read_text())
    problem["throughput_min"] = 5.0e7
    path = tmp_path / "too_fast.yaml"
    path.write_text(yaml.safe_dump(problem))
    old_plan = tmp_path / "plan.json"
    old_plan.write_text('{"an": "earlier plan"}\n')
    from heterps_ray.costmodel import load_problem
    from heterps_ray.scheduling.exact import max_reachable_throughput

    best = max_reachable_throughput(load_problem(path))
    assert 0 < best < 5.0e7
    argv = ["plan", "--problem", str(path), "--scheduler", scheduler, "--output", str(old_plan)]
    err = _refused(argv, capsys, code=3)
    assert str(path) in err and "throughput_min = 50,000,000 samples/s" in err, err
    assert f"the highest throughput any plan reaches is {best:,.0f} samples/s" in err, err
    assert old_plan.read_text() == '{"an": "earlier plan"}\n'


def _one_type_problem(folder: Path, layers: list[str], rtype: str) -> Path:
    """A hand-priced problem of `layers` on the one resource type `rtype`, written into `folder`."""
    time_ms = {rtype: {"fixed": 0.5, "per_sample": 0.01}}
    problem = {
        "name": "bad-input, hand-priced",
        "batch_size": 64,
        "samples": 10_000,
        "throughput_min": 0,
        "input_bytes_per_sample": 160,
        "resources": [{"name": rtype, "price_per_hour": 0.2, "max_instances": 4, "bandwidth_gbps": 10}],
        "ps": {"resource": rtype, "rows_per_second_per_shard": 2.0e6, "min_shards": 1},
        "layers": [
            {"name": name, "out_bytes_per_sample": 64, "sparse_rows_per_sample": 26 if name == "embedding" else 0,
             "parallel_fraction": 0.5, "time_ms": time_ms}
            for name in layers
        ],
    }  # fmt: skip
    path = folder / "problem.yaml"
    path.write_text(yaml.safe_dump(problem))
    return path


@pytest.mark.slow
def test_run_with_unreachable_floor_exits_3_naming_the_highest_reachable(
    ray_local, dataset, tmp_path, capsys
):
    # one resource type and three layers, priced by hand as a profile prices them (the planning step
    # refuses; a profile, tested end to end in test_run.py and test_profiler.py, would only cost seconds)
    cluster = yaml.safe_load(CLUSTER.read_text())
    cluster["resource_types"] = cluster["resource_types"][:1]
    model = {**MODEL, "hidden": [8]}
    job = _write_job(
        tmp_path, dataset, throughput_min=1.0e12, scheduler="exact", cluster=cluster, model=model
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own notes\n")
    problem = _one_type_problem(tmp_path, ["embedding", "fc1", "logit"], cluster["resource_types"][0]["name"])
    argv = ["run", str(job), "--problem", str(problem), "--steps", "2", "--no-progress"]
    err = _refused(argv, capsys, code=3)
    assert "no plan reaches the floor of 1,000,000,000,000 samples/s" in err, err
    best = float(err.split("the fastest reaches ")[1].split(" samples/s")[0].replace(",", ""))
    assert 0 < best < 1.0e12
    assert (out / "notes.txt").read_text() == "the user's own notes\n"
    assert not (out / SUMMARY_FILE).exists() and not (out / "plan.json").exists()  # nothing trained


# -- missing or unreadable data -----------------------------------------------------------------


_BREAKS = ("missing", "unreadable", "not parquet", "truncated", "other columns")


def _break_part(dataset: Path, folder: Path, how: str) -> tuple[Path, Path]:
    """A copy of `dataset` with split=train/part-00001 broken `how`; returns (copy, the broken part)."""
    copy = folder / "data"
    shutil.copytree(dataset, copy)
    part = copy / "split=train" / "part-00001.parquet"
    if how == "missing":
        part.unlink()
    elif how == "unreadable":
        if os.geteuid() == 0:  # root reads a mode-000 file: a folder where the part should be instead
            part.unlink()
            part.mkdir()
        else:
            part.chmod(0)
    elif how == "not parquet":
        part.write_text("label\tI1\n0\t1\n")
    elif how == "truncated":
        part.write_bytes(part.read_bytes()[:-100])
    elif how == "other columns":
        pq.write_table(pa.table({"label": [0, 1], "x": [1.0, 2.0]}), part)
    return copy, part


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("missing", "missing (1 of the 3 train partitions _meta.json lists are gone"),
        ("unreadable", "not a readable Parquet file"),
        ("not parquet", "not a readable Parquet file"),
        ("truncated", "not a readable Parquet file"),
        ("other columns", "missing columns ['I1'"),
    ],
    ids=list(_BREAKS),
)
def test_missing_or_unreadable_data_part_exits_2_before_any_actor_starts(
    dataset, tmp_path, capsys, how, expected
):
    data, part = _break_part(dataset, tmp_path, how)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own notes\n")
    argv = ["train", str(_write_job(tmp_path, data)), "--plan", str(PLAN), "--no-progress"]
    err = _refused(argv, capsys)
    assert f"error: {part}: " in err and expected in err, err
    assert _tree(out) == {"notes.txt": b"the user's own notes\n"}


def test_missing_dataset_directory_exits_2(tmp_path, capsys):
    job = _write_job(tmp_path, tmp_path / "no-such-data")
    err = _refused(["train", str(job), "--plan", str(PLAN), "--no-progress"], capsys)
    assert f"{tmp_path / 'no-such-data'}: not a dataset directory (expected _meta.json" in err, err
    assert not (tmp_path / "out").exists()


def test_overwrite_with_missing_data_keeps_the_previous_run(tmp_path, capsys):
    """--overwrite replaces a run only once the new one can start: a data error leaves the old one."""
    job = _write_job(tmp_path, tmp_path / "no-such-data")
    before = _previous_run(tmp_path / "out")
    err = _refused(["train", str(job), "--plan", str(PLAN), "--overwrite", "--no-progress"], capsys)
    assert "not a dataset directory" in err
    assert _tree(tmp_path / "out") == before


def _tsv_with_bad_rows(criteo_sample: Path, folder: Path) -> Path:
    from heterps_ray.data.criteo import read_table, write_text

    tsv = folder / "day.tsv"
    write_text(read_table(criteo_sample), tsv)
    lines = tsv.read_text().split("\n")
    lines[4] = "1\t2\t3"  # line 5: 3 fields instead of 40
    fields = lines[9].split("\t")
    fields[0] = "7"  # line 10: a label that is not 0/1
    lines[9] = "\t".join(fields)
    tsv.write_text("\n".join(lines))
    return tsv


def test_malformed_rows_stop_a_strict_convert_with_file_and_line(criteo_sample, tmp_path, capsys):
    tsv = _tsv_with_bad_rows(criteo_sample, tmp_path)
    err = _refused(["data", "convert", str(tsv), "-o", str(tmp_path / "out"), "--strict"], capsys)
    assert f"{tsv}:5: malformed row: " in err and "(strict mode)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.tsv"]  # no output, no temporaries


def test_malformed_rows_are_counted_and_reported_when_lenient(criteo_sample, tmp_path, capsys):
    tsv = _tsv_with_bad_rows(criteo_sample, tmp_path)
    assert main(["data", "convert", str(tsv), "-o", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "skipped 2 malformed rows" in printed and f"{tsv}:5" in printed and f"{tsv}:10" in printed
    meta = json.loads((tmp_path / "out" / "_meta.json").read_text())
    assert meta["bad_rows"]["count"] == 2 and meta["rows"]["train"] + meta["rows"]["eval"] == 198
    assert [e.split(": ")[0] for e in meta["bad_rows"]["examples"]] == [f"{tsv}:5", f"{tsv}:10"]


# -- corrupted checkpoints and snapshots --------------------------------------------------------


@pytest.fixture(scope="module")
def one_stage_plan(tmp_path_factory) -> Path:
    """Every layer on cpu_small in one stage, 2 PS shards: the fewest actors a checkpointed run needs."""
    plan = json.loads(PLAN.read_text())
    plan["assignment"] = ["cpu_small"] * 4
    plan["stages"] = [{"layers": ["embedding", "fc1", "fc2", "logit"], "type": "cpu_small", "replicas": 1}]
    path = tmp_path_factory.mktemp("plans") / "one_stage.json"
    path.write_text(json.dumps(plan))
    return path


# every checkpoint full, so each stands alone: these tests damage single snapshots (a damaged or missing
# link of an incremental chain is tests/test_incremental_checkpoints.py's)
CHECKPOINTING = {"checkpoint_every": EVERY, "checkpoint_full_every": 1}


@pytest.fixture(scope="module")
def checkpointed_run(ray_local, dataset, one_stage_plan, tmp_path_factory) -> Path:
    """A real sync run of STEPS batches with a checkpoint every EVERY: model/ and checkpoints/."""
    folder = tmp_path_factory.mktemp("checkpointed")
    job = _write_job(folder, dataset, runtime=CHECKPOINTING)
    argv = ["train", str(job), "--plan", str(one_stage_plan), "--steps", str(STEPS), "--no-progress"]
    assert main(argv) == 0
    out = folder / "out"
    steps = sorted(p.name for p in (out / CHECKPOINTS_DIR).iterdir())
    assert steps == [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)][-2:]
    return out


def _copy_run(run: Path, folder: Path, dataset: Path) -> tuple[Path, Path]:
    """A copy of the checkpointed run in `folder`/out with a job file pointing at it."""
    shutil.copytree(run, folder / "out")
    return _write_job(folder, dataset, runtime=CHECKPOINTING), folder / "out"


def _resume_argv(job, plan) -> list[str]:
    """`heterps train --resume` of the checkpointed run, two batches past its end."""
    return ["train", str(job), "--plan", str(plan), "--steps", str(STEPS + 2), "--resume", "--no-progress"]


def test_resume_from_truncated_checkpoints_exits_2_naming_the_file(
    checkpointed_run, one_stage_plan, dataset, tmp_path, capsys
):
    job, out = _copy_run(checkpointed_run, tmp_path, dataset)
    for step in (out / CHECKPOINTS_DIR).iterdir():
        shard = step / "ps-shard-00000.npz"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = _tree(out)
    err = _refused(_resume_argv(job, one_stage_plan), capsys)
    newest = out / CHECKPOINTS_DIR / f"step-{STEPS:08d}" / "ps-shard-00000.npz"
    assert "no valid checkpoint" in err and f"{newest}: SHA-256 differs" in err, err
    assert _tree(out) == before


def test_resume_from_a_snapshot_corrupted_before_its_manifest_exits_2_naming_it(
    checkpointed_run, one_stage_plan, dataset, tmp_path, capsys
):
    """The driver's manifest matches the broken file: the hash its PS shard reported when it wrote the
    snapshot still catches it; a checkpoint without those reports (older runs) leaves it to the PS
    shard actor reading the file."""
    job, out = _copy_run(checkpointed_run, tmp_path, dataset)
    newest = out / CHECKPOINTS_DIR / f"step-{STEPS:08d}"
    for older in (out / CHECKPOINTS_DIR).iterdir():
        if older != newest:
            shutil.rmtree(older)
    shard = newest / "ps-shard-00001.npz"
    shard.write_bytes(b"PK\x03\x04" + bytes(200))
    manifest = json.loads((newest / MANIFEST).read_text())
    write_manifest(newest, {k: v for k, v in manifest.items() if k != "files"})
    before = _tree(out)
    err = _refused(_resume_argv(job, one_stage_plan), capsys)
    assert f"{shard}: PS shard snapshot written by node" in err and "differs from its SHA-256" in err, err
    assert _tree(out) == before
    write_manifest(newest, {k: v for k, v in manifest.items() if k not in ("files", "shards")})
    err = _refused(_resume_argv(job, one_stage_plan), capsys)
    assert f"{shard}: not a readable .npz" in err, err


@pytest.mark.parametrize("damage", ["truncated shard", "flipped dense byte", "model.json not JSON"])
def test_loading_a_corrupted_model_is_a_data_error_naming_the_file(checkpointed_run, tmp_path, damage):
    model = tmp_path / "model"
    shutil.copytree(checkpointed_run / "model", model)
    if damage == "truncated shard":
        broken = next((model / "sparse").iterdir())
        broken.write_bytes(broken.read_bytes()[:-64])
        (model / MANIFEST).unlink()  # no manifest to catch it: the .npz reader must
    elif damage == "flipped dense byte":
        broken = model / "dense.npz"
        _flip(broken, 200)
    else:
        broken = model / "model.json"
        broken.write_text('{"model": ')
        manifest = json.loads((model / MANIFEST).read_text())
        write_manifest(model, {k: v for k, v in manifest.items() if k != "files"})
    before = _tree(model)
    with pytest.raises(DataError, match=re.escape(str(broken))):
        load_checkpoint(model)
    assert _tree(model) == before


def _snapshot_of(index: int, num_shards: int, path: Path) -> PSShard:
    shard = PSShard(index, num_shards, {"embedding": TableSpec(dim=4)})
    keys = np.arange(100, dtype=np.int64) * 7919
    shard.pull("embedding", keys)
    shard.snapshot(str(path))
    return shard


def test_truncated_ps_snapshot_is_a_data_error_naming_it(tmp_path):
    path = tmp_path / "ps-shard-00000.npz"
    _snapshot_of(0, 2, path)
    path.write_bytes(path.read_bytes()[:-50])
    before = path.read_bytes()
    with pytest.raises(DataError, match=re.escape(f"{path}: not a readable .npz")):
        PSShard(0, 2, {"embedding": TableSpec(dim=4)}).restore(str(path))
    assert path.read_bytes() == before


@pytest.mark.parametrize("which", ["another shard's", "not a snapshot"])
def test_ps_snapshot_of_something_else_is_a_data_error_naming_it(tmp_path, which):
    path = tmp_path / "ps-shard-00000.npz"
    if which == "another shard's":
        _snapshot_of(1, 2, path)
    else:
        write_npz_atomic(path, {"weights": np.ones((3, 4), dtype=np.float32)})
    with pytest.raises(DataError, match=re.escape(str(path))):
        PSShard(0, 2, {"embedding": TableSpec(dim=4)}).restore(str(path))


# -- an output directory that already holds a run ------------------------------------------------


def test_train_into_a_previous_run_is_refused_without_resume_or_overwrite(
    checkpointed_run, one_stage_plan, dataset, tmp_path, capsys
):
    job, out = _copy_run(checkpointed_run, tmp_path, dataset)
    before = _tree(out)
    err = _refused(
        ["train", str(job), "--plan", str(one_stage_plan), "--steps", "2", "--no-progress"], capsys
    )
    assert "field 'output_dir'" in err and "--resume" in err and "--overwrite" in err and str(out) in err
    err = _refused(["train", str(job), "--plan", str(one_stage_plan), "--resume", "--overwrite"], capsys)
    assert "field '--resume': expected not together with --overwrite" in err
    assert _tree(out) == before


@pytest.mark.parametrize("earlier", ["run_report.json", "run_summary.json"], ids=["run", "train"])
def test_run_into_a_previous_run_is_refused_before_profiling(dataset, tmp_path, capsys, earlier):
    """A `heterps run` or a `heterps train` run is refused before problem.yaml / plan.json are written."""
    job = _write_job(tmp_path, dataset)
    out = tmp_path / "out"
    out.mkdir()
    (out / earlier).write_text('{"job": "earlier"}\n')
    (out / "plan.json").write_text('{"an": "earlier plan"}\n')
    before = _tree(out)
    err = _refused(["run", str(job), "--no-progress"], capsys)
    assert "field 'output_dir'" in err and f"found {earlier}" in err and "--overwrite" in err
    assert _tree(out) == before


# -- user errors raised inside Ray actors ---------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("plan.json", "stages.0.type", "a resource type", "h100"), 2),
        (InfeasibleError("no plan reaches the floor; the fastest reaches 12 samples/s", 12.0), 3),
        (DataError("part-00001.parquet: not a readable Parquet file"), 2),
    ],
    ids=["config", "infeasible", "data"],
)
def test_user_error_raised_in_an_actor_keeps_its_message_and_exit_code(ray_local, error, code):
    """Ray pickles the error back to the driver and wraps it; the CLI shows the error, not a traceback."""
    from heterps_ray.cli import _user_error

    def fail(sent: HeterPSError) -> None:
        raise sent

    task = ray_local.remote(num_cpus=0, max_retries=0)(fail)
    with pytest.raises(HeterPSError) as info:
        ray_local.get(task.remote(error))
    shown = _user_error(info.value)
    assert type(shown) is type(error) and str(shown) == str(error) and shown.exit_code == code
    assert vars(shown) == vars(error)  # file, field, expected, got / best_throughput survive


# -- the exit code through a real `heterps` process -----------------------------------------------


def test_heterps_process_exits_3_for_an_unreachable_floor(tmp_path):
    problem = yaml.safe_load(PROBLEM.read_text())
    problem["throughput_min"] = 5.0e7
    path = tmp_path / "too_fast.yaml"
    path.write_text(yaml.safe_dump(problem))
    heterps = Path(sys.executable).with_name("heterps")
    plan = subprocess.run(
        [str(heterps), "plan", "--problem", str(path), "--scheduler", "exact"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plan.returncode == 3, plan.stderr
    assert "no plan meets the floor" in plan.stderr and "Traceback" not in plan.stderr


# -- every file and path a command names --------------------------------------------------------


@pytest.fixture
def no_ray(monkeypatch):
    """Bad input is caught before Ray starts: starting it fails the test."""
    import ray

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray started before the bad input was caught")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)


def _not_utf8(path: Path) -> None:
    """What `head -c 2000 /dev/urandom > path` makes, reproducibly."""
    path.write_bytes(b"\xff" + np.random.default_rng(0).bytes(1999))


# kind of bad file: (make it at the path, what the message says for a YAML file, for a JSON file)
BAD_FILES: dict[str, tuple[Callable[[Path], object], str, str]] = {
    "missing": (lambda p: None, "(got 'No such file or directory')", "(got 'No such file or directory')"),
    "a directory": (lambda p: p.mkdir(), "(got 'Is a directory')", "(got 'Is a directory')"),
    "not UTF-8": (
        _not_utf8,
        "in UTF-8 (got 'byte 0xff at offset 0: not UTF-8 text')",
        "in UTF-8 (got 'byte 0xff",
    ),
    "empty": (lambda p: p.write_text(""), "a mapping at the top level", "valid JSON"),
    "malformed": (lambda p: p.write_text('{"stages": [1, 2\n'), "valid YAML", "valid JSON"),
}

Job = Callable[..., Path]  # writes a good job file with the given changes, returns its path
# (where a command names a file, its format, the command line given the bad file and a Job)
INPUT_FILES: list[tuple[str, str, Callable[[Path, Job], list[str]]]] = [
    ("check JOB", "yaml", lambda bad, job: ["check", str(bad)]),
    ("train JOB", "yaml", lambda bad, job: ["train", str(bad), "--plan", str(PLAN)]),
    ("run JOB", "yaml", lambda bad, job: ["run", str(bad), "--no-progress"]),
    ("profile JOB", "yaml", lambda bad, job: ["profile", str(bad), "-o", str(bad.parent / "p.yaml")]),
    ("reference JOB", "yaml", lambda bad, job: ["reference", str(bad), "--no-progress"]),
    ("job model", "yaml", lambda bad, job: ["check", str(job(model=str(bad)))]),
    ("job cluster", "yaml", lambda bad, job: ["train", str(job(cluster=str(bad))), "--plan", str(PLAN)]),
    ("cluster render CLUSTER", "yaml", lambda bad, job: ["cluster", "render", str(bad), "--kuberay"]),
    ("plan --problem", "yaml", lambda bad, job: ["plan", "--problem", str(bad)]),
    ("compare --problem", "yaml", lambda bad, job: ["compare", "--problem", str(bad)]),
    ("run --problem", "yaml", lambda bad, job: ["run", str(job()), "--problem", str(bad), "--no-progress"]),
    ("simulate --problem", "yaml", lambda bad, job: ["simulate", "--problem", str(bad), "--plan", str(PLAN)]),
    (
        "plot frontier --problem",
        "yaml",
        lambda bad, job: ["plot", "frontier", "--problem", str(bad), "-o", str(bad.parent / "f.png")],
    ),
    ("train --plan", "json", lambda bad, job: ["train", str(job()), "--plan", str(bad), "--no-progress"]),
    ("simulate --plan", "json", lambda bad, job: ["simulate", "--problem", str(PROBLEM), "--plan", str(bad)]),
    (
        "plot pipeline --plan",
        "json",
        lambda bad, job: [
            "plot",
            "pipeline",
            "--problem",
            str(PROBLEM),
            "--plan",
            str(bad),
            "-o",
            str(bad.parent / "p.png"),
        ],
    ),
]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("where", "fmt", "argv"), INPUT_FILES, ids=[c[0] for c in INPUT_FILES])
@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_bad_input_file_exits_2_naming_it_before_ray_starts(
    no_ray, dataset, tmp_path, capsys, kind, where, fmt, argv
):
    make, yaml_says, json_says = BAD_FILES[kind]
    bad = tmp_path / f"bad.{fmt}"
    make(bad)
    err = _refused(argv(bad, lambda **changes: _write_job(tmp_path, dataset, **changes)), capsys)
    assert f"error: {bad}: field '<file>': expected " in err, err
    assert (yaml_says if fmt == "yaml" else json_says) in err, err


def test_problems_of_a_suite_that_are_not_utf8_exit_2_naming_the_file(no_ray, tmp_path, capsys):
    bad = tmp_path / "problems" / "cloud.yaml"
    bad.parent.mkdir()
    _not_utf8(bad)
    err = _refused(["tune", "schedulers", "--problems", str(bad.parent), "-o", str(tmp_path / "t")], capsys)
    assert f"error: {bad}: field '<file>': expected a readable YAML file, in UTF-8" in err, err


# (case, what exists at the path, the command line given the path and a Job, the field it names)
OUTPUT_PATHS: list[tuple[str, str, Callable[[Path, Job], list[str]], str]] = [
    (
        "train output_dir",
        "file",
        lambda p, job: ["train", str(job(output_dir=str(p))), "--plan", str(PLAN)],
        "output_dir",
    ),
    (
        "run output_dir",
        "file",
        lambda p, job: ["run", str(job(output_dir=str(p))), "--no-progress"],
        "output_dir",
    ),
    ("reference output_dir", "file", lambda p, job: ["reference", str(job(output_dir=str(p)))], "output_dir"),
    (
        "output_dir under a file",
        "file",
        lambda p, job: ["check", str(job(output_dir=str(p / "run")))],
        "output_dir",
    ),
    ("run --output-dir", "file", lambda p, job: ["run", str(job()), "--output-dir", str(p)], "--output-dir"),
    ("profile --output", "dir", lambda p, job: ["profile", str(job()), "-o", str(p)], "--output"),
    (
        "plan --output",
        "dir",
        lambda p, job: ["plan", "--problem", str(PROBLEM), "--output", str(p)],
        "--output",
    ),
    (
        "compare --output",
        "dir",
        lambda p, job: ["compare", "--problem", str(PROBLEM), "--output", str(p)],
        "--output",
    ),
    (
        "simulate --timeline",
        "dir",
        lambda p, job: ["simulate", "--problem", str(PROBLEM), "--plan", str(PLAN), "--timeline", str(p)],
        "--timeline",
    ),
    (
        "simulate --queues",
        "dir",
        lambda p, job: ["simulate", "--problem", str(PROBLEM), "--plan", str(PLAN), "--queues", str(p)],
        "--queues",
    ),
    (
        "cluster render --output",
        "dir",
        lambda p, job: ["cluster", "render", str(CLUSTER), "--kuberay", "-o", str(p)],
        "--output",
    ),
    (
        "plot frontier --output",
        "dir",
        lambda p, job: ["plot", "frontier", "--problem", str(PROBLEM), "-o", str(p)],
        "--output",
    ),
    (
        "plot frontier --table",
        "dir",
        lambda p, job: [
            "plot",
            "frontier",
            "--problem",
            str(PROBLEM),
            "-o",
            str(p.parent / "f.png"),
            "--table",
            str(p),
        ],
        "--table",
    ),
    (
        "plot pipeline --output",
        "dir",
        lambda p, job: ["plot", "pipeline", "--problem", str(PROBLEM), "--plan", str(PLAN), "-o", str(p)],
        "--output",
    ),
    (
        "plot schedulers --output",
        "file",
        lambda p, job: ["plot", "schedulers", str(p.parent / "r.parquet"), "-o", str(p)],
        "--output",
    ),
    (
        "tune schedulers --output",
        "file",
        lambda p, job: ["tune", "schedulers", "--problems", str(PROBLEM), "-o", str(p)],
        "--output",
    ),
    ("export --output", "file", lambda p, job: ["export", str(p.parent), "-o", str(p)], "--output"),
    (
        "predict --output",
        "dir",
        lambda p, job: ["predict", str(p.parent), "--data", str(p.parent / "d"), "-o", str(p)],
        "--output",
    ),
]


@pytest.mark.parametrize(("case", "exists", "argv", "field"), OUTPUT_PATHS, ids=[c[0] for c in OUTPUT_PATHS])
def test_output_path_of_the_wrong_kind_exits_2_and_keeps_what_is_there(
    no_ray, dataset, tmp_path, capsys, case, exists, argv, field
):
    path = tmp_path / "existing"
    if exists == "file":
        path.write_text("the user's own notes\n")
    else:
        path.mkdir()
        (path / "notes.txt").write_text("the user's own notes\n")
    before = _tree(tmp_path)
    job = tmp_path / "job.yaml"
    err = _refused(argv(path, lambda **changes: _write_job(tmp_path, dataset, **changes)), capsys)
    named = job if field == "output_dir" else path
    assert f"error: {named}: field '{field}': expected a path where a " in err and str(path) in err, err
    assert {k: v for k, v in _tree(tmp_path).items() if k != job.name} == before


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize("damage", ["binary bytes in a row", "all binary"])
def test_criteo_text_with_binary_bytes_exits_2_without_a_traceback(
    criteo_sample, tmp_path, capsys, damage, strict
):
    from heterps_ray.data.criteo import read_table, write_text

    tsv = tmp_path / "day.tsv"
    if damage == "all binary":
        _not_utf8(tsv)
    else:
        write_text(read_table(criteo_sample), tsv)
        raw = bytearray(tsv.read_bytes())
        raw[300:340] = bytes(range(200, 240))  # not UTF-8, and five of the row's tabs gone
        tsv.write_bytes(bytes(raw))
    argv = ["data", "convert", str(tsv), "-o", str(tmp_path / "out")] + (["--strict"] if strict else [])
    err = _refused(argv, capsys)
    assert f"error: {tsv}: not UTF-8 text" in err and "expected a Criteo TSV or header CSV file" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.tsv"]


@pytest.mark.parametrize("command", ["train", "data info"])
def test_dataset_metadata_that_is_not_utf8_exits_2_naming_it(no_ray, dataset, tmp_path, capsys, command):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    meta = data / "_meta.json"
    _not_utf8(meta)
    job = _write_job(tmp_path, data)
    argv = (
        ["train", str(job), "--plan", str(PLAN), "--no-progress"]
        if command == "train"
        else ["data", "info", str(data)]
    )
    err = _refused(argv, capsys)
    assert f"error: {meta}: unreadable ('utf-8' codec can't decode byte 0xff" in err, err
