"""Shortest paths over stage segments: the DP both level searches solve at every level.

A plan is a chain of segments (i, j, t) (layers i..j on type t) covering every layer, adjacent
segments on different types (else they would be one stage). With a weight per segment ($/hour, or a
lower bound on it) the cheapest chain is a DP over (layer, type of the last stage) in O(L^2 T^2).
"""

from __future__ import annotations

import math

import numpy as np


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
    L, _, T = rate.shape
    best = np.full((L, T), np.inf)
    came_from = np.zeros((L, T), dtype=np.int64)
    prev_type = np.full((L, T), -1, dtype=np.int64)
    types = np.arange(T)
    for j in range(L):
        best[j] = rate[0, j]
        if j == 0:
            continue
        prev = best[:j]
        if T > 1:
            order = np.argsort(prev, axis=1)
            excl_type = np.where(order[:, :1] == types[None, :], order[:, 1:2], order[:, :1])
            excl = np.take_along_axis(prev, excl_type, axis=1)
        else:
            excl_type = np.zeros((j, 1), dtype=np.int64)
            excl = np.full((j, 1), np.inf)
        total = excl + rate[1 : j + 1, j]
        i_best = np.argmin(total, axis=0)
        value = total[i_best, types]
        better = value < best[j]
        best[j] = np.where(better, value, best[j])
        came_from[j] = np.where(better, i_best + 1, 0)
        prev_type[j] = np.where(better, excl_type[i_best, types], -1)
    t = int(np.argmin(best[L - 1]))
    value = float(best[L - 1, t])
    if not math.isfinite(value):
        return math.inf, None
    path, j = [], L - 1
    while j >= 0:
        i = int(came_from[j, t])
        path.append((i, j, t))
        t, j = int(prev_type[j, t]), i - 1
    return value, path[::-1]


def prefix(rate: np.ndarray) -> np.ndarray:
    """prefix[j, t]: cheapest chain covering layers 0..j whose last stage (on t) ends at j."""
    L, _, T = rate.shape
    best = np.full((L, T), np.inf)
    for j in range(L):
        best[j] = rate[0, j]
        if j:
            best[j] = np.minimum(best[j], (excluding(best[:j]) + rate[1 : j + 1, j]).min(axis=0))
    return best


def through(rate: np.ndarray) -> np.ndarray:
    """Per segment (i, j, t): the cheapest chain covering every layer that uses it."""
    L, _, T = rate.shape
    before = np.vstack([np.zeros((1, T)), excluding(prefix(rate))])  # row i: the chain 0..i-1
    after = excluding(suffix(rate))  # row j + 1: the chain j+1..L-1 (row L: 0)
    after[L] = 0.0
    i = np.arange(L)
    return before[i][:, None, :] + rate + after[i + 1][None, :, :]


def assignment_of(path: list[tuple[int, int, int]]) -> tuple[int, ...]:
    out: list[int] = []
    for i, j, t in path:
        out += [t] * (j - i + 1)
    return tuple(out)
