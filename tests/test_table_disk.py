"""The planner chooses the disk (costmodel/table_disk.py): a table the PS type's memory cannot hold goes
to the type's local disk (disk_gb, disk_dir in the cluster file), with the fewest shards whose disks hold
the rows beyond RAM; a table the disk cannot hold either is refused with its figures (exit 3); the shard
actors get the type's disk without table.ram_mb, and `heterps run` trains the quickstart job on disk to
the AUC it reaches in RAM."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from heterps_ray.config import load_job
from heterps_ray.costmodel import load_problem, problem_from_dict
from heterps_ray.costmodel.problem import PSTable, RuntimeTerms
from heterps_ray.costmodel.runtime_terms import table_rate
from heterps_ray.costmodel.table_memory import (
    GIB,
    check_job_table,
    estimate_table,
    figures,
    shards_needed,
    table_section,
)
from heterps_ray.data.synth import synthesize
from heterps_ray.errors import InfeasibleError
from heterps_ray.ps.disk_tier import INDEX_BYTES_PEAK, record_dtype
from heterps_ray.ps.disk_timing import time_disk
from heterps_ray.ps.row_bytes import stored_bytes_per_row
from heterps_ray.ps.spec import job_disk_folder, sparse_spec

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "jobs" / "quickstart.yaml"
TIGHT_GB = 0.0005  # the PS type's table memory: the quickstart table needs 8 shards in RAM, cpu_small has 4


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """20,000 synthetic rows: a table of ~4,000 rows (admission on)."""
    path = tmp_path_factory.mktemp("disk") / "data"
    synthesize(path, 20_000, seed=5)
    return path


def _cluster(tmp_path: Path, table_memory_gb: float | None, disk_gb: float | None) -> Path:
    """configs/clusters/local.yaml with the PS type (cpu_small) given this table memory and disk."""
    cluster = yaml.safe_load((REPO / "configs" / "clusters" / "local.yaml").read_text())
    ps = cluster["resource_types"][0]
    assert ps["name"] == cluster["ps"]["resource"] == "cpu_small"
    if table_memory_gb is not None:
        ps["table_memory_gb"] = table_memory_gb
    if disk_gb is not None:
        ps.update(disk_gb=disk_gb, disk_dir=str(tmp_path / "ps-disk"))
    path = tmp_path / f"cluster-{table_memory_gb}-{disk_gb}.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return path


def _job(tmp_path: Path, data: Path, table_memory_gb: float | None, disk_gb: float | None, **changes: Any):
    return load_job(
        QUICKSTART,
        {
            "data.path": str(data),
            "cluster": str(_cluster(tmp_path, table_memory_gb, disk_gb)),
            "output_dir": str(tmp_path / "out"),
            **changes,
        },
    )


def test_a_table_over_the_ps_types_memory_goes_to_its_disk_with_the_fewest_shards(data, tmp_path):
    job = _job(tmp_path, data, 0.0001, 1.0)
    estimate = estimate_table(job)
    assert estimate is not None and estimate.disk is not None
    disk = estimate.disk
    cap = job.cluster.type("cpu_small").max_instances
    assert 1 <= disk.shards <= cap and disk.holds(disk.shards)
    assert disk.shards == 1 or not disk.holds(disk.shards - 1)  # the fewest
    split = disk.split(disk.shards)
    assert split.hot_rows + split.disk_rows >= estimate.rows / disk.shards  # every row somewhere
    assert split.disk_rows > 0 and split.disk_bytes <= 1.0 * GIB
    # RAM keeps the budget less the disk rows' index (21 B each, counted in rows of the tier's cost)
    index = split.disk_rows * INDEX_BYTES_PEAK / stored_bytes_per_row(9, tracked=True)
    assert split.hot_rows == pytest.approx(disk.ram_rows - index, abs=2)
    assert 0.0 < disk.hit_rate < 1.0  # the hot set serves some lookups, never the first of a key
    section = table_section(job, estimate)
    assert section["shards_needed"] == disk.shards and section["disk_gb"] == 1.0
    assert section["disk_rows"] == split.disk_rows * disk.shards
    check_job_table(job, estimate)  # held: not refused
    # in RAM where RAM holds it, as before; refused where the type has no disk
    assert estimate_table(_job(tmp_path, data, None, 1.0)).disk is None
    no_disk = _job(tmp_path, data, 0.0001, None)
    with pytest.raises(InfeasibleError, match="no plan can hold the table"):
        check_job_table(no_disk, estimate_table(no_disk))


def test_where_ram_holds_the_table_on_more_shards_the_disk_is_an_option_to_weigh(data, tmp_path):
    job = _job(tmp_path, data, 0.0005, 1.0)
    estimate = estimate_table(job)
    budget = 0.0005 * GIB
    assert estimate is not None and estimate.disk is None and estimate.shards_within(budget) == 4  # of 4
    option = estimate.disk_option
    assert option is not None and option.shards == 1 and 0.0 < option.hit_rate < 1.0
    taken = estimate.on_disk()
    assert taken.disk == option and taken.disk_option is None and taken.shards_within(budget) == 1
    assert table_section(job, taken)["disk_rows"] > 0 and "disk_rows" not in table_section(job, estimate)
    # nothing to weigh where RAM holds it on the fewest shards, or the type declares no disk
    assert estimate_table(_job(tmp_path, data, None, 1.0)).disk_option is None
    assert estimate_table(_job(tmp_path, data, 0.0005, None)).disk_option is None


def test_a_tiny_budget_counts_its_shards_exactly_and_reads_as_itself(data, tmp_path):
    """A budget under a MiB (the tests' clusters) is not rounded away: the problem's shards are counted
    from the budget the run's checks use, and the messages print it."""
    job = _job(tmp_path, data, 0.00016, None)  # 0.000 at three decimals
    estimate = estimate_table(job)
    section = table_section(job, estimate)
    assert section["shards_needed"] == shards_needed(estimate.total_bytes, 0.00016 * GIB) >= 2
    assert section["budget_gb"]["cpu_small"] == 0.00016
    table = PSTable(**{**section, "budget_gb": {"cpu_small": 0.00016}})
    assert "cpu_small 0.00016 GiB" in figures(table, "cpu_small", 1)


def test_a_job_short_of_disk_is_refused_with_the_figures(data, tmp_path):
    job = _job(tmp_path, data, 0.0001, 0.0001)
    estimate = estimate_table(job)
    assert estimate is not None and estimate.disk is not None
    with pytest.raises(InfeasibleError) as err:
        check_job_table(job, estimate)
    message = str(err.value)
    for figure in (f"{estimate.rows:,} expected rows", "B/row", "RAM budget of", "disk_gb is 0.0001",
                   f"need {estimate.disk.shards:,} PS shards", "max_instances 4", "a larger disk_gb"):  # fmt: skip
        assert figure in message, (figure, message)


def test_shard_actors_get_the_types_disk_and_ram_rows_without_ram_mb(data, tmp_path):
    job = _job(tmp_path, data, 0.0001, 1.0)
    disk = estimate_table(job).disk
    spec = sparse_spec(job, 9, 0.0, disk)
    assert spec.ram_rows == disk.ram_rows > 0
    assert spec.disk_dir == str(job_disk_folder(job, str(tmp_path / "ps-disk")))
    assert Path(spec.disk_dir).parent == tmp_path / "ps-disk"
    assert sparse_spec(job, 9, 0.0).disk_dir == ""  # hosted shards: no disk
    # the job's own disk tier wins
    own = _job(tmp_path, data, 0.0001, 1.0, **{"table.disk_dir": str(tmp_path / "mine"), "table.ram_mb": 2})
    spec = sparse_spec(own, 9, 0.0, estimate_table(own).disk)
    assert Path(spec.disk_dir).parent == tmp_path / "mine" and spec.ram_rows != disk.ram_rows


def test_the_price_adds_the_rows_ram_misses_at_disk_ms_per_row():
    data = load_problem(REPO / "configs" / "problems" / "ctr_dnn_cloud.yaml").to_dict()
    table = {"rows": 1_000_000, "bytes_per_row": 150.0, "budget_gb": {}, "shards_needed": 2}
    terms = RuntimeTerms(ps_wait_ms_per_row=0.001, disk_ms_per_row=0.01)
    data["ps"]["table"] = table
    in_ram = table_rate(problem_from_dict(data), terms, "cpu", hosted=False)
    data["ps"]["table"] = {**table, "disk_rows": 800_000, "ram_hit_rate": 0.75}
    on_disk = table_rate(problem_from_dict(data), terms, "cpu", hosted=False)
    assert in_ram.ms_per_row == pytest.approx(0.001)
    assert on_disk.ms_per_row == pytest.approx(0.001 + 0.25 * 0.01) and on_disk.hit_rate == 0.75


def test_the_profile_times_the_disk_as_the_tier_uses_it_and_leaves_nothing_there(tmp_path):
    timings = time_disk(tmp_path / "disk", record_dtype(9, 9), reads_in_flight=8)
    timed = {(t.what, t.depth) for t in timings}
    assert timed == {("append", 1), ("warm", 8), ("miss", 8), *(("cold", d) for d in (1, 8, 16, 64))}, timed
    assert all(t.rows >= 4 * 1024 and t.ms > 0 for t in timings), timings
    assert not any((tmp_path / "disk").iterdir())  # its file removed
    # a disk too small to time says where and what was expected
    with pytest.raises(OSError, match=r"disk2: room for \d+ records of 88 B to time the disk, expected at least"):
        time_disk(tmp_path / "disk2", record_dtype(9, 9), reads_in_flight=8, disk_gb=1e-5)


def test_the_fit_prices_a_row_ram_misses_at_the_measured_miss():
    from heterps_ray.profiling.fit_runtime import runtime_terms
    from heterps_ray.profiling.rows import Row

    rows = [Row("disk", "cpu_small", peer="cold", calls=32, rows=4096, ms=100.0),
            Row("disk", "cpu_small", peer="miss", calls=32, rows=4096, ms=200.0),
            Row("disk", "cpu_small", peer="miss", calls=32, rows=4096, ms=210.0)]  # fmt: skip
    quality: list[dict[str, Any]] = []
    terms = runtime_terms({"layers": [], "resources": []}, pd.DataFrame([r.__dict__ for r in rows]), {}, quality)
    assert terms["disk_ms_per_row"] == pytest.approx(410.0 / 8192, abs=1e-6)
    assert [q["layer"] for q in quality] == ["cold x32", "miss x32", "miss x32"]


def _run(job: Path) -> tuple[int, str]:
    """`heterps run JOB` as a user runs it, in a process of its own (its own embedded Ray)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "heterps_ray", "run", str(job), "--no-progress", "--quick-profile"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    return done.returncode, done.stdout + done.stderr


def _quickstart(tmp_path: Path, name: str, data: Path, cluster: Path) -> Path:
    job = yaml.safe_load(QUICKSTART.read_text())
    job.update(model=str(REPO / "configs" / "models" / "ctr_dnn.yaml"), cluster=str(cluster),
               output_dir=str(tmp_path / name))  # fmt: skip
    job["data"]["path"] = str(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.slow
def test_run_trains_the_quickstart_on_the_ps_types_disk_to_its_auc_in_ram(tmp_path):
    """The quickstart job with the PS type's table memory 8x too small and a disk declared, no
    table.ram_mb: `heterps run` trains on disk (the report says so) to the AUC of the same job in RAM;
    with too little disk it exits 3 with the figures, before Ray starts."""
    data = tmp_path / "data"
    synthesize(data, 200_000, seed=0)  # the quickstart's data (data.synth_rows)
    short = _quickstart(tmp_path, "short", data, _cluster(tmp_path, TIGHT_GB, 0.0001))
    code, out = _run(short)
    assert code == 3, out
    assert "no plan can hold the table" in out and "disk_gb is 0.0001" in out and "max_instances 4" in out, out

    code, out = _run(_quickstart(tmp_path, "on_disk", data, _cluster(tmp_path, TIGHT_GB, 1.0)))
    assert code == 0, out
    report = json.loads((tmp_path / "on_disk" / "run_report.json").read_text())
    table = report["sparse_table"]
    assert "the rest on disk under" in table["place"], table
    assert table["disk_rows"] > table["ram_rows"] > 0, table  # most rows were on disk
    assert "on disk" in out and "RAM + disk" in out, out
    assert any((tmp_path / "ps-disk").rglob("rows.*.dat"))  # under the type's disk_dir
    # the profile timed the type's disk, so the plan prices the rows RAM misses
    problem = load_problem(tmp_path / "on_disk" / "problem.yaml")
    assert problem.runtime is not None and problem.runtime.disk_ms_per_row > 0, problem.runtime
    # the run's share of lookups served from RAM, in the estimate's unit (one LRU over the key stream)
    estimated = problem.ps.table.ram_hit_rate
    assert table["ram_hit_rate"] == pytest.approx(estimated, abs=0.03), (table["ram_hit_rate"], estimated)

    code, out = _run(_quickstart(tmp_path, "ram", data, REPO / "configs" / "clusters" / "local.yaml"))
    assert code == 0, out
    in_ram = json.loads((tmp_path / "ram" / "run_report.json").read_text())
    assert "disk_rows" not in in_ram["sparse_table"]
    assert report["auc"] == pytest.approx(in_ram["auc"], abs=0.002), (report["auc"], in_ram["auc"])

    # RAM holds the table on the type's 4 instances, the disk on 2: both planned, the cheaper trained
    code, out = _run(_quickstart(tmp_path, "weighed", data, _cluster(tmp_path, 2 * TIGHT_GB, 1.0)))
    assert code == 0, out
    weighed = re.search(
        r"table: in RAM on 4 shard\(s\) ([\d.]+) \$ at [\d.]+ \$/h; on the PS type's disk on 2 "
        r"\([\d.]+% of lookups from RAM\) ([\d.]+) \$ at [\d.]+ \$/h: (RAM|the disk)",
        out,
    )
    assert weighed, out
    ram_cost, disk_cost, chosen = float(weighed[1]), float(weighed[2]), weighed[3]
    assert chosen == ("the disk" if disk_cost < ram_cost else "RAM"), weighed[0]
    plan = json.loads((tmp_path / "weighed" / "plan.json").read_text())
    trained = json.loads((tmp_path / "weighed" / "run_report.json").read_text())["sparse_table"]
    assert plan["cost"] == pytest.approx(min(ram_cost, disk_cost), rel=1e-3)
    assert (plan["ps_shards"], "disk_rows" in trained) == ((2, True) if chosen == "the disk" else (4, False))
