"""Lower bounds on the cheapest stage path of a level (runtime_levels.py), each with why it is one:
the best mix of two segment weights that every plan of a first-stage type pays at least
(`best_mixes`), and a Lagrangian relaxation of the per-type instance limits (`relax_limits`)."""

from __future__ import annotations

import math

import numpy as np

from heterps_ray.scheduling.segment_paths import cheapest_path, cheapest_paths


def mixed_weights(plain: np.ndarray, priced: np.ndarray, lam: float) -> np.ndarray:
    """(1 - lam) plain + lam priced per segment (both inf on the same segments)."""
    return np.where(np.isfinite(plain), (1.0 - lam) * np.where(np.isfinite(plain), plain, 0.0)
                    + lam * np.where(np.isfinite(priced), priced, 0.0), np.inf)  # fmt: skip


def best_mixes(
    pairs: list[tuple[np.ndarray, np.ndarray]], steps: int = 6
) -> list[tuple[float, float, list[list[tuple[int, int, int]]]]]:
    """Per (plain, priced) pair: max over lam in [0, 1] of the cheapest path of (1 - lam) plain + lam
    priced, the lam reaching it and the paths met. Each is a lower bound on the rate of every plan
    with its first stage on the weights' type: such a plan pays at least plain(P) and at least
    priced(P) (`_weights`), so at least any mix of the two. The cheapest path of the mix is concave in
    lam (a minimum of lines), so a bisection on the slope of the path found (priced(P) - plain(P))
    climbs to its top; lam 0 and 1 are the two weights alone. The pairs' bisections run side by side,
    each step's paths in one `cheapest_paths` (each pair's result is what it alone would give)."""
    W = len(pairs)
    if W == 0:
        return []
    plain = np.stack([p for p, _ in pairs])
    priced = np.stack([q for _, q in pairs])
    finite = np.isfinite(plain)  # plain and priced are inf on the same segments
    plain0 = np.where(finite, plain, 0.0)
    priced0 = np.where(np.isfinite(priced), priced, 0.0)
    ends, end_paths = cheapest_paths(np.concatenate([plain, priced]))
    best: list[float] = []
    best_lam: list[float] = []
    found: list[list[list[tuple[int, int, int]]]] = []
    top: list[list[tuple[int, int, int]] | None] = [None] * W
    lo, hi = [0.0] * W, [1.0] * W
    active = []
    for n in range(W):
        v0, p0, v1, p1 = float(ends[n]), end_paths[n], float(ends[W + n]), end_paths[W + n]
        found.append([p for p in (p0, p1) if p is not None])
        best.append(v0 if v0 >= v1 else v1)
        best_lam.append(0.0 if v0 >= v1 else 1.0)
        active.append(p0 is not None and p1 is not None)
    for _ in range(steps):
        live = [n for n in range(W) if active[n]]
        if not live:
            break
        lam = np.array([0.5 * (lo[n] + hi[n]) for n in live])[:, None, None, None]
        mixed = np.where(finite[live], (1.0 - lam) * plain0[live] + lam * priced0[live], np.inf)
        values, paths = cheapest_paths(mixed)
        for row, n in enumerate(live):
            value, path, at = float(values[row]), paths[row], float(lam[row, 0, 0, 0])
            if path is None:
                active[n] = False
                continue
            if value > best[n]:
                best[n], best_lam[n], top[n] = value, at, path
            slope = sum(float(priced[n][s]) - float(plain[n][s]) for s in path)
            if slope > 0:
                lo[n] = at
            elif slope < 0:
                hi[n] = at
            else:
                active[n] = False
    return [(best[n], best_lam[n], found[n] + [p for p in (top[n],) if p is not None]) for n in range(W)]


def with_limits(weight: np.ndarray, k: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """weight + mu_t k per segment on type t (inf where weight is)."""
    return np.where(np.isfinite(weight), weight + np.where(np.isfinite(weight), k, 0.0) * mu, np.inf)


def relax_limits(
    weight: np.ndarray,
    k: np.ndarray,
    cap: np.ndarray,
    unit: float,
    start: np.ndarray | None = None,
    steps: int = 12,
) -> tuple[float, np.ndarray, list[list[tuple[int, int, int]]]]:
    """Lagrangian relaxation of the per-type limits on a segment weight: (the best bound found, its
    multipliers mu, the paths met). Why a lower bound: every plan P within the limits uses at most
    cap_t instances of each type t, and at least k(s) on each of its stages s (the fewest reaching the
    level; stage 0's DataWorkers too), so for mu >= 0, weight(P) >= weight(P) + Σ_t mu_t (use_t(P) -
    cap_t) >= cheapest_path(weight + mu k) - mu · cap; any plan's rate is at least weight(P) (the
    weights of `_weights` and their mixes are). Subgradient steps on mu from `start` (the previous
    level's: levels move little), `unit` the first step ($/hour an instance)."""
    T = weight.shape[-1]
    mu = np.zeros(T) if start is None else start.copy()
    best, best_mu = -math.inf, np.zeros(T)
    met: list[list[tuple[int, int, int]]] = []
    step = unit * (0.5 if start is None else 0.2)  # unit: $/hour of the dearest instance
    for _ in range(steps):
        value, path = cheapest_path(with_limits(weight, k, mu))
        if path is None:
            return math.inf, mu, met
        bound = value - float(mu @ cap)
        if bound > best:
            best, best_mu = bound, mu.copy()
        met.append(path)
        use = np.zeros(T)
        for s in path:
            use[s[2]] += float(k[s])
        over = use - cap
        if (over <= 0).all() and not (mu * over).any():
            break  # complementary: the path is within the limits and the bound is its weight
        mu = np.maximum(0.0, mu + step * over / max(float(np.abs(over).max()), 1.0))
        step = step * 0.7
    return best, best_mu, met
