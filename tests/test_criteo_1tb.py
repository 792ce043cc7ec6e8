"""The Criteo-1TB-shaped problem (scheduling/criteo_1tb.py, issue 50): the all-RAM variant takes the PS
instances the table's bytes imply, the disk variant holds it on fewer instances within the declared disk,
both plan feasibly at the same floor, and `heterps plan` says where a table on disk lives."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from heterps_ray.cli import main
from heterps_ray.costmodel.table_memory import GIB
from heterps_ray.errors import ConfigError
from heterps_ray.ps.row_bytes import stored_bytes_per_row
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.criteo_1tb import (
    MAX_INSTANCES,
    NVME_DISK_GB,
    NVME_KIND,
    RAM_KIND,
    TABLE_ROWS,
    criteo_1tb_problem,
    disk_layout,
    plan_disk_layouts,
)
from heterps_ray.scheduling.gpu_cloud import host_budget_gib

REPO = Path(__file__).resolve().parents[1]


def test_all_in_ram_takes_the_instances_the_tables_bytes_imply():
    problem = criteo_1tb_problem(dim=64)
    table = problem.ps.table
    need = math.ceil(TABLE_ROWS * stored_bytes_per_row(64) / (host_budget_gib(RAM_KIND) * GIB))
    assert need == 8 and table.shards_needed == need and table.disk_rows == 0  # 437 GiB over 60.5 each
    plan = get_scheduler("exact").schedule(problem)
    assert plan.feasible and plan.ps_type == RAM_KIND.name and plan.ps_shards >= need


def test_on_disk_fewer_cheaper_ps_instances_within_the_declared_disk():
    ram_plan = get_scheduler("exact").schedule(criteo_1tb_problem(dim=64))
    layout = disk_layout(64)
    split = layout.split(layout.shards)
    assert layout.shards < 8 and split.disk_rows > 0 and split.disk_bytes <= NVME_DISK_GB * GIB
    assert split.hot_rows >= layout.hot_floor and 0.0 < layout.hit_rate < 1.0
    planned = plan_disk_layouts(64)
    problem, plan = planned[0]  # the fewest shards whose plan the PS rate allows
    assert plan.feasible and plan.ps_type == NVME_KIND.name and problem.ps.table.disk_rows > 0
    ps_per_hour = plan.ps_shards * NVME_KIND.price_per_hour
    assert plan.ps_shards < ram_plan.ps_shards
    assert ps_per_hour < ram_plan.ps_shards * RAM_KIND.price_per_hour
    # more shards keep more hot rows: the share of lookups RAM serves grows with them
    rates = [p.ps.table.ram_hit_rate for p, _ in planned]
    assert rates == sorted(rates) and rates[-1] == 1.0


def test_a_dearer_disk_costs_the_dataworkers_more():
    cheap = get_scheduler("exact").schedule(
        criteo_1tb_problem(dim=64, disk=True, disk_ms_per_row=0.0, ps_shards=4)
    )
    dear = get_scheduler("exact").schedule(criteo_1tb_problem(dim=64, disk=True, ps_shards=4))
    assert dear.cost > cheap.cost and dear.stages[0].replicas > cheap.stages[0].replicas


@pytest.mark.parametrize(
    "changes, field",
    [({"dim": 0}, "dim"), ({"floor": -1.0}, "floor"), ({"zipf": 0.0}, "zipf"),
     ({"disk_ms_per_row": -0.1}, "disk_ms_per_row"), ({"ps_shards": MAX_INSTANCES + 1}, "ps_shards")],
)  # fmt: skip
def test_bad_arguments_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        criteo_1tb_problem(**changes)


def test_heterps_plan_says_where_a_table_on_disk_lives(tmp_path, capsys):
    path = criteo_1tb_problem(dim=64, disk=True, ps_shards=4).save(tmp_path / "disk.yaml")
    assert main(["plan", "--problem", str(path), "--scheduler", "exact"]) == 0
    out = capsys.readouterr().out
    assert "RAM + disk" in out
    assert "rows in the RAM of 4 PS shard(s) on 'cpu_nvme'" in out and "on their disks" in out
    ram = criteo_1tb_problem(dim=64).save(tmp_path / "ram.yaml")
    assert main(["plan", "--problem", str(ram), "--scheduler", "exact"]) == 0
    assert "on their disks" not in capsys.readouterr().out


def test_the_script_writes_both_problems_and_refuses_bad_input(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "plan_criteo_1tb", REPO / "benchmarks" / "plan_criteo_1tb.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} >= {"criteo_1tb_dim64_ram.yaml", "criteo_1tb_dim64_disk.yaml"}
    out = capsys.readouterr().out
    assert "in RAM" in out and "disk, cheapest" in out
    assert script.main(["--out", str(tmp_path), "--dims", "0"]) == 2
    assert "'dim'" in capsys.readouterr().err
