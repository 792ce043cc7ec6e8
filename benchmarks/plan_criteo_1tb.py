"""A Criteo-1TB-shaped problem planned with the table all in PS RAM and with a disk tier (issue 50, "Scale,
simulated"; the problem and what it assumes: heterps_ray/scheduling/criteo_1tb.py).

Per dim: writes the problem files under --out (``criteo_1tb_dim<D>_ram.yaml``, ``..._disk.yaml`` the
cheapest disk layout, ``..._disk_fewest.yaml`` the fewest shards), plans each with ``heterps plan
--scheduler exact``'s scheduler, and prints them side by side (cost, $/h, PS shards and their $/h, where
the table lives, throughput), then every disk layout planned (shards, hit rate, cost). Planning seconds.

    python benchmarks/plan_criteo_1tb.py --out /tmp/criteo-1tb
    python benchmarks/plan_criteo_1tb.py --out /tmp/criteo-1tb --dims 16 64 128 --disk-ms-per-row 0.002

Exit 0 when printed, 2 on bad input (a message naming the argument).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from heterps_ray.config import writable
from heterps_ray.costmodel import Plan, Problem
from heterps_ray.costmodel.table_memory import GIB, check_table_fits
from heterps_ray.errors import HeterPSError
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.criteo_1tb import (
    DIM,
    DISK_MS_PER_ROW,
    FLOOR,
    ZIPF_EXPONENT,
    criteo_1tb_problem,
    disk_layout,
    plan_disk_layouts,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the problem files")
    parser.add_argument("--dims", nargs="+", type=int, default=[DIM], metavar="D", help=f"default {DIM}")
    parser.add_argument("--floor", type=float, default=FLOOR, help=f"samples/s (default {FLOOR:,.0f})")
    parser.add_argument("--zipf", type=float, default=ZIPF_EXPONENT, help="key popularity's exponent")
    parser.add_argument(
        "--disk-ms-per-row",
        type=float,
        default=DISK_MS_PER_ROW,
        help=f"ms a row RAM misses costs (default {DISK_MS_PER_ROW:.4f}: this machine's virtio disk)",
    )
    args = parser.parse_args(argv)
    try:
        out = writable(args.out, "--out", directory=True)
        for dim in args.dims:
            _plan_dim(out, dim, args.floor, args.zipf, args.disk_ms_per_row)
    except HeterPSError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


def _plan_dim(out: Path, dim: int, floor: float, zipf: float, disk_ms_per_row: float) -> None:
    in_ram = criteo_1tb_problem(dim, False, floor, zipf, disk_ms_per_row)
    ram_plan = _plan(in_ram, out / f"criteo_1tb_dim{dim}_ram.yaml")
    layouts = plan_disk_layouts(dim, floor, zipf, disk_ms_per_row)
    on_disk = [(p, plan) for p, plan in layouts if p.ps.table is not None and p.ps.table.disk_rows]
    fewest = on_disk[0]
    feasible = [pair for pair in on_disk if pair[1].feasible]
    cheapest = min(feasible, key=lambda pair: pair[1].cost) if feasible else fewest
    _plan(fewest[0], out / f"criteo_1tb_dim{dim}_disk_fewest.yaml")
    _plan(cheapest[0], out / f"criteo_1tb_dim{dim}_disk.yaml")
    columns = {"in RAM": (in_ram, ram_plan), "disk, fewest shards": fewest, "disk, cheapest": cheapest}
    print(
        f"\n== Criteo-1TB-shaped, dim {dim}, floor {floor:,.0f} samples/s, disk_ms_per_row {disk_ms_per_row:.4g}"
    )
    print(_side_by_side(columns))
    hold = disk_layout(dim, zipf).shards
    if hold < fewest[0].ps.table.shards_needed:  # type: ignore[union-attr]
        print(
            f"the fewest shards whose RAM and disk hold the table: {hold}; at this floor the PS rate takes more"
        )
    print("disk layouts planned (shards: RAM hit rate, plan's $/h, total $):")
    print("  " + "; ".join(f"{p.ps.table.shards_needed}: {p.ps.table.ram_hit_rate:.1%}, {plan.cost_rate:.2f}, "
                           f"{plan.cost:,.1f}{'' if plan.feasible else ' INFEASIBLE'}"
                           for p, plan in layouts if p.ps.table is not None))  # fmt: skip


def _plan(problem: Problem, path: Path) -> Plan:
    """Write `problem` to `path` and plan it as `heterps plan --problem PATH --scheduler exact` does."""
    problem.save(path)
    check_table_fits(problem, str(path))
    return get_scheduler("exact").schedule(problem)


def _side_by_side(columns: dict[str, tuple[Problem, Plan]]) -> str:
    rows: dict[str, list[str]] = {}
    for problem, plan in columns.values():
        table = problem.ps.table
        assert table is not None  # every variant has its table section
        ps_rate = plan.ps_shards * problem.resource(plan.ps_type).price_per_hour
        stages = ", ".join(f"{s.type} x{s.replicas}" for s in plan.stages)
        where = (
            f"{table.rows - table.disk_rows:,} RAM / {table.disk_rows:,} disk, {table.ram_hit_rate:.1%} hits"
            if table.disk_rows
            else f"all {table.rows:,} rows in RAM ({table.rows * table.bytes_per_row / GIB:,.0f} GiB)"
        )
        cells = {
            "feasible": "yes" if plan.feasible else "NO",
            "total cost ($, one epoch)": f"{plan.cost:,.1f}",
            "cost rate ($/h)": f"{plan.cost_rate:,.3f}",
            "PS shards (type)": f"{plan.ps_shards} ({plan.ps_type})",
            "PS instances ($/h)": f"{ps_rate:,.3f}",
            "where the table lives": where,
            "stages": stages,
            "throughput (samples/s)": f"{plan.throughput:,.0f}",
            "epoch (h)": f"{plan.samples / plan.throughput / 3600:,.1f}" if plan.throughput > 0 else "-",
            "exact (s)": f"{plan.seconds:.2f}",
        }
        for name, cell in cells.items():
            rows.setdefault(name, []).append(cell)
    width = max(len(name) for name in rows)
    cell_width = max(len(c) for cells in rows.values() for c in cells + list(columns))
    lines = [f"{'':<{width}}  " + "  ".join(f"{name:<{cell_width}}" for name in columns)]
    lines += [
        f"{name:<{width}}  " + "  ".join(f"{c:<{cell_width}}" for c in cells) for name, cells in rows.items()
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
