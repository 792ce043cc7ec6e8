"""Random realistic scheduling problems, for tests, benchmarks and training a policy across problems.

A CTR-like chain: sparse embedding layers first (many PS rows, memory bound: cheap on CPU nodes,
little faster on a GPU, and some GPU kinds cannot hold them), then dense, interaction and attention
layers (compute bound: tens of times faster on GPUs; attention may not run on CPU nodes), then a
small head. The cluster is a CPU node type plus GPU kinds from a T4..H100-like catalogue, with
jittered prices, limits and networks. The floor is a random fraction (5%..100%) of a throughput
some plan reaches; about one problem in ten gets a floor no plan reaches (infeasible).

`catalogue="wide"` draws production-sized clusters (up to 11 types): the six GPU kinds plus more
(A10G, L40S, H200) and a second CPU shape (`cpu_hi`, a compute-optimised node that holds big tables),
and models with more embedding layers (up to one in ten). The default "classic" catalogue and its
random stream are unchanged, so problems generated from the same seed stay the same.

`catalogue="gpu_cloud"` is the GPU-cloud suite (issue 40, scheduling/gpu_cloud.py): the GPU types users
rent at their public prices, a table of 1M..10B rows whose place the cost model prices, a runtime
section. It has its own random stream; the other catalogues' are unchanged.

Example::

    problem = generate_problem(7, num_layers=(3, 30), num_types=(2, 5))
    big = generate_problem(7, num_layers=(20, 120), num_types=(3, 8), catalogue="wide")
    true = with_runtime_section(big)   # the runtime terms as `heterps profile` writes them (§3b)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from heterps_ray.costmodel import Problem, problem_from_dict

# (name, $/hour, dense speed-up over a CPU node, memory-bound speed-up, can hold big tables)
# Prices are of the order of public on-demand prices (see configs/clusters/cloud_gpu.yaml).
_GPU_KINDS = (
    ("t4", 0.53, 12.0, 1.5, False),
    ("l4", 0.80, 20.0, 2.0, False),
    ("v100", 3.06, 35.0, 2.5, True),
    ("a10", 1.20, 25.0, 2.0, False),
    ("a100", 4.10, 70.0, 4.0, True),
    ("h100", 6.90, 120.0, 6.0, True),
)
# The wide catalogue's extra kinds (same fields); `cpu_hi` is a CPU node (device cpu) that runs
# every layer a CPU runs, ~2x faster on dense layers, at twice the price.
_WIDE_KINDS = (
    ("cpu_hi", 0.68, 2.2, 1.4, True),
    ("a10g", 1.01, 24.0, 2.0, False),
    ("l40s", 1.86, 45.0, 3.0, False),
    ("h200", 8.60, 140.0, 7.0, True),
)
_CPU_KINDS = ("cpu_hi",)
_CATALOGUES = {"classic": _GPU_KINDS, "wide": _GPU_KINDS + _WIDE_KINDS}


def generate_problem(
    rng: np.random.Generator | int,
    num_layers: tuple[int, int] = (3, 8),
    num_types: tuple[int, int] = (2, 3),
    name: str | None = None,
    floor_fraction: tuple[float, float] = (0.05, 1.0),
    infeasible_share: float = 0.1,
    catalogue: str = "classic",
) -> Problem:
    """One random problem; `num_layers` / `num_types` are inclusive ranges (any layers >= 1; 2..7
    types with the classic catalogue, 2..11 with the wide one, 3..10 with gpu_cloud).

    The floor is `floor_fraction` of a throughput some plan reaches, except for a share
    `infeasible_share` of problems whose floor is above every plan's throughput."""
    if catalogue == "gpu_cloud":
        from heterps_ray.scheduling.gpu_cloud import generate_gpu_cloud_problem

        return generate_gpu_cloud_problem(rng, num_layers, num_types, name, floor_fraction, infeasible_share)
    if catalogue not in _CATALOGUES:
        raise ValueError(f"catalogue must be one of {sorted(_CATALOGUES) + ['gpu_cloud']}, got {catalogue!r}")
    catalog = _CATALOGUES[catalogue]
    if not isinstance(rng, np.random.Generator):
        seed = int(rng)
        rng = np.random.default_rng(seed)
        name = name or f"generated-{seed}"
    L = int(rng.integers(num_layers[0], num_layers[1] + 1))
    T = int(rng.integers(num_types[0], num_types[1] + 1))
    if L < 1 or not 2 <= T <= len(catalog) + 1:
        raise ValueError(f"num_layers >= 1 and 2 <= num_types <= {len(catalog) + 1} (got {L}, {T})")
    batch_size = int(rng.choice([256, 512, 1024, 2048]))

    def jitter(x: float, spread: float = 0.25) -> float:
        return float(x * rng.uniform(1.0 - spread, 1.0 + spread))

    resources = [
        {
            "name": "cpu",
            "device": "cpu",
            "price_per_hour": round(jitter(0.34), 3),
            "max_instances": int(rng.choice([16, 32, 64])),
            "bandwidth_gbps": float(rng.choice([10, 25])),
            "io_bandwidth_gbps": float(rng.choice([4, 8])),
            "latency_ms": round(float(rng.uniform(0.1, 0.5)), 3),
        }
    ]
    kinds = [catalog[i] for i in sorted(rng.choice(len(catalog), size=T - 1, replace=False))]
    for kind, price, _, _, _ in kinds:
        is_cpu = kind in _CPU_KINDS
        resources.append(
            {
                "name": kind,
                "device": "cpu" if is_cpu else "cuda",
                "price_per_hour": round(jitter(price, 0.15), 3),
                "max_instances": int(rng.choice([8, 16, 32] if is_cpu else [2, 4, 8, 16])),
                "bandwidth_gbps": float(rng.choice([25, 50, 100])),
                "io_bandwidth_gbps": float(rng.choice([4, 8, 16])),
                "latency_ms": round(float(rng.uniform(0.05, 0.3)), 3),
            }
        )

    most_embedding = 3 if catalogue == "classic" else max(3, L // 10)
    layers = chain_of_layers(rng, L, most_embedding, lambda li, kind: _layer(rng, li, kind, kinds, jitter))
    data = {
        "name": name or "generated",
        "batch_size": batch_size,
        "samples": float(rng.choice([1e7, 1e8, 1e9])),
        "throughput_min": 0.0,
        "input_bytes_per_sample": float(rng.integers(100, 400)),
        "resources": resources,
        "ps": {
            "resource": "cpu",
            "rows_per_second_per_shard": float(rng.uniform(1e6, 5e6)),
            "min_shards": int(rng.integers(1, 5)),
        },
        "layers": layers,
    }
    return with_drawn_floor(rng, data, floor_fraction, infeasible_share)


def chain_of_layers(
    rng: np.random.Generator, num_layers: int, most_embedding: int, make: Callable[[int, str], dict]
) -> list[dict]:
    """A CTR-like chain of `num_layers` layer entries: 1..most_embedding embedding layers first, then fc,
    interaction and attention layers, a head last; `make(index, kind)` draws each entry."""
    L = num_layers
    num_embedding = int(rng.integers(1, max(1, min(most_embedding, L - 1)) + 1)) if L > 1 else 1
    layers = []
    for li in range(L):
        if li < num_embedding:
            kind = "embedding"
        elif li == L - 1 and L > num_embedding + 1:
            kind = "head"
        else:
            kind = str(rng.choice(["fc", "fc", "interaction", "attention"]))
        layers.append(make(li, kind))
    return layers


def with_drawn_floor(
    rng: np.random.Generator, data: dict, floor_fraction: tuple[float, float], infeasible_share: float
) -> Problem:
    """The problem of mapping `data` with a floor: `floor_fraction` of a throughput some plan reaches, or
    for a share `infeasible_share` above every plan's (exact.throughput_bounds: fast, no exact search)."""
    from heterps_ray.scheduling.exact import throughput_bounds

    lower, upper = throughput_bounds(problem_from_dict(data))
    if rng.random() < infeasible_share:
        floor = upper * rng.uniform(1.02, 1.3)  # above the upper bound: surely infeasible
    else:
        floor = lower * rng.uniform(*floor_fraction)  # below a reachable throughput: feasible
    data["throughput_min"] = float(round(floor, 1))
    return problem_from_dict(data)


# A CPU node's ms per sample of each kind of dense layer (a range the generators draw from).
CPU_PER_SAMPLE_MS = {
    "fc": (0.01, 0.08),
    "interaction": (0.005, 0.03),
    "attention": (0.05, 0.3),
    "head": (0.001, 0.005),
}


def _layer(rng: np.random.Generator, index: int, kind: str, kinds: list, jitter) -> dict:
    if kind == "embedding":
        slots = int(rng.integers(8, 40))
        dim = int(rng.choice([8, 16, 32]))
        cpu = (rng.uniform(0.1, 0.5), rng.uniform(0.002, 0.01))  # fixed ms, ms per sample
        times = {"cpu": cpu}
        for name, _, _, memory_speedup, big_tables in kinds:
            if name in _CPU_KINDS:  # a CPU node holds what a CPU holds
                times[name] = (cpu[0] / jitter(1.3), cpu[1] / jitter(memory_speedup, 0.2))
            elif big_tables or rng.random() < 0.4:
                times[name] = (rng.uniform(0.5, 2.0), cpu[1] / jitter(memory_speedup, 0.4))
        return layer_entry(f"emb{index}", slots * dim * 4, slots, rng.uniform(0.9, 0.99), times)
    cpu = (rng.uniform(0.05, 0.3), rng.uniform(*CPU_PER_SAMPLE_MS[kind]))
    times = {} if kind == "attention" and rng.random() < 0.3 else {"cpu": cpu}
    for name, _, dense_speedup, _, _ in kinds:
        if name in _CPU_KINDS:
            if "cpu" in times:  # GPU-only layers stay GPU-only
                times[name] = (cpu[0] / jitter(1.3), cpu[1] / jitter(dense_speedup, 0.2))
            continue
        times[name] = (rng.uniform(0.1, 0.6), cpu[1] / jitter(dense_speedup, 0.4))
    out_bytes = 4 * int(rng.choice([1, 16, 32, 64, 128, 256, 512, 1024])) if kind != "head" else 4
    return layer_entry(f"{kind}{index}", out_bytes, 0, rng.uniform(0.9, 0.999), times)


def layer_entry(name: str, out_bytes: int, rows: int, alpha: float, times: dict) -> dict:
    """A layer's problem-file entry; `times` maps each type to (fixed ms, ms per sample)."""
    return {
        "name": name,
        "out_bytes_per_sample": int(out_bytes),
        "sparse_rows_per_sample": int(rows),
        "parallel_fraction": round(float(alpha), 4),
        "time_ms": {
            t: {"fixed": round(float(f), 4), "per_sample": round(float(p), 6)} for t, (f, p) in times.items()
        },
    }


def with_runtime_section(
    problem: Problem,
    mode: str = "async",
    micro_batches: int = 4,
    ps_hosting: str = "actors",
    cpu_call_ms: float = 2.0,
    gpu_call_ms: float = 1.0,
    ps_wait_ms_per_row: float = 0.0,
    batches_ahead: int = 0,
) -> Problem:
    """`problem` with a `runtime` section (DESIGN.md §3b) as the profiler writes one for a production
    cluster: async, 4 micro-batches, PS shards as actors, a call's round trip 2 ms on CPU types and
    1 ms on GPUs (a type is a GPU when its `device` is cuda). The floor is kept."""
    data = problem.to_dict()
    data["runtime"] = {
        "mode": mode,
        "micro_batches": micro_batches,
        "batches_ahead": batches_ahead if mode == "async" else 0,
        "ps_hosting": ps_hosting,
        "call_ms": {
            r["name"]: gpu_call_ms if r.get("device") == "cuda" else cpu_call_ms for r in data["resources"]
        },
        "ps_wait_ms_per_row": ps_wait_ms_per_row,
    }
    return problem_from_dict(data)
