"""Least-squares fits from raw profile measurements to the DESIGN.md §3 coefficients.

Repeats are averaged (means, not medians): a pipeline's throughput is work over total time, so the
mean time is what predicts it, and on a shared machine the slow tail (preemption) is real work the
runtime pays too.

The profiler (or anything else) hands in a long-format measurement table (:data:`COLUMNS`); this
module fits, per (layer, type), ``ms = fixed + per_sample · B``; per type, ``ms = latency +
bytes / bandwidth``; the PS service rate; and the parallel fraction from 1- vs 2-replica runs.
It returns a problem file as a plain mapping (DESIGN.md §4) and a quality table in which every
poor fit (R² < 0.9, a negative coefficient, a clipped parallel fraction) is flagged.

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

R2_POOR = 0.9  # below this a fit is flagged as poor (issue 5)
_BYTES_PER_MS_PER_GBPS = 125_000.0  # 1 Gbit/s = 1e9 / 8 bytes/s = 125,000 bytes/ms (DESIGN.md §3)


@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope · x`` by least squares, with its quality."""

    intercept: float
    slope: float
    r2: float
    residuals: tuple[float, ...]  # y - fitted, at each x (same order as the input points)
    x: tuple[float, ...]
    y: tuple[float, ...]

    @property
    def max_rel_residual(self) -> float:
        """Largest |residual| / y over the points: how far off the line the worst point is."""
        y = np.asarray(self.y)
        return float(np.max(np.abs(self.residuals) / np.maximum(np.abs(y), 1e-12))) if len(y) else 0.0

    @property
    def negative(self) -> bool:
        return self.intercept < 0 or self.slope < 0


def fit_line(x: Sequence[float], y: Sequence[float]) -> LinearFit:
    """Ordinary least squares of y on x; R² is 1 - SS_res / SS_tot (1.0 when y is constant and fit)."""
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    if len(xs) < 2 or len(np.unique(xs)) < 2:
        raise DataError(f"a line needs at least two distinct x values (got {xs.tolist()})")
    design = np.stack([np.ones_like(xs), xs], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design, ys, rcond=None)
    fitted = intercept + slope * xs
    residuals = ys - fitted
    ss_res = float(np.sum(residuals**2))
    ss_tot = float(np.sum((ys - ys.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res < 1e-18 else 0.0)
    return LinearFit(
        float(intercept), float(slope), r2, tuple(residuals.tolist()), tuple(xs.tolist()), tuple(ys.tolist())
    )


def clamp_non_negative(fit: LinearFit) -> tuple[float, float]:
    """Coefficients usable in a problem file: a negative one is set to 0 and the other refitted
    (the fit stays flagged; this only keeps the cost model physical)."""
    if not fit.negative:
        return fit.intercept, fit.slope
    x, y = np.asarray(fit.x), np.asarray(fit.y)
    slope_through_origin = float(np.dot(x, y) / np.dot(x, x))
    if fit.intercept < 0 and slope_through_origin >= 0:
        return 0.0, slope_through_origin
    return max(float(np.mean(y)), 0.0), 0.0


def parallel_fraction(speedup: float) -> float:
    """Amdahl's parallel fraction from the speedup of 2 replicas over 1, clipped to [0, 1]:
    ``s = 1 / ((1-α) + α/2)``  ⇒  ``α = (1 - 1/s) / (1 - 1/2)``."""
    if speedup <= 0:
        return 0.0
    return float(min(max((1.0 - 1.0 / speedup) / 0.5, 0.0), 1.0))


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
            time_ms[rtype.name] = {"fixed": _round(fixed), "per_sample": _round(per_sample)}
            alpha, speedup = _alpha(measurements, layer.name, rtype.name)
            if alpha is not None:
                alphas.append((alpha, fixed + per_sample * batch_size))
            row = _quality_row("layer", layer.name, rtype.name, fit, fixed, per_sample, "sample")
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
            "parallel_fraction": _round(alpha_value),
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
            row = _quality_row("transfer", "", rtype.name, fit, lat, ms_per_byte, "byte")
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
            rows.append(_quality_row("call", "", rtype.name, fit, call_overhead, per_byte, "byte"))
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
                "bandwidth_gbps": _round(bandwidth),
                "io_bandwidth_gbps": _round(io),
                "latency_ms": _round(latency),
                "device": rtype.device,
                "threads": int(rtype.torch_threads),
                **({"call_overhead_ms": _round(call_overhead)} if call_overhead is not None else {}),
                **({"fused_saving_ms": _round(fused_saving)} if fused_saving is not None else {}),
            }
        )

    ps_name = ps_resource or cluster.ps_resource
    if ps_name not in [t.name for t in types]:
        ps_name = types[0].name
    ps: dict[str, Any] = {"resource": ps_name, "min_shards": int(cluster.ps.min_shards)}
    runtime: dict[str, Any] = {}  # the simulator's measured details of the runtime section
    sel = measurements[measurements["kind"] == "ps"]
    if not sel.empty:
        ps["pull_share"] = _round(float((sel["forward_ms"] / sel["ms"]).median()))
        if sel["client_ms"].notna().all():
            ps["push_client_share"] = _round(float((sel["client_ms"] / sel["backward_ms"]).median()))
        rates = sel["rows"] * sel["calls"] / (sel["ms"] / 1000.0)
        rate = float((sel["rows"] * sel["calls"]).sum() / (sel["ms"].sum() / 1000.0))
        ps["rows_per_second_per_shard"] = _round(rate)
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
        runtime["startup_ms"] = _round(float(extra.median()))
    sel = measurements[measurements["kind"] == "ps_dense"]
    if not sel.empty:
        ps["dense_ms_per_param"] = _round(float(sel["ms"].sum() / (sel["calls"] * sel["rows"]).sum()))
    sel = measurements[
        (measurements["kind"] == "layer") & (measurements["batch_size"] == _nearest(measurements, batch_size))
    ]
    if not sel.empty and sel["ms"].sum() > 0:
        runtime["forward_fraction"] = _round(float(sel["forward_ms"].sum() / sel["ms"].sum()))

    for row in rows:
        if row.get("flags"):
            flags.append(
                f"{row['what']} {row['layer'] or ''} on {row['resource']}: {row['flags']}".replace("  ", " ")
            )
    hosts = _shared_hosts(measurements)
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
        problem["runtime"] = {**_runtime_terms(problem, measurements, execution, rows), **runtime}
    quality = pd.DataFrame(rows)
    return FitResult(problem=problem, quality=quality, measurements=measurements, flags=flags)


_PROBE_SCALE = (0.25, 4.0)  # a runtime/profile time ratio outside this is a broken measurement: clipped


def _runtime_terms(
    problem: dict[str, Any],
    measurements: pd.DataFrame,
    execution: dict[str, Any],
    quality: list[dict[str, Any]],
) -> dict[str, Any]:
    """The problem's `runtime` section (DESIGN.md §3b): the job's execution, the PS wait per row, and
    what the runtime probes (probes.py) measured:

    * a one-stage probe on each type calibrates that type's layer times to the runtime (a single
      actor's timing leaves out what the runtime's DataWorker adds, and a burst of load during the
      profile skews it; the probe runs the real loop): they are scaled, and the type's fused saving
      with them, so that the plan takes the probe's ms per batch (the hosted PS's work included), the
      factor kept in the fit table;
    * then each two-stage probe gives its callee type's `call_ms`: what one call a batch took beyond
      what the calibrated layers, bytes and input explain.

    Changes `problem`'s layer times in place."""
    from heterps_ray.costmodel import CostModel, problem_from_dict

    terms: dict[str, Any] = {**execution}
    sel = measurements[measurements["kind"] == "ps"]
    if not sel.empty:  # a DataWorker waits for its pull, and its next pull queues behind its push
        terms["ps_wait_ms_per_row"] = _round(float(sel["ms"].sum() / (sel["rows"] * sel["calls"]).sum()))
    for kind, term in (("gpu_table", "gpu_table_ms_per_row"), ("gpu_miss", "gpu_miss_ms_per_row")):
        sel = measurements[(measurements["kind"] == kind) & (measurements["rows"] > 0)]
        if not sel.empty:  # the GPU tier of each cuda type (rows in its memory), per row
            per_type = sel.groupby("resource")[["ms", "rows"]].sum()
            terms[term] = {name: _round(float(r["ms"] / r["rows"])) for name, r in per_type.iterrows()}
    probes = measurements[measurements["kind"] == "probe"]
    if probes.empty:
        return terms
    # each one-stage probe's spread over its runs (the profile's own): half its range over its median
    alone = probes[probes["peer"] == ""].groupby("resource", sort=False)["ms"]
    spread = ((alone.max() - alone.min()) / (2.0 * alone.median())).to_dict()
    terms["spread"] = {name: _round(float(s)) for name, s in spread.items() if alone.size()[name] > 1}
    # each probe's median over its runs (and over several profiles taken together)
    probes = probes.assign(fetched=probes["rows"] / probes["calls"].clip(lower=1))  # a GPU tier's, per batch
    probes = probes.groupby(["resource", "peer", "layer"], as_index=False, sort=False)[
        ["ms", "fetched"]
    ].median()
    layer_names = [layer["name"] for layer in problem["layers"]]
    fitted: dict[str, Any] = {"mode": "sync", "ps_wait_ms_per_row": terms.get("ps_wait_ms_per_row", 0.0),
              "call_ms": {r["name"]: 0.0 for r in problem["resources"]},
              **{k: terms[k] for k in ("gpu_table", "gpu_table_ms_per_row", "gpu_miss_ms_per_row") if k in terms}}  # fmt: skip

    def explained_ms(row: Any) -> tuple[float, float]:
        """(the probe plan's loop ms, of it the layers' compute) under the terms fitted so far, with the
        cold misses of its GPU tier (the rows it fetched, met for the first time: a long run's are priced by
        its hit rate)."""
        split = layer_names.index(row["layer"]) + 1
        caller = row["peer"] or row["resource"]
        assignment = [caller] * split + [row["resource"]] * (len(layer_names) - split)
        model = CostModel(problem_from_dict({**problem, "runtime": fitted}))
        stages = model.split_stages(assignment)
        limits = model.evaluate(assignment, [1] * len(stages), 1).runtime
        assert limits is not None
        compute = sum(float(model.compute_ms[start:end, t].sum()) for start, end, t in stages)
        cold = 0.0
        if limits.table.place != "ps":
            cold = float(row["fetched"]) * fitted.get("gpu_miss_ms_per_row", {}).get(caller, 0.0)
        return limits.loop_ms + cold, compute

    for _, row in probes[probes["peer"] == ""].iterrows():
        explained, compute = explained_ms(row)
        scale = (row["ms"] - (explained - compute)) / compute if compute > 0 else 1.0
        scale = min(max(scale, _PROBE_SCALE[0]), _PROBE_SCALE[1])
        for layer in problem["layers"]:
            coeffs = layer["time_ms"].get(row["resource"])
            if coeffs is not None:
                coeffs.update(
                    fixed=_round(coeffs["fixed"] * scale), per_sample=_round(coeffs["per_sample"] * scale)
                )
        for resource in problem["resources"]:  # a share of the layers' fixed times: it scales with them
            if resource["name"] == row["resource"] and "fused_saving_ms" in resource:
                resource["fused_saving_ms"] = _round(resource["fused_saving_ms"] * scale)
        flag = (
            ""
            if _PROBE_SCALE[0] < scale < _PROBE_SCALE[1]
            else f"runtime/profile time ratio clipped to {scale:g}"
        )
        quality.append({"what": "probe", "layer": row["layer"], "resource": row["resource"], "fixed_ms": row["ms"],
                        "slope_ms": explained, "layer_scale": scale, "flags": flag})  # fmt: skip
    for _, row in probes[probes["peer"] != ""].iterrows():
        explained, _ = explained_ms(row)
        fitted["call_ms"][row["resource"]] = max(row["ms"] - explained, 0.0)
        quality.append({"what": "probe", "layer": row["layer"], "resource": f"{row['peer']}->{row['resource']}",
                        "fixed_ms": row["ms"], "slope_ms": explained, "flags": ""})  # fmt: skip
    measured = set(probes.loc[probes["peer"] != "", "resource"])
    terms["call_ms"] = {name: _round(ms) for name, ms in fitted["call_ms"].items() if name in measured}
    return terms


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


def _shared_hosts(measurements: pd.DataFrame) -> list[dict[str, Any]]:
    """Machines (Ray nodes) on which the actors of two or more types ran: their cores are shared.
    A type alone on its nodes is left out (a real cluster: each instance has its own cores)."""
    sel = measurements[measurements["kind"] == "host"]
    hosts: list[dict[str, Any]] = []
    for node, group in sel.groupby("peer", sort=True):
        types = list(dict.fromkeys(group["resource"]))
        if len(types) < 2:
            continue
        cores = float(group["rows"].min())
        # the least any window saw: load that comes and goes during a profile is not the background
        background = float((group["client_ms"] / group["ms"]).min())
        host = {
            "name": f"node{len(hosts)}",
            "cores": cores,
            "types": types,
            "background_cores": _round(min(background, 0.9 * cores)),
        }
        calls = measurements[(measurements["kind"] == "call_cpu") & (measurements["peer"] == node)]
        calls = calls[calls["client_ms"].notna()]
        if not calls.empty:  # the raylet's CPU per call
            daemons = calls["client_ms"].sum() / calls["calls"].sum()
            host["call_cpu_ms"] = _round(float(daemons))
        hosts.append(host)
    return hosts


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


def _quality_row(
    what: str, layer: str, resource: str, fit: LinearFit, a: float, b: float, unit: str
) -> dict[str, Any]:
    problems = []
    if fit.r2 < R2_POOR:
        problems.append(f"R² {fit.r2:.3f} < {R2_POOR}")
    if fit.negative:
        problems.append(
            f"negative coefficient ({fit.intercept:.4g}, {fit.slope:.4g}) clamped to ({a:.4g}, {b:.4g})"
        )
    return {
        "what": what,
        "layer": layer,
        "resource": resource,
        "r2": fit.r2,
        "fixed_ms": a,
        "slope_ms": b,
        "slope_per": unit,
        "raw_intercept": fit.intercept,
        "raw_slope": fit.slope,
        "max_rel_residual": fit.max_rel_residual,
        "residuals_ms": " ".join(f"{r:+.4f}" for r in fit.residuals),
        "flags": "; ".join(problems),
    }


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _round(value: float) -> float:
    """Six significant digits keep the YAML readable without losing anything measurable."""
    return float(f"{value:.6g}")
