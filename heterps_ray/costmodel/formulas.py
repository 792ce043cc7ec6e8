"""The formulas of DESIGN.md §3 as plain functions over plain numbers (or numpy arrays, elementwise):
one place for each, used by the cost model, its runtime terms, provisioning and the exact search."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

BYTES_PER_MS_PER_GBPS = 125_000.0  # 1 Gbit/s = 1e9 bit/s / 8 bit/byte / 1000 ms/s = 125,000 bytes/ms
MS_PER_S = 1000.0  # ms per second
S_PER_HOUR = 3600.0  # seconds per hour
FLOOR_RTOL = 1e-9  # relative slack when comparing a throughput with the floor (float rounding only)


# ---------------------------------------------------------------------------------------------
# The formulas, as plain functions over plain numbers


def layer_ms(fixed_ms: float, per_sample_ms: float, batch_size: int) -> float:
    """c(l,t) = fixed + per_sample * B  (ms per batch, one replica)."""
    return fixed_ms + per_sample_ms * batch_size


def boundary_ms(
    out_bytes_per_sample: float, batch_size: int, bandwidth_gbps: float, latency_ms: float
) -> float:
    """One side's time on a stage boundary: activation forward + gradient back, each with two latencies."""
    traffic_bytes = 2.0 * out_bytes_per_sample * batch_size
    return traffic_bytes / (bandwidth_gbps * BYTES_PER_MS_PER_GBPS) + 2.0 * latency_ms


def input_ms(input_bytes_per_sample: float, batch_size: int, io_bandwidth_gbps: float) -> float:
    """The first stage reads its batch at its IO bandwidth (ms)."""
    return input_bytes_per_sample * batch_size / (io_bandwidth_gbps * BYTES_PER_MS_PER_GBPS)


def stage_throughput(batch_size: float, tau_ms: Any, alpha: Any, replicas: Any) -> Any:
    """theta_s(k) = 1000 * B / tau_s / ((1 - alpha) + alpha / k)  (samples/s, Amdahl scaling; inf for
    no time). Floats in, a float out; arrays in, an array out."""
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = (
            MS_PER_S
            * batch_size
            / np.asarray(tau_ms, dtype=np.float64)
            / ((1.0 - np.asarray(alpha)) + np.asarray(alpha) / np.asarray(replicas))
        )
    theta = np.where(np.asarray(tau_ms) <= 0.0, np.inf, theta)
    return float(theta) if theta.ndim == 0 else theta


def amdahl_replicas(tau_ms: Any, alpha: Any, budget_ms: Any) -> Any:
    """The fractional k >= 1 with tau / ((1 - alpha) + alpha / k) = budget_ms, i.e. theta_s(k) equal to
    the target 1000 * B / budget_ms (Amdahl solved for k); inf where no count gets there (the serial
    part alone, (1 - alpha) * tau, exceeds the budget). Floats in, a float out; arrays in, an array out."""
    if isinstance(tau_ms, float) and isinstance(alpha, float) and isinstance(budget_ms, float):
        # the same operations on Python floats (same IEEE results): the RL env calls this per type
        # and layer of every episode, where numpy's per-call overhead was most of a rollout's time
        if tau_ms <= budget_ms:
            return 1.0
        left = budget_ms / tau_ms - (1.0 - alpha)
        return max(alpha / left if alpha > 0.0 else 1.0, 1.0) if left > 0.0 else math.inf
    tau, a = np.asarray(tau_ms, dtype=np.float64), np.asarray(alpha, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        room = np.asarray(budget_ms) / tau - (1.0 - a)  # allowed value of alpha / k
        k = np.where(room > 0.0, np.maximum(np.where(a > 0.0, a / room, 1.0), 1.0), np.inf)
    k = np.where(tau <= np.asarray(budget_ms), 1.0, k)
    return float(k) if k.ndim == 0 else k


def fewest_replicas(batch_size: float, tau_ms: Any, alpha: Any, target: float) -> Any:
    """The fewest whole replicas k with theta_s(k) >= target (samples/s), inf where none does: the
    ceiling of amdahl_replicas, corrected against stage_throughput itself so that float rounding of the
    closed form never decides whether a count reaches the target. The one replica rule of the level
    walk on both models (base_levels.py, runtime_levels.py); the policy's features use amdahl_replicas."""
    tau = np.asarray(tau_ms, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        budget_ms = MS_PER_S * batch_size / np.float64(target)  # inf for a target of 0: one replica
        k = np.ceil(np.minimum(amdahl_replicas(tau, alpha, budget_ms), 1e15))
        for _ in range(2):
            down = np.maximum(k - 1.0, 1.0)
            k = np.where((down < k) & (stage_throughput(batch_size, tau, alpha, down) >= target), down, k)
            k = np.where(stage_throughput(batch_size, tau, alpha, k) < target, k + 1.0, k)
    k = np.where(k >= 1e15, np.inf, k)
    return float(k) if k.ndim == 0 else k


def ps_throughput(shards: int, rows_per_second_per_shard: float, rows_per_sample: float) -> float:
    """theta_ps(m) = m * rows/s per shard / sparse rows per sample (samples/s); inf without sparse rows."""
    if rows_per_sample <= 0.0:
        return math.inf
    return shards * rows_per_second_per_shard / rows_per_sample


# The monetary cost, the floor test and their assembly into a plan's price: pricing.py.
