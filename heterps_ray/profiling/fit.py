"""Least-squares fits from raw profile measurements to the DESIGN.md §3 coefficients.

Repeats are averaged (means, not medians): a pipeline's throughput is work over total time, so the
mean time is what predicts it, and on a shared machine the slow tail (preemption) is real work the
runtime pays too.

The profiler (or anything else) hands in a long-format measurement table (:data:`COLUMNS`); this
module fits, per (layer, type), ``ms = fixed + per_sample · B``; per type, ``ms = latency +
bytes / bandwidth``; the PS service rate; and the parallel fraction from 1- vs 2-replica runs.
It returns a problem file as a plain mapping (DESIGN.md §4) and a quality table in which every
poor fit (R² < 0.9, a negative coefficient, a clipped parallel fraction) is flagged. The line fits
themselves are fit_lines.py's, the problem's `runtime` section fit_runtime.py's.

Example::

    result = fit_problem(measurements, cluster=job.cluster, layers=layer_infos, batch_size=512,
                         samples=10**8, throughput_min=1000.0, name="ctr_dnn on local")
    write_problem(result, "problem.yaml")   # + problem.measurements.parquet, problem.fit.csv
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from heterps_ray.config import ClusterConfig
from heterps_ray.errors import DataError
from heterps_ray.profiling.fit_lines import (
    R2_POOR,
    clamp_non_negative,
    fit_line,
    parallel_fraction,
    quality_row,
    round6,
)
from heterps_ray.profiling.fit_runtime import runtime_terms, shared_hosts
from heterps_ray.ps.atomic import write_bytes_atomic

# Long-format measurement table: one row per timed repeat.
#   kind      "layer" (one layer fwd+bwd on one actor), "layer_pair" (`calls` calls in `ms` on one of
#             `replicas` actors running the layer at once), "transfer" (one actor-to-actor message),
#             "ps" (`calls` pull+push requests of `rows` rows each, in `ms`), "ps_dense" (`calls` dense
#             pushes of `rows` parameters), "input" (reading `rows` rows of data, in `ms`), "host" (the
#             machine of a type's actor: Ray node id in `peer`, its cores in `rows`, and the CPU ms
#             other processes used there, `client_ms`, in a window of `ms` while the profile idled),
#             "call_cpu" (`calls` small actor calls in `ms`, while the node's raylet used `client_ms`
#             of CPU: Ray's own work per call), "call" (`calls` calls carrying `nbytes` and returning
#             as much, 4 in flight, received by an actor of `resource` in `ms`: its own work per call),
#             "stage" (the whole model fwd+bwd as one module with one optimizer step, as "layer"),
#             "probe" (a runtime probe, probes.py: its plan's steady ms per batch in `ms`; its GPU
#             tier's rows fetched from the shards over its `calls` steady batches in `rows`),
#             "probe_disturbed" (a one-stage probe run taken again: other work ran beside it; not fitted),
#             "gpu_table" (the GPU tier of a cuda type: `rows` key rows of batches it held, in `ms`),
#             "gpu_miss" (`rows` rows it fetched from a shard and wrote back, in `ms`)
#   forward_ms / backward_ms   layer: forward / backward + optimizer step; ps: pull / push
#   client_ms  ps: the push's work in the client (de-duplicating keys, summing gradients);
#              input: opening the dataset on a worker (imports on its first call: a one-time cost);
#              probe: the CPU ms other processes used on the driver's machine while it ran (NaN where
#              the cluster's processes are not the driver's own)
#   resource  the resource type measured (the sender, for transfers); peer: the receiver type
COLUMNS = (
    "kind",
    "resource",
    "peer",
    "layer",
    "batch_size",
    "nbytes",
    "rows",
    "replicas",
    "calls",
    "repeat",
    "forward_ms",
    "backward_ms",
    "ms",
    "client_ms",
)

_BYTES_PER_MS_PER_GBPS = 125_000.0  # 1 Gbit/s = 1e9 / 8 bytes/s = 125,000 bytes/ms (DESIGN.md §3)


@dataclass(frozen=True)
class LayerInfo:
    """What the problem file needs about a layer besides its times (from the model's LayerSpec)."""

    name: str
    out_bytes_per_sample: int
    sparse_rows_per_sample: int
    parallel_fraction: float  # the model's prior, used where no 2-replica run was possible
    dense_params: int = 0  # torch parameters (async mode pushes their gradients to the PS)


@dataclass
class FitResult:
    """A fitted problem file (DESIGN.md §4 mapping), the fit-quality table and the raw measurements."""

    problem: dict[str, Any]
    quality: pd.DataFrame
    measurements: pd.DataFrame
    flags: list[str] = field(default_factory=list)
    # what the profile could not measure on this cluster, and why (profiler.ProfileRun.unmeasured)
    unmeasured: list[str] = field(default_factory=list)
    # wall time of the profile's parts (profiler.py: "layers", "probes", then "fit"), for the run's time line
    seconds: dict[str, float] = field(default_factory=dict)


def fit_problem(
    measurements: pd.DataFrame,
    *,
    cluster: ClusterConfig,
    layers: Sequence[LayerInfo],
    batch_size: int,
    samples: int,
    throughput_min: float,
    name: str,
    input_bytes_per_sample: int = 0,
    ps_resource: str | None = None,
    execution: dict[str, Any] | None = None,
) -> FitResult:
    """Fit every coefficient of a problem file from `measurements` (columns :data:`COLUMNS`).

    Resource types come from `cluster` (price, max_instances, io bandwidth) for those that have
    layer measurements; bandwidth and latency are replaced by the transfer fits where measured.
    `execution` (the job's mode, micro_batches, max_in_flight, batches_ahead, ps_hosting) adds the
    problem's `runtime` section (DESIGN.md §3b), its terms fitted from the PS and probe rows.
    """
    missing = [c for c in COLUMNS if c not in measurements.columns]
    if missing:
        raise DataError(f"profile measurements lack columns {missing} (expected {list(COLUMNS)})")
    rows: list[dict[str, Any]] = []
    flags: list[str] = []
    types = [t for t in cluster.resource_types if (measurements["resource"] == t.name).any()]
    if not types:
        raise DataError("profile measurements name none of the cluster's resource types")

    layer_entries = []
    for layer in layers:
        time_ms: dict[str, dict[str, float]] = {}
        alphas = []
        for rtype in types:
            sel = measurements[
                (measurements["kind"] == "layer")
                & (measurements["layer"] == layer.name)
                & (measurements["resource"] == rtype.name)
            ]
            if sel.empty:
                continue
            # the median of the repeats: a burst of load on a shared machine hits some rounds, not all
            means = sel.groupby("batch_size")["ms"].median()
            fit = fit_line(means.index.to_numpy(dtype=float), means.to_numpy())
            fixed, per_sample = clamp_non_negative(fit)
            time_ms[rtype.name] = {"fixed": round6(fixed), "per_sample": round6(per_sample)}
            alpha, speedup = _alpha(measurements, layer.name, rtype.name)
            if alpha is not None:
                alphas.append((alpha, fixed + per_sample * batch_size))
            row = quality_row("layer", layer.name, rtype.name, fit, fixed, per_sample, "sample")
            row["speedup_2x"] = speedup
            row["parallel_fraction"] = alpha
            if speedup is not None and not 1.0 <= speedup <= 2.0:
                row["flags"] = _join(row["flags"], f"2-replica speedup {speedup:.2f} outside [1, 2]: clipped")
            rows.append(row)
        if not time_ms:
            raise DataError(f"no layer measurements for layer {layer.name!r}")
        # Weighted by the layer's time on each type, as the stage α is weighted in DESIGN.md §3.
        if alphas:
            weights = np.array([w for _, w in alphas])
            alpha_value = float(np.average([a for a, _ in alphas], weights=np.maximum(weights, 1e-9)))
        else:
            alpha_value = layer.parallel_fraction
        entry: dict[str, Any] = {
            "name": layer.name,
            "out_bytes_per_sample": int(layer.out_bytes_per_sample),
            "sparse_rows_per_sample": int(layer.sparse_rows_per_sample),
            "parallel_fraction": round6(alpha_value),
            "dense_params": int(layer.dense_params),
            "time_ms": time_ms,
        }
        layer_entries.append(entry)

    resources = []
    for rtype in types:
        bandwidth, latency = rtype.bandwidth_gbps, rtype.latency_ms
        sel = measurements[(measurements["kind"] == "transfer") & (measurements["resource"] == rtype.name)]
        if not sel.empty:
            means = sel.groupby("nbytes")["ms"].mean()
            fit = fit_line(means.index.to_numpy(dtype=float), means.to_numpy())
            lat, ms_per_byte = clamp_non_negative(fit)
            if fit.intercept <= 0.0:
                # Messages above Ray's inline size go through the object store: time grows faster than
                # the bytes past it, and a line through the sizes can cross zero. A message costs at
                # least what the smallest one took beyond its bytes' share: that is the latency.
                smallest = float(means.index[0])
                lat = max(float(means.iloc[0]) - ms_per_byte * smallest, 0.0)
            # The intercept is a whole message (both ends); DESIGN.md §3 charges latency on each side.
            latency = lat / 2.0
            if ms_per_byte > 0:
                bandwidth = 1.0 / ms_per_byte / _BYTES_PER_MS_PER_GBPS
            row = quality_row("transfer", "", rtype.name, fit, lat, ms_per_byte, "byte")
            row["bandwidth_gbps"] = bandwidth
            rows.append(row)
        fused_saving = _fused_saving(measurements, rtype.name, layers, layer_entries)
        if fused_saving is not None:
            rows.append({"what": "stage", "layer": "", "resource": rtype.name, "fixed_ms": fused_saving,
                         "flags": ""})  # fmt: skip
        call_overhead = None
        sel = measurements[(measurements["kind"] == "call") & (measurements["resource"] == rtype.name)]
        if not sel.empty:
            # The per-byte part is the bandwidth's (above); what a call costs the receiving actor at
            # any size is the intercept.
            per_call = (sel["ms"] / sel["calls"]).groupby(sel["nbytes"]).mean()
            fit = fit_line(per_call.index.to_numpy(dtype=float), per_call.to_numpy())
            call_overhead, per_byte = clamp_non_negative(fit)
            rows.append(quality_row("call", "", rtype.name, fit, call_overhead, per_byte, "byte"))
        io = float(rtype.io_bandwidth_gbps or rtype.bandwidth_gbps)
        sel = measurements[(measurements["kind"] == "input") & (measurements["resource"] == rtype.name)]
        if len(sel) > 1:
            sel = sel[sel["repeat"] > sel["repeat"].min()]  # the first, cold read is start-up (below)
        if not sel.empty and input_bytes_per_sample > 0:
            # Reading includes parsing and hashing: the rate at which batches come out, in Gbit/s.
            bytes_per_ms = sel["rows"] * input_bytes_per_sample / sel["ms"]
            io = (
                float((sel["rows"] * input_bytes_per_sample).sum() / sel["ms"].sum()) / _BYTES_PER_MS_PER_GBPS
            )
            spread = float(bytes_per_ms.std() / bytes_per_ms.mean()) if len(sel) > 1 else 0.0
            rows.append(
                {
                    "what": "input",
                    "layer": "",
                    "resource": rtype.name,
                    "io_bandwidth_gbps": io,
                    "max_rel_residual": spread,
                    "flags": f"read-rate spread {spread:.0%} over repeats" if spread > 0.25 else "",
                }
            )
        resources.append(
            {
                "name": rtype.name,
                "price_per_hour": float(rtype.price_per_hour),
                "max_instances": int(rtype.max_instances),
                "bandwidth_gbps": round6(bandwidth),
                "io_bandwidth_gbps": round6(io),
                "latency_ms": round6(latency),
                "device": rtype.device,
                "threads": int(rtype.torch_threads),
                **({"call_overhead_ms": round6(call_overhead)} if call_overhead is not None else {}),
                **({"fused_saving_ms": round6(fused_saving)} if fused_saving is not None else {}),
            }
        )

    ps_name = ps_resource or cluster.ps_resource
    if ps_name not in [t.name for t in types]:
        ps_name = types[0].name
    ps: dict[str, Any] = {"resource": ps_name, "min_shards": int(cluster.ps.min_shards)}
    runtime: dict[str, Any] = {}  # the simulator's measured details of the runtime section
    sel = measurements[measurements["kind"] == "ps"]
    if not sel.empty:
        ps["pull_share"] = round6(float((sel["forward_ms"] / sel["ms"]).median()))
        if sel["client_ms"].notna().all():
            ps["push_client_share"] = round6(float((sel["client_ms"] / sel["backward_ms"]).median()))
        rates = sel["rows"] * sel["calls"] / (sel["ms"] / 1000.0)
        rate = float((sel["rows"] * sel["calls"]).sum() / (sel["ms"].sum() / 1000.0))
        ps["rows_per_second_per_shard"] = round6(rate)
        spread = float(rates.std() / rate) if len(rates) > 1 else 0.0
        rows.append(
            {
                "what": "ps",
                "layer": "",
                "resource": ps_name,
                "r2": None,
                "fixed_ms": None,
                "slope_ms": None,
                "rows_per_second": rate,
                "max_rel_residual": spread,
                "flags": f"rate spread {spread:.0%} over repeats" if spread > 0.25 else "",
            }
        )

    sel = measurements[(measurements["kind"] == "input") & measurements["client_ms"].notna()]
    if sel["repeat"].nunique() > 1:
        # A worker's first read pays imports and a cold first chunk; the runtime's DataWorkers pay
        # that once each too: the extra time of the first read over a warm one.
        first = sel[sel["repeat"] == sel["repeat"].min()].set_index("resource")
        warm = sel[sel["repeat"] > sel["repeat"].min()].groupby("resource")["ms"].mean()
        extra = first["client_ms"] + (first["ms"] - warm).clip(lower=0.0)
        runtime["startup_ms"] = round6(float(extra.median()))
    sel = measurements[measurements["kind"] == "ps_dense"]
    if not sel.empty:
        ps["dense_ms_per_param"] = round6(float(sel["ms"].sum() / (sel["calls"] * sel["rows"]).sum()))
    sel = measurements[
        (measurements["kind"] == "layer") & (measurements["batch_size"] == _nearest(measurements, batch_size))
    ]
    if not sel.empty and sel["ms"].sum() > 0:
        runtime["forward_fraction"] = round6(float(sel["forward_ms"].sum() / sel["ms"].sum()))

    for row in rows:
        if row.get("flags"):
            flags.append(
                f"{row['what']} {row['layer'] or ''} on {row['resource']}: {row['flags']}".replace("  ", " ")
            )
    hosts = shared_hosts(measurements)
    for host in hosts:
        rows.append(
            {"what": "host", "layer": "", "resource": "+".join(host["types"]), "cores": host["cores"],
             "background_cores": host["background_cores"], "flags": ""}
        )  # fmt: skip
    problem: dict[str, Any] = {
        "name": name,
        "batch_size": int(batch_size),
        "samples": int(samples),
        "throughput_min": float(throughput_min),
        "input_bytes_per_sample": int(input_bytes_per_sample),
        "resources": resources,
        "ps": ps,
        "layers": layer_entries,
    }
    if hosts:
        problem["hosts"] = hosts
    if execution is not None:
        problem["runtime"] = {**runtime_terms(problem, measurements, execution, rows), **runtime}
    quality = pd.DataFrame(rows)
    return FitResult(problem=problem, quality=quality, measurements=measurements, flags=flags)


def write_problem(result: FitResult, path: str | Path, header: str = "") -> dict[str, Path]:
    """Write the problem YAML (fit flags as a comment on top), the raw measurements as Parquet
    and the quality table as CSV beside it; returns the paths written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {line}" for line in header.splitlines()]
    if result.flags:
        lines.append(f"# POOR FITS ({len(result.flags)}), see {path.stem}.fit.csv:")
        lines += [f"#   {flag}" for flag in result.flags]
    else:
        lines.append(f"# every fit has R² >= {R2_POOR} and non-negative coefficients ({path.stem}.fit.csv)")
    text = "\n".join(lines) + "\n" + yaml.safe_dump(result.problem, sort_keys=False, width=110)
    raw = path.with_name(f"{path.stem}.measurements.parquet")
    quality = path.with_name(f"{path.stem}.fit.csv")
    buffer = io.BytesIO()
    result.measurements.to_parquet(buffer, index=False)
    write_bytes_atomic(raw, buffer.getvalue())
    write_bytes_atomic(quality, result.quality.to_csv(index=False).encode())
    write_bytes_atomic(path, text.encode())  # last: a problem file names a complete profile
    return {"problem": path, "measurements": raw, "quality": quality}


def _fused_saving(
    measurements: pd.DataFrame, resource: str, layers: Sequence[LayerInfo], fitted: list[dict[str, Any]]
) -> float | None:
    """ms each layer after a stage's first saves by running in one module with the others (one
    autograd pass, one optimizer step) instead of alone: (sum of the layers alone - the whole model)
    / (layers - 1), averaged over batch sizes; at most the layers' mean fitted fixed time."""
    whole = measurements[(measurements["kind"] == "stage") & (measurements["resource"] == resource)]
    alone = measurements[(measurements["kind"] == "layer") & (measurements["resource"] == resource)]
    if whole.empty or len(layers) < 2:
        return None
    summed = alone.groupby(["batch_size", "layer"])["ms"].median().groupby("batch_size").sum()
    saving = (summed - whole.groupby("batch_size")["ms"].median()).dropna() / (len(layers) - 1)
    if saving.empty:
        return None
    fixed = [e["time_ms"][resource]["fixed"] for e in fitted if resource in e["time_ms"]]
    return float(min(max(saving.mean(), 0.0), float(np.mean(fixed))))


def _nearest(measurements: pd.DataFrame, batch_size: int) -> int:
    sizes = measurements.loc[measurements["kind"] == "layer", "batch_size"].unique()
    if len(sizes) == 0:
        return batch_size
    return int(sizes[np.argmin(np.abs(sizes - batch_size))])


def _alpha(measurements: pd.DataFrame, layer: str, resource: str) -> tuple[float | None, float | None]:
    """Parallel fraction from the call rates of 1 actor and of 2 concurrent actors running the layer."""
    sel = measurements[
        (measurements["kind"] == "layer_pair")
        & (measurements["layer"] == layer)
        & (measurements["resource"] == resource)
    ]
    if sel.empty or not {1, 2} <= set(sel["replicas"]):
        return None, None
    # Calls per ms of all actors of one run together, averaged over repeats.
    rates = (sel["calls"] / sel["ms"]).groupby([sel["replicas"], sel["repeat"]]).sum()
    speedup = float(rates.loc[2].mean() / rates.loc[1].mean())
    return parallel_fraction(speedup), speedup


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


