"""Training runs on a real local Ray with the PS shards' rows mostly on local disk (table.disk_dir,
table.ram_mb): the run equals the all-in-RAM run, a shard killed mid-training with rows on disk
recovers to the same rows, and a run stopped after a checkpoint and resumed equals the uninterrupted
one, whether the job set its disk tier or the planner chose the PS type's disk."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_sync_job

from heterps_ray.costmodel.plan import load_plan
from heterps_ray.costmodel.table_memory import estimate_table
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import train

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "configs" / "plans" / "small_three_stage.json"  # 3 stages, 2 PS shards
TOTAL, STOP, EVERY = 12, 6, 2
RAM_MB = 0.02  # ~230 rows per shard in RAM: most of the table's rows are on disk
PLANNER_STOP = 10  # the planner sizes RAM for the whole table: its rows reach disk later
PLANNER_TABLE_GB = 4e-5  # the PS type's table memory: ~470 rows a shard; in RAM the table needs 5 shards


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("disk-tier") / "data"
    synthesize(path, 2_000, seed=5, rows_per_part=1_000)
    return path


def _job(dataset: Path, output: Path, disk: Path | None, chosen_by: str = "job"):
    """The tiny sync job; with `disk`, its rows mostly there: by the job's own table.disk_dir and
    ram_mb (`chosen_by` "job"), or by the planner (`chosen_by` "planner": the PS type's table memory
    too small for the table on its instances, and a disk declared; no ram_mb)."""
    job = tiny_sync_job("disk-tier-test", dataset, output, EVERY)
    runtime = job.runtime.model_copy(update={"ps_hosting": "actors", "checkpoint_full_every": 2})
    table, cluster = job.table, job.cluster
    if disk is not None and chosen_by == "job":
        table = table.model_copy(update={"disk_dir": str(disk), "ram_mb": RAM_MB})
    elif disk is not None:
        ps = cluster.type(cluster.ps_resource)
        declared = ps.model_copy(update={"table_memory_gb": PLANNER_TABLE_GB, "disk_gb": 1.0, "disk_dir": str(disk)})
        types = [declared if t.name == ps.name else t for t in cluster.resource_types]
        cluster = cluster.model_copy(update={"resource_types": types})
    return job.model_copy(update={"runtime": runtime, "table": table, "cluster": cluster})


def _assert_same_model(a: Path, b: Path) -> None:
    ca, cb = load_checkpoint(a / "model"), load_checkpoint(b / "model")
    dense_a, dense_b = ca.net.state_dict(), cb.net.state_dict()
    for name in dense_a:
        np.testing.assert_array_equal(dense_b[name].numpy(), dense_a[name].numpy(), err_msg=name)
    rows_a, rows_b = ca.table.state(), cb.table.state()
    np.testing.assert_array_equal(rows_b["keys"], rows_a["keys"])
    for name in ("weights", "accumulators"):
        np.testing.assert_array_equal(rows_b[name], rows_a[name], err_msg=name)


def _rows_on_disk(disk: Path) -> int:
    """Bytes of the shards' disk files: the run did keep rows on disk."""
    return sum(p.stat().st_size for p in disk.rglob("rows.*.dat"))


@pytest.fixture(scope="module")
def in_ram(ray_local, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("in-ram")
    return train(_job(dataset, out, None), load_plan(PLAN), steps=TOTAL, progress=False)


def test_a_shard_killed_with_rows_on_disk_recovers_and_the_run_equals_all_in_ram(
    ray_local, dataset, tmp_path, in_ram
):
    from fault_injection import PhaseKiller

    disk = tmp_path / "disk"
    killer = PhaseKiller("ps_shard", "train", "sigkill", at=5, flag_dir=str(tmp_path))
    summary = train(_job(dataset, tmp_path / "run", disk), load_plan(PLAN), steps=TOTAL, progress=False, on_chunk=killer)
    (fault,) = summary.extra["faults"]
    assert 0 < fault["rolled_back_to"] < TOTAL  # a checkpoint with rows on disk was restored
    assert _rows_on_disk(disk) > 0
    np.testing.assert_array_equal(summary.losses, in_ram.losses)
    _assert_same_model(Path(in_ram.output_dir), tmp_path / "run")


@pytest.mark.parametrize("chosen_by", ["job", "planner"])
def test_a_run_with_rows_on_disk_resumed_after_a_checkpoint_equals_the_uninterrupted_run(
    ray_local, dataset, tmp_path, in_ram, chosen_by
):
    disk, run = tmp_path / "disk", tmp_path / "run"
    plan = load_plan(PLAN)
    job = _job(dataset, run, disk, chosen_by)
    if chosen_by == "planner":  # on the PS type's disk the table needs 3 shards (in RAM, more than it has)
        estimate = estimate_table(job)
        assert estimate is not None and estimate.disk is not None and estimate.disk.shards == 3
        plan = replace(load_plan(REPO / "configs" / "plans" / "small_two_stage.json"), ps_shards=3)
    stop = STOP if chosen_by == "job" else PLANNER_STOP
    train(job, plan, steps=stop, progress=False)
    assert _rows_on_disk(disk) > 0
    # the full checkpoints hold the shards' rows on disk as hard links, not copies
    linked = list((run / "checkpoints").rglob("ps-shard-*.embedding.rows"))
    assert linked
    resumed = train(_job(dataset, run, disk, chosen_by), plan, steps=TOTAL, progress=False, resume=True)
    assert resumed.extra["resumed_from"]["step"] == stop
    np.testing.assert_array_equal(resumed.losses, in_ram.losses)
    _assert_same_model(Path(in_ram.output_dir), run)
