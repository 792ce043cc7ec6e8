"""One assembly of a plan's price (DESIGN.md §3): its throughput limits and its instances -> throughput,
cost rate, monetary cost and whether it meets the floor. Every scheduler, the RL reward (through
provisioning) and the cost model's evaluations price plans with it; scalars or numpy arrays (one entry
per plan) alike.

    priced = price_plan([stage θ...], ps θ, [caps...], cost_rate, samples, floor)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from heterps_ray.costmodel.formulas import FLOOR_RTOL, S_PER_HOUR


@dataclass(frozen=True)
class Priced:
    """What a plan (or, with arrays, each of many plans) gives."""

    throughput: Any  # samples/s: min of every limit
    cost_rate: Any  # $/hour
    cost: Any  # $ for all samples (inf at no throughput, 0 at unlimited)
    meets_floor: Any  # throughput >= floor (up to FLOOR_RTOL)


def cost_rate(counts: Sequence[Any], prices: Sequence[Any]) -> Any:
    """R = Σ count · price ($/hour): stages' replicas and PS shards with their types' prices."""
    return sum((np.asarray(k) * np.asarray(p) for k, p in zip(counts, prices, strict=True)), np.float64(0.0))


def monetary_cost(rate: Any, samples: float, throughput: Any) -> Any:
    """$ = R · N / Θ / 3600; inf where Θ is 0, 0 where Θ is unlimited. Floats in, a float out."""
    rate, throughput = np.asarray(rate, dtype=np.float64), np.asarray(throughput, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.where(throughput > 0.0, rate * samples / throughput / S_PER_HOUR, np.inf)
    cost = np.where(np.isinf(throughput), 0.0, cost)
    return float(cost) if cost.ndim == 0 else cost


def meets_floor(throughput: Any, floor: float) -> Any:
    """Θ >= Θmin, up to float rounding (FLOOR_RTOL). Floats in, a bool out."""
    ok = np.asarray(throughput) >= floor * (1.0 - FLOOR_RTOL)
    return bool(ok) if ok.ndim == 0 else ok


def rate_for_cost(cost: float, samples: float, throughput: float) -> float:
    """The cost rate ($/hour) at which a plan of `throughput` costs `cost`: R = $ · 3600 · Θ / N. The walk
    of the exact searches uses it to skip levels no cheaper than the best plan."""
    return cost * S_PER_HOUR * throughput / samples


def price_plan(
    limits: Sequence[Any], rate: Any, samples: float, floor: float, runnable: Any = True
) -> Priced:
    """Assemble a plan's price from every throughput limit (stages with their replicas, the PS tier,
    the runtime's loop and hosts: whichever apply) and its cost rate; not runnable: throughput 0."""
    throughput = np.asarray(limits[0], dtype=np.float64)
    for limit in limits[1:]:
        throughput = np.minimum(throughput, limit)
    reached = np.where(runnable, throughput, 0.0)
    out: Any = float(reached) if reached.ndim == 0 else reached
    rate = float(rate) if np.ndim(rate) == 0 else rate
    return Priced(out, rate, monetary_cost(rate, samples, out), meets_floor(out, floor))
