"""How often a cache of a table's rows finds the row a lookup asks for (the GPU tier, the disk tier's hot
set in RAM): an LRU cache's hit rate under the data's key popularity, and the size that reaches a target.
Used by the table estimate (table_memory.py, table_disk.py) and the GPU-cloud problems."""

from __future__ import annotations

import math

import numpy as np

from heterps_ray.config import JobConfig

HIT_RATE_SAMPLE_ROWS = (
    500_000  # training rows whose keys give the popularity a cache's hit rate is estimated from
)


def gpu_hit_rate(job: JobConfig, capacity: int, rows: int, lookups: float) -> float:
    """The share of key lookups a GPU memory of `capacity` rows serves for `job`'s table of `rows`
    expected rows over the run's `lookups`: where they fit, all but each row's first lookup (it comes
    from the shards); else an LRU cache's (:func:`cache_hit_rate`)."""
    if capacity >= rows:
        return max(1.0 - rows / lookups, 0.0) if lookups > 0 else 1.0
    return cache_hit_rate(job, capacity, rows)


def cache_hit_rate(job: JobConfig, capacity: int, rows: int) -> float:
    """The share of key lookups an LRU cache of `capacity` rows serves for `job`'s table of `rows`
    expected rows: Che's approximation over the keys of the first HIT_RATE_SAMPLE_ROWS training rows,
    the capacity scaled to the share of the table they hold."""
    from heterps_ray.data.dataset import Dataset

    keys = []
    seen = 0
    for batch in Dataset(job.data.path).iter_batches("train", 8192, drop_last=False):
        keys.append(batch["keys"].ravel())
        seen += len(batch["keys"])
        if seen >= HIT_RATE_SAMPLE_ROWS:
            break
    counts = np.unique(np.concatenate(keys), return_counts=True)[1] if keys else np.zeros(0)
    return lru_hit_rate(counts, capacity * len(counts) / max(rows, 1))


def lru_hit_rate(counts: np.ndarray, capacity: float) -> float:
    """Hit rate of an LRU cache of `capacity` items over a stream with the item counts `counts`, under
    independent requests with that popularity (Che, Tung, Wang 2002: an item stays for a characteristic
    time T, sum_i (1 - e^(-p_i T)) = capacity; a request of item i finds it with 1 - e^(-p_i T)), the first
    request of each item a miss in any cache."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0 or capacity <= 0:
        return 0.0
    if capacity >= len(counts):
        return 1.0 - len(counts) / total
    p = counts / total
    low, high = 0.0, 1.0
    while np.sum(-np.expm1(-p * high)) < capacity:
        high *= 2.0
    for _ in range(100):  # bisection on T
        mid = 0.5 * (low + high)
        if np.sum(-np.expm1(-p * mid)) < capacity:
            low = mid
        else:
            high = mid
    return float(np.sum((counts - 1.0) * -np.expm1(-p * high)) / total)


def hot_rows_for(counts: np.ndarray, target_hit_rate: float, rows: int | None = None) -> int | None:
    """The rows a RAM tier kept by LRU must hold so that `target_hit_rate` of the key lookups find
    their row there (a disk tier's hot set, ps/disk_tier.py), from the keys' counts `counts` (Che's
    approximation as :func:`lru_hit_rate`, solved for its characteristic time T at the target, the
    capacity then sum_i (1 - e^(-p_i T))), scaled from the counted keys to a table of `rows`; None
    where no size reaches it (each key's first lookup misses in any cache)."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0 or target_hit_rate > 1.0 - len(counts) / total:
        return None
    p = counts / total

    def hit_rate(t: float) -> float:
        return float(np.sum((counts - 1.0) * -np.expm1(-p * t)) / total)

    low, high = 0.0, 1.0
    while hit_rate(high) < target_hit_rate:
        high *= 2.0
    for _ in range(100):  # bisection on T: the hit rate grows with it
        mid = 0.5 * (low + high)
        if hit_rate(mid) < target_hit_rate:
            low = mid
        else:
            high = mid
    capacity = float(np.sum(-np.expm1(-p * high)))
    scale = (rows / len(counts)) if rows else 1.0
    return math.ceil(min(capacity, len(counts)) * scale)
