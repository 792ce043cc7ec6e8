"""The GPU-cloud problem suite (issue 40): generated problems over the GPU types users rent, each with its
price and memory from a public price page, a sparse table of 1M to 10B rows, and the table's place
priced by the cost model (DESIGN.md "Table tiers", costmodel/runtime_terms.table_rate).

A problem: two CPU node types (``cpu``, memory-optimised, runs CPU layers and the PS shards; ``cpu_c``,
compute-optimised, in the pool) and GPU kinds drawn from T4, L4, A10G, V100, A100 40 GB, A100 80 GB,
H100, H200; a chain of 20..120 layers (embedding layers of one table first, then dense, interaction and
attention layers, a head) whose times follow each kind's dense and memory-bound speed-ups; one table of
log-uniform 1e6..1e10 rows at dim 16, 32, 64 or 128 (``ps.table``: its rows, bytes per row, each type's
host budget, the shards it needs on ``cpu``, and per GPU kind the rows its memory holds and the share
of lookups it serves); a runtime section (async, 4 micro-batches, the GPU tier's per-row costs); a
floor from 5% to 100% of a throughput some plan reaches, or (one in ten) above every plan's.

Where the prices come from (``Kind.source``): AWS on-demand, us-east-1, Linux, per GPU (the 8-GPU
instances' price over 8) or per CPU node. Each says whether the figure was read from a page stored for
this project (named) or is the price page's figure as known to the author, not re-read on 2026-12-04
(marked "as known"). GPU memory: NVIDIA's data sheets (GiB the device has; the marketed "141 GB" of
the H200 taken as 141). Host memory: the instance's memory over its GPUs.

How the table's per-row costs are set (``tier_terms``), from the one GPU measurement (BENCHMARKS.md
"The GPU tier", ../shared/gpu/h200-2026-12-04): on the H200 at dim 16 heterps trained a batch of 2048
in 6.4 ms with the rows in GPU memory and 9.0 ms with them on a CPU shard hosted by the DataWorker
(53,248 rows a batch), 11.7 ms at 8192 (212,992 rows): ~3e-5 ms per row of GPU tier, ~8e-5 ms per
hosted CPU row; the profile's actor wait was 3.7e-4 ms per row. Half of the tier's row is taken as host
work (the key's lookup in the CPU index), half as device work: a per-row overhead of random access that
scales inversely with the device's memory bandwidth (at ~10 GB/s effective on the H200 the row's bytes
are not what costs), plus the row's bytes read and written at half the peak bandwidth; a miss pays a
hosted row and its bytes over PCIe, both ways. The PS rows (actor wait, hosted) are taken half per row,
half per byte, scaled from dim 16. These are assumptions of a plausible order, not measurements of each
kind.

Example::

    problem = generate_gpu_cloud_problem(7, num_layers=(20, 120), num_types=(3, 8))
    problem.ps.table.gpu_rows            # rows each GPU kind of the problem holds: {"l4": ..., "h200": ...}
    same = generate_problem(7, num_layers=(20, 120), num_types=(3, 8), catalogue="gpu_cloud")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from heterps_ray.config import ACTOR_RESERVE_GB, DRIVER_GB, OBJECT_STORE_GB
from heterps_ray.costmodel import Problem
from heterps_ray.costmodel.hit_rates import lru_hit_rate
from heterps_ray.costmodel.table_memory import GIB, shards_needed
from heterps_ray.ps.row_bytes import device_row_bytes, device_rows_within, stored_bytes_per_row
from heterps_ray.scheduling.generator import CPU_PER_SAMPLE_MS, chain_of_layers, layer_entry, with_drawn_floor

OPTIMIZER = "adagrad"  # the sparse rows' optimizer (ps/shard.py's default)
DIMS = (16, 32, 64, 128)
TABLE_ROWS = (1e6, 1e10)  # log-uniform
# A GPU's memory for table rows: the device less a reserve for the stage's own tensors, as the GPU tier
# takes it (ps/device_table.py, DEVICE_RESERVE_SHARE of free memory, at least 1 GiB; not imported: that
# module pulls in torch) after the CUDA context (~0.5 GiB on these cards).
GPU_RESERVE_SHARE = 0.2
CUDA_CONTEXT_GIB = 0.5
ZIPF_EXPONENT = (0.8, 1.2)  # key popularity of CTR ids (a Zipf law, rank^-s; Criteo's slots lie about here)
HIT_RATE_KEYS = (
    50_000  # keys of the scaled-down table a cache's hit rate is computed over (Che's approximation)
)

# The GPU tier's per-row costs at dim 16 on the H200 (module docstring): host part, device part, and the
# hosted CPU row and the actor wait (the profile's ps_wait_ms_per_row, ../shared/gpu/h200-2026-12-04).
TIER_HOST_MS_PER_ROW = 1.5e-5
TIER_DEVICE_MS_PER_ROW_H200 = 1.5e-5
H200_BANDWIDTH_GBS = 4800.0
HOSTED_MS_PER_ROW = 8e-5
PS_WAIT_MS_PER_ROW = 3.7e-4
BYTES_PER_MS_PER_GBS = 1e6  # 1 GB/s = 1e6 bytes/ms


@dataclass(frozen=True)
class Kind:
    """One resource type users rent: its price and memory (and the page they come from), and how fast it
    runs a CPU node's layers."""

    name: str
    device: str  # "cpu" or "cuda"
    instance: str  # the instance (per GPU: its share of it)
    price_per_hour: float  # $ per instance-hour (per GPU of a multi-GPU instance)
    host_memory_gib: float  # the instance's memory per GPU (per node for a CPU type)
    gpu_memory_gib: float  # 0 for a CPU type
    memory_bandwidth_gbs: float  # device memory, GB/s (NVIDIA data sheet); 0 for a CPU type
    pcie_gbs: float  # host <-> device, GB/s one way (PCIe gen3 x16 ~12, gen4 ~25, gen5 ~50); 0 for a CPU type
    dense_speedup: float  # dense layers' time per sample over a `cpu` node's (rough, as generator.py)
    memory_speedup: float  # memory-bound (embedding) layers' the same
    source: str


_AWS = "AWS EC2 on-demand price page, us-east-1, Linux"
CATALOGUE: tuple[Kind, ...] = (
    Kind("cpu", "cpu", "r5.2xlarge (8 vCPU, 64 GiB)", 0.504, 64.0, 0.0, 0.0, 0.0, 1.0, 1.0,
         f"{_AWS}: r5.2xlarge $0.504/h, as known (not re-read 2026-12-04)"),
    Kind("cpu_c", "cpu", "c5.4xlarge (16 vCPU, 32 GiB)", 0.68, 32.0, 0.0, 0.0, 0.0, 2.0, 1.4,
         f"{_AWS}: c5.4xlarge $0.68/h, read 2026-12-04 from the AWS docs' example table "
         "(docs.amazonaws.cn autoscaling/ec2/userguide/weights-spot-price-per-unit-hour-example: 'example "
         "pricing'), as configs/clusters/cloud_gpu.yaml's c5.2xlarge $0.34"),
    Kind("t4", "cuda", "g4dn.4xlarge (1 x T4 16 GB, 64 GiB)", 1.204, 64.0, 16.0, 320.0, 12.0, 12.0, 1.5,
         f"{_AWS}: g4dn.4xlarge $1.204/h, as known (not re-read); g4dn.xlarge $0.526 in cloud_gpu.yaml"),
    Kind("l4", "cuda", "g6.4xlarge (1 x L4 24 GB, 64 GiB)", 1.3232, 64.0, 24.0, 300.0, 25.0, 20.0, 2.0,
         f"{_AWS}: g6.4xlarge $1.3232/h, as known (not re-read)"),
    Kind("a10g", "cuda", "g5.4xlarge (1 x A10G 24 GB, 64 GiB)", 1.624, 64.0, 24.0, 600.0, 25.0, 24.0, 2.0,
         f"{_AWS}: g5.4xlarge $1.624/h, as known (not re-read); g5.xlarge $1.006 read 2026-12-04 on "
         "factualminds.com/blog/amazon-ec2-on-demand-pricing-instance-families-2026 (June 2026)"),
    Kind("v100", "cuda", "p3.2xlarge (1 x V100 16 GB, 61 GiB)", 3.06, 61.0, 16.0, 900.0, 12.0, 35.0, 2.5,
         f"{_AWS}: p3.2xlarge $3.06/h, as configs/clusters/cloud_gpu.yaml (read 2026-11)"),
    Kind("a100_40", "cuda", "p4d.24xlarge / 8 (A100 40 GB, 144 GiB)", 4.10, 144.0, 40.0, 1555.0, 25.0, 70.0, 4.0,
         f"{_AWS}: p4d.24xlarge $32.77/h / 8, as configs/clusters/cloud_gpu.yaml (read 2026-11)"),
    Kind("a100_80", "cuda", "p4de.24xlarge / 8 (A100 80 GB, 144 GiB)", 5.12, 144.0, 80.0, 2039.0, 25.0, 75.0, 4.5,
         f"{_AWS}: p4de.24xlarge $40.97/h / 8, as known (not re-read)"),
    Kind("h100", "cuda", "p5.48xlarge / 8 (H100 80 GB, 256 GiB)", 12.29, 256.0, 80.0, 3350.0, 50.0, 120.0, 6.0,
         f"{_AWS}: p5.48xlarge $98.32/h / 8, read 2026-12-04 on computespec.pages.dev/learn/pricing/"
         "cloud-gpu-pricing-explained and disintermediate.global/insights/gpu-cloud-pricing-models (Q1 2026)"),
    Kind("h200", "cuda", "p5e.48xlarge / 8 (H200 141 GB, 256 GiB)", 13.52, 256.0, 141.0, 4800.0, 50.0, 140.0, 7.0,
         "derived, not a listed price: the H100's on-demand $12.29 x 5.408 / 4.916, the H200 (p5e) over the "
         "H100 (p5) effective accelerator-hour rate on AWS's EC2 Capacity Blocks price page (US East, "
         "rates to 2025-01-01), read 2026-12-04 from a stored copy of aws.amazon.com/ec2/capacityblocks/pricing"),
)  # fmt: skip
KINDS = {kind.name: kind for kind in CATALOGUE}
GPU_KINDS = tuple(k.name for k in CATALOGUE if k.device == "cuda")
PS_KIND = "cpu"


def generate_gpu_cloud_problem(
    rng: np.random.Generator | int,
    num_layers: tuple[int, int] = (20, 120),
    num_types: tuple[int, int] = (3, 8),
    name: str | None = None,
    floor_fraction: tuple[float, float] = (0.05, 1.0),
    infeasible_share: float = 0.1,
    kinds: Sequence[str] | None = None,
    table_rows: int | None = None,
    dim: int | None = None,
) -> Problem:
    """One GPU-cloud problem (module docstring); `num_layers` / `num_types` are inclusive ranges (>= 1
    layer, 3..10 types: `cpu`, and `cpu_c` or GPU kinds). Deterministic per seed. `kinds` (`cpu` and
    catalogue names), `table_rows` and `dim` replace what the seed draws, the rest of its draws unchanged
    (tests pin the table's place with them)."""
    if not isinstance(rng, np.random.Generator):
        seed = int(rng)
        rng = np.random.default_rng(seed)
        name = name or f"gpu-cloud-{seed}"
    L = int(rng.integers(num_layers[0], num_layers[1] + 1))
    T = int(rng.integers(num_types[0], num_types[1] + 1))
    if L < 1 or not 3 <= T <= len(CATALOGUE):
        raise ValueError(f"num_layers >= 1 and 3 <= num_types <= {len(CATALOGUE)} (got {L}, {T})")
    others = [k.name for k in CATALOGUE if k.name != PS_KIND]
    chosen = [others[i] for i in sorted(rng.choice(len(others), size=T - 1, replace=False))]  # >= 1 GPU
    if kinds is not None:
        chosen = _checked_kinds(kinds)
    types = [KINDS[PS_KIND]] + [KINDS[c] for c in chosen]
    batch_size = int(rng.choice([512, 1024, 2048, 4096]))
    drawn_dim = int(rng.choice(DIMS))
    dim = drawn_dim if dim is None else int(dim)
    rows = int(round(math.exp(rng.uniform(math.log(TABLE_ROWS[0]), math.log(TABLE_ROWS[1])))))
    rows = rows if table_rows is None else int(table_rows)
    samples = float(rng.choice([1e8, 1e9, 1e10]))
    zipf = float(rng.uniform(*ZIPF_EXPONENT))

    layers = chain_of_layers(rng, L, max(3, L // 10), lambda li, kind: _layer(rng, li, kind, types, dim))
    lookups = samples * sum(layer["sparse_rows_per_sample"] for layer in layers)
    table = table_section(rows, dim, types, lookups, zipf)
    resources = [_resource(rng, kind, table["shards_needed"]) for kind in types]
    data: dict[str, Any] = {
        "name": name or "gpu-cloud",
        "batch_size": batch_size,
        "samples": samples,
        "throughput_min": 0.0,
        "input_bytes_per_sample": float(rng.integers(100, 400)),
        "resources": resources,
        "ps": {
            "resource": PS_KIND,
            "rows_per_second_per_shard": float(rng.uniform(1e6, 5e6)),
            "min_shards": 1,
            "table": table,
        },
        "layers": layers,
        "runtime": runtime_section(types, dim, hosted_fits(table, layers[0])),
        "notes": f"gpu_cloud suite: {rows:,} rows x dim {dim}, Zipf s={zipf:.2f} (heterps_ray/scheduling/gpu_cloud.py)",
    }
    return with_drawn_floor(rng, data, floor_fraction, infeasible_share)


def _checked_kinds(kinds: Sequence[str]) -> list[str]:
    """`kinds` as the generator's types after `cpu`: catalogue names, `cpu` first, at least one GPU."""
    names = list(kinds)
    if (
        not names
        or names[0] != PS_KIND
        or len(set(names)) != len(names)
        or any(n not in KINDS for n in names)
    ):
        raise ValueError(f"kinds: {PS_KIND!r} first, then distinct names of {sorted(KINDS)} (got {names})")
    if not any(KINDS[n].device == "cuda" for n in names):
        raise ValueError(f"kinds: at least one GPU kind of {list(GPU_KINDS)} (got {names})")
    return names[1:]


def _resource(rng: np.random.Generator, kind: Kind, shards: int) -> dict[str, Any]:
    """A resource entry of `kind`: its catalogue price, a limit (the PS type's holds the table's shards),
    and a cloud network (25..100 Gbit/s on GPU instances, 10..25 on CPU nodes)."""
    gpu = kind.device == "cuda"
    limit = int(rng.choice([2, 4, 8, 16] if gpu else [16, 32, 64]))
    if kind.name == PS_KIND:
        limit += shards  # the table's shards and CPU stages beside them
    return {
        "name": kind.name,
        "device": kind.device,
        "price_per_hour": kind.price_per_hour,
        "max_instances": limit,
        "bandwidth_gbps": float(rng.choice([25, 50, 100] if gpu else [10, 25])),
        "io_bandwidth_gbps": float(rng.choice([4, 8, 16])),
        "latency_ms": round(float(rng.uniform(0.05, 0.3)), 3),
    }


def _layer(rng: np.random.Generator, index: int, kind: str, kinds: list[Kind], dim: int) -> dict[str, Any]:
    """One layer's entry: an embedding layer of `dim` (memory bound: each kind's memory speed-up), else a
    dense, interaction, attention (may not run on CPU nodes) or head layer (each kind's dense speed-up)."""

    def jitter(x: float, spread: float) -> float:
        return float(x * rng.uniform(1.0 - spread, 1.0 + spread))

    if kind == "embedding":
        slots = int(rng.integers(8, 40))
        cpu = (rng.uniform(0.1, 0.5), rng.uniform(0.002, 0.01) * dim / 16)  # fixed ms, ms per sample
        times = {}
        for k in kinds:
            fixed = cpu[0] if k.device == "cpu" else rng.uniform(0.5, 2.0)
            times[k.name] = (fixed, cpu[1] / jitter(k.memory_speedup, 0.2))
        return layer_entry(f"emb{index}", slots * dim * 4, slots, rng.uniform(0.9, 0.99), times)
    cpu = (rng.uniform(0.05, 0.3), rng.uniform(*CPU_PER_SAMPLE_MS[kind]))
    gpu_only = kind == "attention" and rng.random() < 0.3
    times = {}
    for k in kinds:
        if k.device == "cpu" and gpu_only:
            continue
        fixed = cpu[0] / k.dense_speedup**0.25 if k.device == "cpu" else rng.uniform(0.1, 0.6)
        times[k.name] = (fixed, cpu[1] / jitter(k.dense_speedup, 0.3))
    out_bytes = 4 * int(rng.choice([1, 16, 32, 64, 128, 256, 512, 1024])) if kind != "head" else 4
    return layer_entry(f"{kind}{index}", out_bytes, 0, rng.uniform(0.9, 0.999), times)


# -- the table ------------------------------------------------------------------------------------


def host_budget_gib(kind: Kind) -> float:
    """GiB of table rows one actor of `kind` holds in host memory: its node's (its GPU's share of the
    instance's) memory less the object store, the driver and the actor's own, as config.table_memory_gb."""
    return max(0.0, kind.host_memory_gib - OBJECT_STORE_GB - DRIVER_GB - ACTOR_RESERVE_GB)


def gpu_budget_gib(kind: Kind) -> float:
    """GiB of `kind`'s GPU memory for table rows: after the CUDA context, less the stage's reserve."""
    free = kind.gpu_memory_gib - CUDA_CONTEXT_GIB
    return max(0.0, free - max(GPU_RESERVE_SHARE * free, 1.0))


def gpu_rows(kind: Kind, dim: int) -> int:
    """Rows `kind`'s GPU memory holds for a table of `dim` (the GPU tier's own count, ps/row_bytes.py)."""
    return device_rows_within(gpu_budget_gib(kind) * GIB, dim, OPTIMIZER)


def hit_rate(capacity: int, rows: int, lookups: float, zipf: float) -> float:
    """The share of `lookups` a GPU memory of `capacity` rows serves for a table of `rows`: where all
    fit, all but each row's first lookup; else an LRU cache under a Zipf key popularity of exponent
    `zipf` (hit_rates.lru_hit_rate over HIT_RATE_KEYS keys, the capacity and the lookups scaled to the
    share of the table they stand for; every key of the table seen at least once)."""
    if lookups <= 0:
        return 1.0
    if capacity >= rows:
        return max(1.0 - rows / lookups, 0.0)
    n = min(rows, HIT_RATE_KEYS)
    p = np.arange(1, n + 1, dtype=np.float64) ** -zipf
    counts = np.maximum(p / p.sum() * lookups * n / rows, 1.0)
    return lru_hit_rate(counts, capacity * n / rows)


def table_section(rows: int, dim: int, kinds: list[Kind], lookups: float, zipf: float) -> dict[str, Any]:
    """``ps.table`` of a table of `rows` at `dim` (untracked rows, Adagrad) on these kinds: bytes per
    row, each kind's host budget, the shards it needs on the PS kind, and per GPU kind the rows its memory
    holds and the share of the run's `lookups` it serves."""
    per_row = stored_bytes_per_row(dim, OPTIMIZER, False)
    budgets = {k.name: round(host_budget_gib(k), 3) for k in kinds}
    held = {k.name: gpu_rows(k, dim) for k in kinds if k.device == "cuda"}
    return {
        "rows": rows,
        "bytes_per_row": round(per_row, 2),
        "budget_gb": budgets,
        "shards_needed": shards_needed(rows * per_row, budgets[PS_KIND] * GIB),
        "gpu_rows": held,
        "gpu_hit_rate": {name: round(hit_rate(n, rows, lookups, zipf), 6) for name, n in held.items()},
    }


def hosted_fits(table: dict[str, Any], first_layer: dict[str, Any]) -> bool:
    """Whether every type that can run the first layer holds the whole table in its host budget, as
    shards hosted in its DataWorker need (table_memory.with_table's rule for ``ps_hosting``)."""
    need = table["rows"] * table["bytes_per_row"]
    return all(need <= table["budget_gb"][t] * GIB for t in first_layer["time_ms"])


def tier_terms(kind: Kind, dim: int) -> tuple[float, float]:
    """(gpu_table_ms_per_row, gpu_miss_ms_per_row) of `kind` at `dim` (module docstring): the tier's
    host part, its per-row device overhead scaled by the H200's memory bandwidth over the kind's, and the
    row's bytes read and written at half the kind's bandwidth; a miss a hosted row (at `dim`) plus the
    row's bytes over PCIe both ways."""
    row = device_row_bytes(dim, OPTIMIZER)
    overhead = TIER_DEVICE_MS_PER_ROW_H200 * H200_BANDWIDTH_GBS / kind.memory_bandwidth_gbs
    device = overhead + 2.0 * row / (0.5 * kind.memory_bandwidth_gbs * BYTES_PER_MS_PER_GBS)
    miss = HOSTED_MS_PER_ROW * row_scale(dim) + 2.0 * row / (kind.pcie_gbs * BYTES_PER_MS_PER_GBS)
    return TIER_HOST_MS_PER_ROW + device, miss


def row_scale(dim: int) -> float:
    """A PS row's cost at `dim` over its cost at dim 16 (the measured one): half per row, half per byte."""
    return 0.5 + 0.5 * dim / 16


def runtime_section(kinds: list[Kind], dim: int, hosted: bool) -> dict[str, Any]:
    """The runtime terms (DESIGN.md §3b) as a profile of this cluster would give them: async, 4
    micro-batches, a call 2 ms on CPU types and 1 ms on GPUs (as generator.with_runtime_section), the
    PS costs per row (half of them per row, half the row's bytes: scaled from dim 16), and each GPU
    kind's tier; shards hosted where every first-layer type holds the table, else actors."""
    scale = row_scale(dim)
    gpus = [k for k in kinds if k.device == "cuda"]
    tiers = {k.name: tier_terms(k, dim) for k in gpus}
    return {
        "mode": "async",
        "micro_batches": 4,
        "batches_ahead": 0,
        "ps_hosting": "auto" if hosted else "actors",
        "call_ms": {k.name: 1.0 if k.device == "cuda" else 2.0 for k in kinds},
        "ps_wait_ms_per_row": round(PS_WAIT_MS_PER_ROW * scale, 8),
        "ps_hosted_ms_per_row": round(HOSTED_MS_PER_ROW * scale, 8),
        "gpu_table": "auto",
        "gpu_table_ms_per_row": {name: round(t[0], 8) for name, t in tiers.items()},
        "gpu_miss_ms_per_row": {name: round(t[1], 8) for name, t in tiers.items()},
    }
