"""Shortest paths over stage segments: the DP both level searches solve at every level.

A plan is a chain of segments (i, j, t) (layers i..j on type t) covering every layer, adjacent
segments on different types (else they would be one stage). With a weight per segment ($/hour, or a
lower bound on it) the cheapest chain is a DP over (layer, type of the last stage) in O(L^2 T^2);
with per-type instance limits, the same DP whose state also counts the instances of the types whose
limits bind (`counted_cheapest_path`).
"""

from __future__ import annotations

import math

import numpy as np

TOO_MANY_STATES = object()  # counted_cheapest_path: the count states exceed the caller's limit


def excluding(best: np.ndarray) -> np.ndarray:
    """out[..., t] = min over t' != t of best[..., t']."""
    T = best.shape[-1]
    if T == 1:
        return np.full_like(best, np.inf)
    order = np.argsort(best, axis=-1)
    first = np.take_along_axis(best, order[..., :1], axis=-1)
    second = np.take_along_axis(best, order[..., 1:2], axis=-1)
    return np.where(order[..., :1] == np.arange(T), second, first)


def suffix(rate: np.ndarray) -> np.ndarray:
    """suffix[i, t]: cheapest chain of segments covering layers i..L-1 whose first stage is on t
    (adjacent types differ); row L is 0 (nothing left)."""
    L, _, T = rate.shape
    out = np.full((L + 1, T), np.inf)
    out[L] = 0.0
    after = np.full((L + 1, T), np.inf)  # after[j + 1, t]: best continuation after a stage on t ending at j
    after[L] = 0.0
    for i in range(L - 1, -1, -1):
        out[i] = (rate[i, i:, :] + after[i + 1 :, :]).min(axis=0)
        after[i] = excluding(out[i][None, :])[0]
    return out


def cheapest_path(rate: np.ndarray) -> tuple[float, list[tuple[int, int, int]] | None]:
    """Cheapest chain of segments (i, j, t) covering every layer, adjacent types differing."""
    values, paths = cheapest_paths(rate[None])
    return float(values[0]), paths[0]


def cheapest_paths(rates: np.ndarray) -> tuple[np.ndarray, list[list[tuple[int, int, int]] | None]]:
    """`cheapest_path` of each weight of a stack [W, L, L, T] at once (one pass over the layers for
    all of them: at 120 layers the per-layer overhead, not the arithmetic, is the DP's time).

    best[j, t]: the cheapest chain covering layers 0..j whose last stage (on t) ends at j, the first
    (lowest) start layer among equal values; excl[j + 1, t]: min over t' != t of best[j, t'] (row 0:
    the empty chain, 0), so a stage i..j on t follows excl[i, t]."""
    W, L, _, T = rates.shape
    best = np.empty((W, L, T))
    came_from = np.empty((W, L, T), dtype=np.int64)
    excl = np.full((W, L + 1, T), np.inf)
    excl[:, 0] = 0.0
    excl_type = np.full((W, L, T), -1, dtype=np.int64)
    w = np.arange(W)[:, None]
    types = np.arange(T)[None, :]
    for j in range(L):
        total = excl[:, : j + 1] + rates[:, : j + 1, j]  # [W, starts, T]
        start = total.argmin(axis=1)  # [W, T]
        value = total[w, start, types]
        best[:, j] = value
        came_from[:, j] = start
        if T > 1:
            order = value.argsort(axis=1)
            first, second = order[:, :1], order[:, 1:2]
            other = np.where(types == first, second, first)
            excl[:, j + 1] = value[w, other]
            excl_type[:, j] = other
    last = best[:, L - 1].argmin(axis=1)
    values = best[np.arange(W), L - 1, last]
    paths: list[list[tuple[int, int, int]] | None] = []
    for n in range(W):
        if not math.isfinite(values[n]):
            values[n] = math.inf
            paths.append(None)
            continue
        path, j, t = [], L - 1, int(last[n])
        while j >= 0:
            i = int(came_from[n, j, t])
            path.append((i, j, t))
            t, j = (int(excl_type[n, i - 1, t]) if i > 0 else -1), i - 1
        paths.append(path[::-1])
    return values, paths


def prefix(rate: np.ndarray) -> np.ndarray:
    """prefix[j, t]: cheapest chain covering layers 0..j whose last stage (on t) ends at j."""
    L, _, T = rate.shape
    best = np.full((L, T), np.inf)
    excl = np.full((L, T), np.inf)
    for j in range(L):
        best[j] = rate[0, j]
        if j:
            best[j] = np.minimum(best[j], (excl[:j] + rate[1 : j + 1, j]).min(axis=0))
        excl[j] = excluding(best[j][None, :])[0]
    return best


def through(rate: np.ndarray) -> np.ndarray:
    """Per segment (i, j, t): the cheapest chain covering every layer that uses it."""
    L, _, T = rate.shape
    before = np.vstack([np.zeros((1, T)), excluding(prefix(rate))])  # row i: the chain 0..i-1
    after = excluding(suffix(rate))  # row j + 1: the chain j+1..L-1 (row L: 0)
    after[L] = 0.0
    i = np.arange(L)
    return before[i][:, None, :] + rate + after[i + 1][None, :, :]


def counted_cheapest_path(
    seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, tracked: list[int], state_limit: int
) -> list[tuple[int, int, int]] | None | object:
    """Cheapest chain of segments whose stages on each `tracked` type use at most cap[t] instances
    (k[i, j, t] per segment): the DP of `cheapest_path` whose state also counts the instances of the
    tracked types, (layer, last type, instances used of each). None: no chain keeps the limits;
    TOO_MANY_STATES: more than `state_limit` count states (the caller solves it another way)."""
    L, _, T = seg_rate.shape
    dims = [int(cap[t]) + 1 for t in tracked]
    U = math.prod(dims)
    if U > state_limit:
        return TOO_MANY_STATES
    coords = np.indices(dims).reshape(len(dims), U) if dims else np.zeros((0, 1), dtype=np.int64)
    strides = [math.prod(dims[d + 1 :]) for d in range(len(dims))]
    axis_of = {t: d for d, t in enumerate(tracked)}
    idx = np.arange(U)
    best = np.full((L, T, U), np.inf)
    came_from = np.zeros((L, T, U), dtype=np.int16)  # start layer of the last stage
    prev_type = np.full((L, T, U), -1, dtype=np.int8)
    excl = np.full((L, T, U), np.inf)  # excl[j, t]: best[j, t' != t], and which t'
    excl_type = np.full((L, T, U), -1, dtype=np.int8)
    start = np.full(U, np.inf)
    start[0] = 0.0
    for j in range(L):
        for t in range(T):
            # every stage (i..j on t) at once: state u comes from state u - k(i,j,t) of type t's
            # axis (or u itself, untracked) after a chain to i - 1 whose last stage is not on t
            starts = np.flatnonzero(np.isfinite(seg_rate[: j + 1, j, t]))
            if len(starts) == 0:
                continue
            chains = np.where(
                (starts == 0)[:, None], start[None, :], excl[np.maximum(starts - 1, 0), t]
            )  # [starts, U]
            if t in axis_of:  # usage of t grows by k: shift the state
                d = axis_of[t]
                kk = k[starts, j, t].astype(np.int64)[:, None]
                ok = coords[d][None, :] >= kk
                src_idx = np.where(ok, idx[None, :] - kk * strides[d], 0)
                value = np.where(ok, np.take_along_axis(chains, src_idx, axis=1), np.inf)
            else:
                src_idx = np.broadcast_to(idx, chains.shape)
                value = chains
            value = value + seg_rate[starts, j, t][:, None]
            pick = np.argmin(value, axis=0)  # the first (lowest i) of equal values
            found = value[pick, idx]
            reached = np.isfinite(found)
            chosen = starts[pick]
            from_state = src_idx[pick, idx]
            best[j, t] = found
            came_from[j, t] = np.where(reached, chosen, 0)
            prev_type[j, t] = np.where(
                reached & (chosen > 0), excl_type[np.maximum(chosen - 1, 0), t, from_state], -1
            )
        if T > 1:
            order = np.argsort(best[j], axis=0)  # [T, U]
            first, second = order[0], order[1]
            for t in range(T):
                other = np.where(first == t, second, first)
                excl[j, t] = best[j, other, idx]
                excl_type[j, t] = other
    flat = int(np.argmin(best[L - 1]))
    t, u = divmod(flat, U)
    if not math.isfinite(best[L - 1, t, u]):
        return None
    path, j = [], L - 1
    while j >= 0:
        i, before = int(came_from[j, t, u]), int(prev_type[j, t, u])
        path.append((i, j, t))
        if t in axis_of:
            u -= int(k[i, j, t]) * strides[axis_of[t]]
        t, j = before, i - 1
    return path[::-1]


def chain_rows(
    ii: np.ndarray, jj: np.ndarray, tt: np.ndarray, L: int, T: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows that make 0/1 variables over segments (ii[v], jj[v], tt[v]) a chain covering every
    layer, as (row, variable, coefficient) triplets and the rows' lower and upper bounds: one stage
    starts at layer 0 and one ends at L - 1; at each boundary b = 1..L-1 what ends at b - 1 starts at
    b, and what starts at b on type t is at most what ends at b - 1 on the other types.

    Why the last rows and not "at most one of (ends at b - 1 on t, starts at b on t)": both admit the
    same 0/1 chains, but with these the LP relaxation is the chain polytope itself. Through a boundary,
    the flow from the types ending there to those starting there is a transportation problem with the
    diagonal forbidden, feasible (Hall) exactly when each type starting there is within what the other
    types end there; so every LP point is a flow in a network over (boundary, type), whose vertices are
    chains. With only the max_instances rows beside it HiGHS branches far less (120 layers x 8 types:
    6 s -> 1 s a level)."""
    seg = np.arange(len(ii))
    first, last = ii == 0, jj == L - 1
    ends, starts = ~last, ~first
    # rows: 0 start, 1 end, 2 .. L flow at b = 1..L-1, then (b, t) -> L + 1 + (b - 1) T + t
    flow = 1 + jj[ends] + 1
    alt = L + 1 + (ii[starts] - 1) * T + tt[starts]
    end_seg = np.repeat(seg[ends], T)
    end_alt = L + 1 + np.repeat(jj[ends], T) * T + np.tile(np.arange(T), int(ends.sum()))
    other = np.tile(np.arange(T), int(ends.sum())) != np.repeat(tt[ends], T)
    rows = np.concatenate(
        [np.zeros(int(first.sum())), np.ones(int(last.sum())), flow, ii[starts] + 1, alt, end_alt[other]]
    ).astype(np.int64)
    cols = np.concatenate([seg[first], seg[last], seg[ends], seg[starts], seg[starts], end_seg[other]])
    vals = np.concatenate(
        [
            np.ones(int(first.sum()) + int(last.sum()) + int(ends.sum())),
            -np.ones(int(starts.sum())),
            np.ones(int(starts.sum())),
            -np.ones(int(other.sum())),
        ]
    )
    n_rows = L + 1 + (L - 1) * T
    lo = np.concatenate([[1.0, 1.0], np.zeros(L - 1), np.full((L - 1) * T, -np.inf)])
    hi = np.concatenate([[1.0, 1.0], np.zeros(L - 1), np.zeros((L - 1) * T)])
    assert len(lo) == n_rows
    return rows, cols, vals, lo, hi


def assignment_of(path: list[tuple[int, int, int]]) -> tuple[int, ...]:
    out: list[int] = []
    for i, j, t in path:
        out += [t] * (j - i + 1)
    return tuple(out)
