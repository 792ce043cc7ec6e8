"""The least-squares fits turn measurements into DESIGN.md §3 coefficients, and flag poor fits."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from heterps_ray.config import ClusterConfig
from heterps_ray.costmodel import CostModel, load_problem, problem_from_dict
from heterps_ray.errors import DataError
from heterps_ray.profiling.fit import (
    COLUMNS,
    LayerInfo,
    fit_line,
    fit_problem,
    parallel_fraction,
    write_problem,
)

CLUSTER = ClusterConfig.model_validate(
    {
        "name": "two",
        "resource_types": [
            {"name": "small", "price_per_hour": 0.1, "max_instances": 4, "io_bandwidth_gbps": 3.0},
            {"name": "big", "price_per_hour": 0.3, "max_instances": 2},
        ],
        "ps": {"resource": "small", "min_shards": 1},
    }
)
LAYERS = [
    LayerInfo("embedding", 988, 26, 0.9, 0),
    LayerInfo("fc1", 2048, 0, 0.99, 126976),
    LayerInfo("logit", 4, 0, 0.9, 33),
]
# Known truth per (layer, type): fixed ms, per-sample ms, parallel fraction.
TRUTH = {
    ("embedding", "small"): (0.3, 0.002, 0.8),
    ("embedding", "big"): (0.5, 0.001, 0.6),
    ("fc1", "small"): (1.0, 0.040, 0.9),
    ("fc1", "big"): (2.0, 0.015, 0.5),
    ("logit", "small"): (0.2, 0.0005, 1.0),
    ("logit", "big"): (0.25, 0.0004, 0.3),
}
LATENCY = {"small": 2.0, "big": 1.5}  # ms per message, both ends
BANDWIDTH = {"small": 8.0, "big": 20.0}  # Gbit/s
BATCH_SIZES = (64, 128, 256, 512, 1024)


def _row(**fields: object) -> dict[str, object]:
    row: dict[str, object] = {c: 0 for c in COLUMNS}
    row.update(
        {"peer": "", "layer": "", "forward_ms": np.nan, "backward_ms": np.nan, "replicas": 1, "calls": 1}
    )
    row.update(fields)
    return row


def _measurements(noise: float, seed: int = 0) -> pd.DataFrame:
    """Synthetic profile: the truth above with multiplicative noise `noise` on every timing."""
    rng = np.random.default_rng(seed)
    rows = []
    for (layer, rtype), (fixed, per_sample, alpha) in TRUTH.items():
        for b in BATCH_SIZES:
            for rep in range(5):
                ms = (fixed + per_sample * b) * (1 + noise * rng.standard_normal())
                rows.append(_row(kind="layer", resource=rtype, layer=layer, batch_size=b, repeat=rep,
                                 forward_ms=ms / 3, backward_ms=2 * ms / 3, ms=ms))  # fmt: skip
        speedup = 1.0 / ((1 - alpha) + alpha / 2)
        for rep in range(3):
            rows.append(_row(kind="layer_pair", resource=rtype, layer=layer, batch_size=512, replicas=1,
                             calls=40, repeat=rep, ms=60.0))  # fmt: skip
            for _ in range(2):  # each of the two actors reaches speedup / 2 of the solo rate
                rows.append(_row(kind="layer_pair", resource=rtype, layer=layer, batch_size=512, replicas=2,
                                 calls=40, repeat=rep, ms=60.0 * 2 / speedup))  # fmt: skip
    for rtype in ("small", "big"):
        for nbytes in (4096, 65536, 1 << 20, 4 << 20):
            for rep in range(5):
                ms = (LATENCY[rtype] + nbytes / (BANDWIDTH[rtype] * 125_000)) * (
                    1 + noise * rng.standard_normal()
                )
                rows.append(
                    _row(kind="transfer", resource=rtype, peer="big", nbytes=nbytes, repeat=rep, ms=ms)
                )
        for rep in range(3):
            # 264 bytes per sample read at 0.1 Gbit/s = 12,500 bytes/ms
            # the first read on an actor also pays its imports (500 ms), later ones 5 ms to open
            rows.append(_row(kind="input", resource=rtype, rows=16384, repeat=rep, ms=16384 * 264 / 12_500,
                             client_ms=500.0 if rep == 0 else 5.0))  # fmt: skip
    for rep in range(3):  # 8 requests of 13,312 rows in 100 ms: 1.06e6 rows/s, pull 40% of it;
        # a quarter of the push is the client's own work
        rows.append(_row(kind="ps", resource="small", rows=13312, calls=8, repeat=rep,
                         forward_ms=40.0, backward_ms=60.0, ms=100.0, client_ms=15.0))  # fmt: skip
        rows.append(_row(kind="ps_dense", resource="small", rows=100_000, calls=8, repeat=rep, ms=40.0))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _fit(measurements: pd.DataFrame):
    return fit_problem(
        measurements,
        cluster=CLUSTER,
        layers=LAYERS,
        batch_size=512,
        samples=10**7,
        throughput_min=1000.0,
        name="synthetic",
        input_bytes_per_sample=264,
        execution={"mode": "async", "batches_ahead": 1},
    )


def test_fit_recovers_known_coefficients_and_writes_a_loadable_problem(tmp_path):
    result = _fit(_measurements(noise=0.01))
    assert result.flags == []
    layers = {layer["name"]: layer for layer in result.problem["layers"]}
    for (layer, rtype), (fixed, per_sample, _) in TRUTH.items():
        coeff = layers[layer]["time_ms"][rtype]
        assert coeff["per_sample"] == pytest.approx(per_sample, rel=0.05)
        assert coeff["fixed"] == pytest.approx(fixed, abs=0.1 * (fixed + per_sample * 512))
    # parallel fraction: time-weighted over the two types at the batch size
    for name in ("embedding", "fc1", "logit"):
        w = {t: TRUTH[(name, t)][0] + TRUTH[(name, t)][1] * 512 for t in ("small", "big")}
        expected = sum(TRUTH[(name, t)][2] * w[t] for t in w) / sum(w.values())
        assert layers[name]["parallel_fraction"] == pytest.approx(expected, abs=0.02)
    resources = {r["name"]: r for r in result.problem["resources"]}
    for rtype in ("small", "big"):
        assert resources[rtype]["bandwidth_gbps"] == pytest.approx(BANDWIDTH[rtype], rel=0.05)
        assert resources[rtype]["latency_ms"] == pytest.approx(LATENCY[rtype] / 2, rel=0.05)
        assert resources[rtype]["io_bandwidth_gbps"] == pytest.approx(0.1, rel=1e-6)
        assert resources[rtype]["price_per_hour"] == CLUSTER.type(rtype).price_per_hour
    assert result.problem["ps"]["rows_per_second_per_shard"] == pytest.approx(8 * 13312 / 0.1, rel=1e-6)
    # the simulator's measured details are problem fields (no side file)
    ps, runtime = result.problem["ps"], result.problem["runtime"]
    assert ps["pull_share"] == pytest.approx(0.4)
    assert ps["push_client_share"] == pytest.approx(0.25)
    assert ps["dense_ms_per_param"] == pytest.approx(40.0 / 8 / 100_000)
    assert layers["fc1"]["dense_params"] == 126976
    assert runtime["startup_ms"] == pytest.approx(500.0)
    assert runtime["forward_fraction"] == pytest.approx(1 / 3, rel=0.02)
    # the job's execution and the PS wait per row (no probe rows: no call terms, layer times as fitted)
    assert runtime["mode"] == "async" and runtime["batches_ahead"] == 1
    assert runtime["ps_wait_ms_per_row"] == pytest.approx(100.0 / (8 * 13312), rel=1e-5)
    assert "call_ms" not in runtime

    paths = write_problem(result, tmp_path / "p.yaml")
    problem = load_problem(paths["problem"])
    assert problem.layer_names == ["embedding", "fc1", "logit"]
    assert all(set(layer.time_ms) == {"small", "big"} for layer in problem.layers)
    assert problem.input_bytes_per_sample == 264
    assert len(pd.read_parquet(paths["measurements"])) == len(result.measurements)
    assert set(pd.read_csv(paths["quality"])["what"]) == {"layer", "transfer", "input", "ps"}
    assert set(paths) == {"problem", "measurements", "quality"}
    assert not list(tmp_path.glob("*.runtime.yaml"))
    assert problem.runtime is not None and problem.runtime.startup_ms == pytest.approx(500.0)
    assert problem.ps.pull_share == pytest.approx(0.4) and problem.layers[1].dense_params == 126976


def test_noisy_and_negative_fits_are_flagged_not_hidden(tmp_path):
    measurements = _measurements(noise=0.01)
    layer = measurements["kind"] == "layer"
    rng = np.random.default_rng(1)
    # logit on big: pure noise around 1 ms (no trend) -> low R²
    noisy = layer & (measurements["layer"] == "logit") & (measurements["resource"] == "big")
    measurements.loc[noisy, "ms"] = 1.0 + 0.5 * rng.random(int(noisy.sum()))
    # fc1 on small: time falls with batch size -> negative per-sample coefficient
    falling = layer & (measurements["layer"] == "fc1") & (measurements["resource"] == "small")
    measurements.loc[falling, "ms"] = 50.0 - 0.01 * measurements.loc[falling, "batch_size"]
    result = _fit(measurements)
    text = " | ".join(result.flags)
    assert "layer logit on big" in text and "R²" in text
    assert "layer fc1 on small" in text and "negative coefficient" in text
    quality = result.quality.set_index(["what", "layer", "resource"])
    assert quality.loc[("layer", "logit", "big"), "r2"] < 0.9
    assert quality.loc[("layer", "fc1", "small"), "raw_slope"] < 0
    # The problem file stays usable: clamped coefficients are non-negative; the flags are on top.
    paths = write_problem(result, tmp_path / "p.yaml")
    head = paths["problem"].read_text().splitlines()[0]
    assert head.startswith("# POOR FITS (")
    fc1 = load_problem(paths["problem"]).layers[1].time_ms["small"]
    assert fc1.fixed >= 0 and fc1.per_sample >= 0


@pytest.mark.parametrize(
    ("speedup", "alpha"), [(2.0, 1.0), (1.0, 0.0), (1.6, 0.75), (1 / 0.55, 0.9), (2.5, 1.0), (0.7, 0.0)]
)
def test_parallel_fraction_inverts_amdahl_and_clips(speedup, alpha):
    assert parallel_fraction(speedup) == pytest.approx(alpha)


def test_fit_line_is_exact_on_a_line_and_rejects_one_point():
    fit = fit_line([64, 128, 512], [1.0 + 0.01 * 64, 1.0 + 0.01 * 128, 1.0 + 0.01 * 512])
    assert (
        fit.intercept == pytest.approx(1.0)
        and fit.slope == pytest.approx(0.01)
        and fit.r2 == pytest.approx(1.0)
    )
    with pytest.raises(DataError):
        fit_line([512, 512], [1.0, 2.0])


def test_measurements_without_the_columns_are_a_data_error():
    with pytest.raises(DataError, match="columns"):
        _fit(pd.DataFrame({"kind": ["layer"]}))


def test_shared_host_background_is_the_quietest_window_and_calls_and_stages_are_fitted():
    rows = [
        # one machine seen by both types, before and after the layers: a burst of load hit one window
        _row(kind="host", resource=t, peer="n1", rows=2, ms=1000.0, client_ms=cpu)
        for t, cpu in (("small", 300.0), ("big", 1800.0), ("small", 250.0), ("big", 400.0))
    ]
    # a call costs the receiving actor 1.5 ms plus 1 ms per MB
    rows += [_row(kind="call", resource=t, nbytes=n, calls=60, ms=60 * (1.5 + n / 1e6))
             for t in ("small", "big") for n in (4096, 1 << 20, 4 << 20)]  # fmt: skip
    # the whole model as one stage: 0.2 ms cheaper per layer after the first than the layers alone
    measured = _measurements(noise=0.0)
    alone = measured[measured["kind"] == "layer"].groupby(["resource", "batch_size", "layer"])["ms"].median()
    for (rtype, b), total in alone.groupby(["resource", "batch_size"]).sum().items():
        rows.append(_row(kind="stage", resource=rtype, batch_size=b, ms=total - 0.2 * (len(LAYERS) - 1)))
    problem = _fit(
        pd.concat([measured, pd.DataFrame(rows, columns=list(COLUMNS))], ignore_index=True)
    ).problem
    (host,) = problem["hosts"]
    assert host["cores"] == 2 and host["background_cores"] == pytest.approx(0.25)
    for resource in problem["resources"]:
        assert resource["call_overhead_ms"] == pytest.approx(1.5, rel=1e-3)
        assert resource["fused_saving_ms"] == pytest.approx(0.2, rel=1e-3)


def test_a_probe_that_scales_a_types_layer_times_scales_its_fused_saving_with_them():
    """The fused saving is a share of the layers' fixed times: calibrated to the runtime's loop, it moves
    with them, and stays at most their mean (a CI run once saw it pass the scaled-down sum)."""
    measured = _measurements(noise=0.0)
    alone = measured[measured["kind"] == "layer"].groupby(["resource", "batch_size", "layer"])["ms"].median()
    rows = [_row(kind="stage", resource=rtype, batch_size=b, ms=total - 0.2 * (len(LAYERS) - 1))
            for (rtype, b), total in alone.groupby(["resource", "batch_size"]).sum().items()]  # fmt: skip
    unscaled = _fit(pd.concat([measured, pd.DataFrame(rows, columns=list(COLUMNS))], ignore_index=True))
    # one-stage probes (the whole model on one type) far slower and far faster than the layers explain:
    # the ratio is clipped to 4 on big and to 1/4 on small
    rows += [_row(kind="probe", resource="big", layer="logit", batch_size=512, ms=1e6),
             _row(kind="probe", resource="small", layer="logit", batch_size=512, ms=1e-6)]  # fmt: skip
    scaled = _fit(pd.concat([measured, pd.DataFrame(rows, columns=list(COLUMNS))], ignore_index=True))
    for before, after, scale in zip(
        unscaled.problem["resources"], scaled.problem["resources"], (0.25, 4.0), strict=True
    ):
        assert after["fused_saving_ms"] == pytest.approx(before["fused_saving_ms"] * scale, rel=1e-5)
        fixed = [layer["time_ms"][after["name"]]["fixed"] for layer in scaled.problem["layers"]]
        assert after["fused_saving_ms"] <= float(np.mean(fixed))


def test_a_probes_cold_gpu_tier_misses_are_priced_apart_not_scaled_into_the_layers():
    """A one-stage probe starts with an empty GPU tier: over its few steady batches it still meets keys for
    the first time, each fetched from the shards at gpu_miss_ms_per_row. The fit explains those misses
    apart; scaled into the layers they would slow every plan on the type (on an H200 the model then
    predicted 27-60% under the achieved rate)."""
    tier = [_row(kind="gpu_table", resource="big", rows=26 * 512 * 10, ms=26 * 512 * 10 * 1e-4),
            _row(kind="gpu_miss", resource="big", rows=10_000, ms=10.0)]  # fmt: skip
    measured = pd.concat(
        [_measurements(noise=0.0), pd.DataFrame(tier, columns=list(COLUMNS))], ignore_index=True
    )

    def loop_ms(problem: dict) -> float:  # the one-stage plan on big, as the fit prices its probe
        terms = problem["runtime"]
        fitted = {"mode": "sync", "ps_wait_ms_per_row": terms["ps_wait_ms_per_row"], "gpu_table_ms_per_row":
                  terms["gpu_table_ms_per_row"], "gpu_miss_ms_per_row": terms["gpu_miss_ms_per_row"]}  # fmt: skip
        model = CostModel(problem_from_dict({**problem, "runtime": fitted}))
        limits = model.evaluate(["big"] * len(LAYERS), [1], 1).runtime
        assert limits is not None and limits.table.place == "gpu"
        return limits.loop_ms

    unscaled = loop_ms(_fit(measured).problem)
    cold_per_batch, miss_ms = 2_000, 10.0 / 10_000
    probe_ms = 1.5 * unscaled + cold_per_batch * miss_ms
    for misses in (cold_per_batch, 0):
        probe = _row(
            kind="probe",
            resource="big",
            layer="logit",
            batch_size=512,
            rows=misses * 20,
            calls=20,
            ms=probe_ms,
        )
        fitted = _fit(pd.concat([measured, pd.DataFrame([probe], columns=list(COLUMNS))], ignore_index=True))
        assert fitted.problem["runtime"]["gpu_miss_ms_per_row"] == {"big": pytest.approx(miss_ms)}
        # the fitted model's plan plus the probe's own cold misses is the probe
        assert loop_ms(fitted.problem) + misses * miss_ms == pytest.approx(probe_ms, rel=1e-6)


def test_a_transfer_curve_that_bends_past_the_inline_size_keeps_its_smallest_messages_latency():
    """Messages above Ray's inline size go through the object store, so time grows faster than the bytes
    past it. The transfers of one CI run's quick profile (cpu_big, two receivers, two repeats: 4 KiB at
    0.84 ms, 256 KiB at 1.68, 1 MiB at 14.95 on average) fit a line below zero at no bytes; the latency
    is then what the smallest message took beyond its bytes' share, not zero."""
    sizes = {4096: [0.937, 0.719, 0.939, 0.769], 262144: [1.640, 1.087, 2.387, 1.589],
             1 << 20: [23.967, 14.395, 13.402, 8.256]}  # fmt: skip
    data = _measurements(noise=0.01)
    data = data[~((data["kind"] == "transfer") & (data["resource"] == "big"))]
    bent = [_row(kind="transfer", resource="big", peer="big", nbytes=n, repeat=i, ms=ms)
            for n, times in sizes.items() for i, ms in enumerate(times)]  # fmt: skip
    result = _fit(pd.concat([data, pd.DataFrame(bent, columns=list(COLUMNS))], ignore_index=True))
    big = {r["name"]: r for r in result.problem["resources"]}["big"]
    means = {n: float(np.mean(t)) for n, t in sizes.items()}
    through_origin = sum(n * means[n] for n in sizes) / sum(n * n for n in sizes)  # ms per byte
    assert big["bandwidth_gbps"] == pytest.approx(1.0 / through_origin / 125_000, rel=1e-4)
    assert big["latency_ms"] == pytest.approx((means[4096] - through_origin * 4096) / 2, rel=1e-4)
    assert 0.3 < big["latency_ms"] < 0.42  # half of a 4 KiB message's ~0.8 ms
    quality = result.quality
    (flags,) = quality[(quality["what"] == "transfer") & (quality["resource"] == "big")]["flags"]
    assert "negative coefficient" in flags  # still flagged as a poor fit
