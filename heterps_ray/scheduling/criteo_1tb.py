"""A Criteo-1TB-shaped problem (issue 50, "Scale, simulated"): a table of ~880M rows, priced with every
row in PS RAM and with a disk tier on the PS type, for a cluster we do not have (DESIGN.md §4, "Table
memory"; docs/tables.md "The disk tier").

What is assumed, each a named constant below:

* The data: Criteo 1TB's 24 days, 4.4e9 training rows (one epoch, ``SAMPLES``) of 26 categorical slots,
  ~880M distinct keys over the slots (``TABLE_ROWS``), each key a row (no admission: ``admit_after: 1``).
  Key popularity: a Zipf law of exponent 0.9 over all keys (``ZIPF_EXPONENT``; `heterps data synth
  --shape criteo-kaggle` draws its slots' exponents in 0.8..0.95, and on 1M such rows the hottest 25% of
  rows served 0.904 of lookups, BENCHMARKS.md "Tables"; Zipf 0.9 gives ~0.87).
* The model: CTR-DNN (26 slots x ``dim`` + 13 dense, FC 512-256-128-32, a head) at dim 64; its times on
  an 8-vCPU node are configs/problems/ctr_dnn_cloud.yaml's (dim 9), the embedding's per-sample time scaled
  as a PS row (gpu_cloud.row_scale) and fc1's by its inputs; other nodes by their speed-ups.
* The nodes (AWS on-demand, us-east-1, as known, not re-read): ``cpu`` r5.2xlarge $0.504/h (64 GiB, no
  local disk) and ``cpu_c`` c5.4xlarge $0.68/h from gpu_cloud.py's catalogue; ``cpu_nvme`` i3.2xlarge
  $0.624/h (8 vCPU, 61 GiB, one 1,900 GB NVMe, of which ``NVME_DISK_GB`` for the table's files).
* The PS: a shard serves 2e6 rows/s at dim 16 (ctr_dnn_cloud.yaml's 8-vCPU shard), scaled by
  gpu_cloud.row_scale; the runtime terms are gpu_cloud.runtime_section's (async, 4 micro-batches, the
  actor wait per row), and a row RAM misses costs ``DISK_MS_PER_ROW`` more: the disk store's cold rate
  measured on THIS machine's virtio disk (91k rows/s with reads in flight, BENCHMARKS.md "Tables"), not an
  NVMe's.

The two variants differ in the PS type and where the table lives, nothing else (same resources, floor,
layers): ``in_ram``, on ``cpu`` with as many shards as its RAM needs (table_memory.shards_needed, via
gpu_cloud.table_section); ``on_disk``, on ``cpu_nvme`` with the fewest shards whose RAM (hot rows) and
disk (the rest) hold it, laid out as table_disk.DiskPlan lays out a job's table (:func:`disk_layout`),
the share of lookups RAM serves an LRU cache's under the Zipf popularity (gpu_cloud.hit_rate).

Example::

    on_disk = criteo_1tb_problem(dim=64, disk=True)
    on_disk.ps.table.shards_needed, on_disk.ps.table.ram_hit_rate
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from heterps_ray.costmodel import Plan, Problem, problem_from_dict
from heterps_ray.costmodel.table_disk import DiskPlan
from heterps_ray.costmodel.table_disk import disk_layout as disk_layout_of
from heterps_ray.costmodel.table_memory import GIB
from heterps_ray.errors import ConfigError
from heterps_ray.ps.row_bytes import stored_bytes_per_row
from heterps_ray.scheduling.generator import layer_entry
from heterps_ray.scheduling.gpu_cloud import (
    KINDS,
    OPTIMIZER,
    Kind,
    hit_rate,
    host_budget_gib,
    hosted_fits,
    row_scale,
    runtime_section,
    table_section,
)

SAMPLES = 4.4e9  # Criteo 1TB's training rows (24 days), one epoch
TABLE_ROWS = 880_000_000  # distinct keys over the 26 slots, each a row (admit_after: 1)
SLOTS = 26  # sparse rows per sample
DENSE_FEATURES = 13
DIM = 64
ZIPF_EXPONENT = 0.9  # key popularity, rank^-s (module docstring)
BATCH_SIZE = 2048
FLOOR = 100_000.0  # samples/s: an epoch in ~12 h
MAX_INSTANCES = 64  # of each type
# A row the PS shards' RAM misses, read from disk: 1 / 91k rows/s, the disk store's cold rate with reads in
# flight on this machine's virtio disk (BENCHMARKS.md "Tables", 2026-12-07), not an NVMe.
DISK_MS_PER_ROW = 1000.0 / 91_000
PS_ROWS_PER_S_DIM16 = 2.0e6  # one 8-vCPU shard (configs/problems/ctr_dnn_cloud.yaml), at dim 16

RAM_KIND = KINDS["cpu"]  # r5.2xlarge: the all-RAM PS type
NVME_KIND = Kind(
    "cpu_nvme", "cpu", "i3.2xlarge (8 vCPU, 61 GiB, 1 x 1,900 GB NVMe)", 0.624, 61.0, 0.0, 0.0, 0.0, 1.0, 1.0,
    "AWS EC2 on-demand price page, us-east-1, Linux: i3.2xlarge $0.624/h, as known (not re-read 2026-12-07)",
)  # fmt: skip
NVME_DISK_GB = 1_700.0  # GiB of the NVMe's 1,769 (1,900 GB) for the table's files: room for the filesystem
NVME_DISK_DIR = "/mnt/nvme/heterps"
KIND_ORDER = (RAM_KIND, NVME_KIND, KINDS["cpu_c"])

# CTR-DNN's layers on an 8-vCPU node at dim 9 (configs/problems/ctr_dnn_cloud.yaml, its `cpu` times):
# (name, out_bytes_per_sample or None for the embedding's, parallel_fraction, fixed ms, ms per sample)
_CTR_DNN_DIM = 9
_CTR_DNN_LAYERS = (
    ("embedding", None, 0.95, 0.10, 0.0040),
    ("fc1", 2048, 0.98, 0.10, 0.0152),  # 247 x 512 weights at dim 9
    ("fc2", 1024, 0.98, 0.10, 0.0157),
    ("fc3", 512, 0.98, 0.10, 0.0039),
    ("fc4", 128, 0.98, 0.10, 0.0005),
    ("head", 4, 0.95, 0.05, 0.00005),
)


def criteo_1tb_problem(
    dim: int = DIM,
    disk: bool = False,
    floor: float = FLOOR,
    zipf: float = ZIPF_EXPONENT,
    disk_ms_per_row: float = DISK_MS_PER_ROW,
    ps_shards: int | None = None,
) -> Problem:
    """The Criteo-1TB-shaped problem at embedding `dim` and throughput `floor` (samples/s): the table
    all in ``cpu``'s RAM, or (`disk`) on ``cpu_nvme`` with a disk tier, laid out over `ps_shards` shards
    (default: the fewest that hold it; more shards keep more hot rows, for a plan that needs them for its
    PS rate). A ConfigError names the argument out of range."""
    _check(dim, floor, zipf, disk_ms_per_row, ps_shards)
    lookups = SAMPLES * SLOTS
    table = table_section(TABLE_ROWS, dim, list(KIND_ORDER), lookups, zipf)  # keyed by the kinds' names
    ps_kind = RAM_KIND
    if disk:
        ps_kind = NVME_KIND
        layout = disk_layout(dim, zipf, ps_shards)
        table["shards_needed"] = layout.shards
        table.update(layout.section())
    # no GPU types: the GPU tier's fields stay out
    table = {k: v for k, v in table.items() if k not in ("gpu_rows", "gpu_hit_rate")}
    layers = _layers(dim)
    runtime = runtime_section(list(KIND_ORDER), dim, hosted_fits(table, layers[0]))
    runtime["disk_ms_per_row"] = disk_ms_per_row
    where = f"on {NVME_KIND.name}'s disk" if disk else f"in {RAM_KIND.name}'s RAM"
    data: dict[str, Any] = {
        "name": f"criteo-1tb dim {dim}, table {where}",
        "batch_size": BATCH_SIZE,
        "samples": SAMPLES,
        "throughput_min": float(floor),
        "input_bytes_per_sample": 4 * (1 + DENSE_FEATURES + SLOTS),  # label, dense, hashed ids
        "resources": [_resource(kind) for kind in KIND_ORDER],
        "ps": {
            "resource": ps_kind.name,
            "rows_per_second_per_shard": PS_ROWS_PER_S_DIM16 / row_scale(dim),
            "min_shards": 1,
            "table": table,
        },
        "layers": layers,
        "runtime": runtime,
        "notes": (
            f"Criteo-1TB-shaped (heterps_ray/scheduling/criteo_1tb.py): {TABLE_ROWS:,} rows x dim {dim}, "
            f"{SAMPLES:.3g} samples, Zipf s={zipf:g}, disk_ms_per_row {disk_ms_per_row:.4g} (this machine's "
            "virtio disk)"
        ),
    }
    return problem_from_dict(data, f"criteo_1tb_problem(dim={dim}, disk={disk})")


def disk_layout(dim: int = DIM, zipf: float = ZIPF_EXPONENT, shards: int | None = None) -> DiskPlan:
    """The table on ``cpu_nvme``, laid out as table_disk lays out a job's table without admission, over
    `shards` (default: the fewest that hold it, at most MAX_INSTANCES), and the share of lookups their
    hot rows serve (gpu_cloud.hit_rate, an LRU cache under the Zipf popularity; a job's comes from its
    data's keys, which a simulated table has not). A ConfigError where MAX_INSTANCES shards cannot hold it."""
    budget = host_budget_gib(NVME_KIND) * GIB
    plan = disk_layout_of(TABLE_ROWS, budget, dim, OPTIMIZER, 1, NVME_DISK_GB, NVME_DISK_DIR)
    fewest = plan.shards
    if fewest > MAX_INSTANCES:
        raise ConfigError(
            "disk_layout", "dim", f"a table {MAX_INSTANCES} shards hold: {plan.shortfall(MAX_INSTANCES)}", dim
        )
    count = fewest if shards is None else max(shards, fewest)
    split = plan.split(count)
    hot = hit_rate(count * split.hot_rows, TABLE_ROWS, SAMPLES * SLOTS, zipf) if split.disk_rows else 1.0
    return replace(plan, shards=count, hit_rate=hot)


def plan_disk_layouts(
    dim: int = DIM,
    floor: float = FLOOR,
    zipf: float = ZIPF_EXPONENT,
    disk_ms_per_row: float = DISK_MS_PER_ROW,
) -> list[tuple[Problem, Plan]]:
    """Exact's plan of the table on disk laid out over each shard count from the fewest that hold it to
    the first whose RAM holds every row: more shards, more hot rows, fewer lookups paying
    `disk_ms_per_row`. The problem prices one layout (its ``ram_hit_rate``), so a plan whose PS rate
    takes more shards than its layout has is left out: the layout at its count is planned in its turn."""
    from heterps_ray.scheduling import get_scheduler  # `heterps plan --scheduler exact`'s

    scheduler = get_scheduler("exact")
    planned = []
    for shards in range(disk_layout(dim, zipf).shards, MAX_INSTANCES + 1):
        problem = criteo_1tb_problem(dim, True, floor, zipf, disk_ms_per_row, shards)
        plan = scheduler.schedule(problem)
        if plan.ps_shards == shards:
            planned.append((problem, plan))
        if problem.ps.table is None or not problem.ps.table.disk_rows:
            break
    return planned


def ram_shards(dim: int = DIM) -> int:
    """The shards ``cpu``'s RAM needs for the table: its bytes over one actor's table budget."""
    per_row = stored_bytes_per_row(dim, OPTIMIZER, False)
    return math.ceil(TABLE_ROWS * per_row / (host_budget_gib(RAM_KIND) * GIB))


def _check(dim: int, floor: float, zipf: float, disk_ms_per_row: float, ps_shards: int | None) -> None:
    where = "criteo_1tb_problem"
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ConfigError(where, "dim", "an embedding dim >= 1", dim)
    if not math.isfinite(floor) or floor < 0:
        raise ConfigError(where, "floor", "a throughput floor >= 0 samples/s", floor)
    if not math.isfinite(zipf) or zipf <= 0:
        raise ConfigError(where, "zipf", "a Zipf exponent > 0", zipf)
    if not math.isfinite(disk_ms_per_row) or disk_ms_per_row < 0:
        raise ConfigError(where, "disk_ms_per_row", "ms >= 0 per row read from disk", disk_ms_per_row)
    if ps_shards is not None and not 1 <= ps_shards <= MAX_INSTANCES:
        raise ConfigError(where, "ps_shards", f"1..{MAX_INSTANCES} shards", ps_shards)


def _resource(kind: Kind) -> dict[str, Any]:
    """A CPU node type: its price, 64 instances, "up to 10 Gbit/s" of network (these instances' rating)."""
    return {
        "name": kind.name,
        "device": kind.device,
        "price_per_hour": kind.price_per_hour,
        "max_instances": MAX_INSTANCES,
        "bandwidth_gbps": 10.0,
        "io_bandwidth_gbps": 4.0,
        "latency_ms": 0.2,
    }


def _layers(dim: int) -> list[dict[str, Any]]:
    """CTR-DNN's layers at `dim` on each kind (module docstring): the embedding's per-sample time scaled
    as a PS row, fc1's by its inputs; a kind's times over its memory (embedding) or dense speed-up."""
    width = SLOTS * dim + DENSE_FEATURES
    layers = []
    for name, fixed_out_bytes, alpha, fixed, per_sample in _CTR_DNN_LAYERS:
        out_bytes, rows = fixed_out_bytes or 4 * width, 0  # the embedding's: its slots' rows and the dense
        if name == "embedding":
            rows = SLOTS
            per_sample *= row_scale(dim) / row_scale(_CTR_DNN_DIM)
        if name == "fc1":
            per_sample *= width / (SLOTS * _CTR_DNN_DIM + DENSE_FEATURES)
        times = {}
        for kind in KIND_ORDER:
            speedup = kind.memory_speedup if name == "embedding" else kind.dense_speedup
            times[kind.name] = (fixed, per_sample / speedup)
        layers.append(layer_entry(name, out_bytes, rows, alpha, times))
    return layers
