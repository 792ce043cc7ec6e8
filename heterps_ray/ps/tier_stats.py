"""The counters of a storage tier in front of a slower one (GPU memory over the PS shards,
ps/device_table.py; a shard's RAM over its disk file, ps/disk_tier.py), in one set of words."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierStats:
    """What a tier did: key lookups it served (hits) or not (misses), rows it fetched from the level
    below, wrote back to it and evicted."""

    hits: int = 0
    misses: int = 0
    fetched: int = 0
    written_back: int = 0
    evicted: int = 0

    @property
    def hit_rate(self) -> float | None:
        looked = self.hits + self.misses
        return self.hits / looked if looked else None
