"""Raw int64 keys -> slots, in a device's memory: an open-addressing hash map in torch ops.

The index of the GPU tier (ps/device_table.py): a batch's distinct keys are looked up, and the new ones
given slots, where the rows live, so the host moves a batch's raw keys and nothing per key. The same
code runs on the CPU, where the tests run it.

Why open addressing, and not the sorted keys TorchRec's managed collisions keep (``searchsorted``): a
sorted index takes new keys only by a merge, a sort of every key held, on each batch that brings one (most
batches of a Criteo-shaped run), and on a GPU a search is ~20 dependent gathers where a probe here is 1-3
rounds of one gather. On this machine's CPU the sorted search of a batch's distinct keys was quicker
(1.3 ms against 5.1 for ~15k keys, docs/benchmarks/gpu.md "The CPU stand-in and the device key index"),
but the GPU is what the index is for; a Triton kernel for its probe is the next step there.

The map, as FBGEMM's and HierarchicalKV's: linear probing from a multiplicative (Fibonacci) hash, load
at most 1/2, a removed key leaves a tombstone that lookups step over, and the map is rebuilt (grown if
it must) when keys and tombstones pass the load. Each round of probing reads a window of WINDOW
consecutive buckets per key (a cache line of keys; HierarchicalKV scans a bucket of slots the same
way): a key is found at the first match before the first empty bucket, so linear probing's longest
runs (~20 buckets at load 1/2) take 2-3 rounds, not 20, and a batch dispatches a few dozen ops, not
hundreds. Keys are inserted in vectorised rounds: each takes the first empty bucket of its window;
among those that pick the same bucket the lowest position wins (``scatter_reduce`` amin:
deterministic on every device), the others look again from there.

Example::

    index = DeviceIndex(torch.device("cuda"))
    slots = index.lookup(keys)                   # int64[n], -1: absent
    index.insert(new_keys, new_slots)            # distinct keys, none held yet
    index.remove(old_keys)
"""

from __future__ import annotations

import torch

from heterps_ray.ps.row_bytes import DEVICE_INDEX_BUCKET_BYTES

EMPTY = -1  # a bucket's value: never held a key (a lookup stops here)
TOMBSTONE = -2  # held a key that was removed (a lookup steps over it)
_FIBONACCI = -7046029254386353131  # 2^64 / golden ratio as a signed int64 (0x9E3779B97F4A7C15)
_MIN_BITS = 10  # 1,024 buckets at least
_NO_CLAIM = torch.iinfo(torch.int32).max
WINDOW = 8  # buckets a probe reads per round (8 int64 keys: a cache line)


class DeviceIndex:
    """key -> slot (>= 0, < 2^31) on `device`, for up to half as many keys as it has buckets."""

    def __init__(self, device: torch.device, expected: int = 0):
        self.device = device
        self._live = 0  # keys held (host counters: every insert and removal says how many)
        self._tombstones = 0
        self._rounds = 1  # the most windows any key held needs to be found: a lookup's fixed rounds
        self._offsets = torch.arange(WINDOW, device=device)
        # the CPU gathers out the keys still probing each round; a GPU runs every key the fixed rounds
        self._compact = device.type != "cuda"
        self._allocate(_bits_for(expected))

    def __len__(self) -> int:
        return self._live

    @property
    def buckets(self) -> int:
        return 1 << self._bits

    @property
    def nbytes(self) -> int:
        """Device bytes: per bucket an int64 key, an int32 value and an int32 claim."""
        return DEVICE_INDEX_BUCKET_BYTES * self.buckets

    def _allocate(self, bits: int) -> None:
        self._bits = bits
        self._keys = torch.zeros(1 << bits, dtype=torch.int64, device=self.device)
        self._values = torch.full((1 << bits,), EMPTY, dtype=torch.int32, device=self.device)
        # insert's claims: the lowest position that reached each bucket in a round (reset after it)
        self._claims = torch.full((1 << bits,), _NO_CLAIM, dtype=torch.int32, device=self.device)
        self._tombstones, self._rounds = 0, 1

    def _home(self, keys: torch.Tensor) -> torch.Tensor:
        """Each key's first bucket: the top bits of key x 2^64/phi (Fibonacci hashing), as a logical
        shift of the wrapped int64 product."""
        shift = 64 - self._bits
        return ((keys * _FIBONACCI) >> shift) & ((1 << self._bits) - 1)

    # -- reading ---------------------------------------------------------------------------------

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """The slot of each of `keys` (int64[n] on this device), -1 where absent (int64[n])."""
        slots, _ = self._find(keys)
        return slots.long()

    def _window(self, bucket: torch.Tensor) -> torch.Tensor:
        """The buckets of each start's window: int64[m, WINDOW]."""
        return (bucket[:, None] + self._offsets) & (self.buckets - 1)

    def _find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot of each key or -1, its bucket or -1). On the CPU the keys still probing are gathered
        out each round (most are settled in the first); on a GPU every key takes the index's fixed
        number of rounds, so that nothing waits for the device."""
        slots = torch.full_like(keys, EMPTY, dtype=torch.int32)
        where = torch.full_like(keys, EMPTY)
        bucket = self._home(keys)
        if self._compact:
            # first the home bucket alone, where most keys are settled (found, or absent at an empty one)
            value = self._values.index_select(0, bucket)
            hit = (self._keys.index_select(0, bucket) == keys) & (value >= 0)
            found = torch.nonzero(hit).ravel()
            slots.index_copy_(0, found, value.index_select(0, found))
            where.index_copy_(0, found, bucket.index_select(0, found))
            active = torch.nonzero(~hit & (value != EMPTY)).ravel()
            probing, bucket = keys.index_select(0, active), bucket.index_select(0, active)
            for _ in range(self._rounds):
                if not len(active):
                    break
                hit, value, at, open_end = self._probe(probing, bucket)
                found = torch.nonzero(hit).ravel()
                into = active.index_select(0, found)
                slots.index_copy_(0, into, value.index_select(0, found))
                where.index_copy_(0, into, at.index_select(0, found))
                going_on = torch.nonzero(~hit & ~open_end).ravel()
                active, probing = active.index_select(0, going_on), probing.index_select(0, going_on)
                bucket = bucket.index_select(0, going_on) + WINDOW
            return slots, where
        settled = torch.zeros(len(keys), dtype=torch.bool, device=self.device)
        for _ in range(self._rounds):
            hit, value, at, open_end = self._probe(keys, bucket)
            hit &= ~settled
            slots = torch.where(hit, value, slots)
            where = torch.where(hit, at, where)
            settled |= hit | open_end
            bucket = bucket + WINDOW
        return slots, where

    def _probe(
        self, keys: torch.Tensor, bucket: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One round: each key's window from `bucket`. (found before an empty bucket, its value, its
        bucket, an empty bucket in the window: the key is absent unless found)."""
        window = self._window(bucket)
        flat = window.ravel()
        values = self._values.index_select(0, flat).view(window.shape)
        match = (self._keys.index_select(0, flat).view(window.shape) == keys[:, None]) & (values >= 0)
        empty = values == EMPTY
        first_match = torch.where(match.any(1), match.int().argmax(1), WINDOW)
        first_empty = torch.where(empty.any(1), empty.int().argmax(1), WINDOW)
        hit = first_match < first_empty
        pick = first_match.clamp(max=WINDOW - 1)[:, None]
        return hit, values.gather(1, pick).ravel(), window.gather(1, pick).ravel(), first_empty < WINDOW

    # -- writing ---------------------------------------------------------------------------------

    def insert(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Hold distinct `keys`, none held yet, at `slots` (int64[n] each, on this device)."""
        n = len(keys)
        if not n:
            return
        if 2 * (self._live + self._tombstones + n) > self.buckets:
            self._rebuild(self._live + n)
        self._place(keys, slots)
        self._live += n

    def remove(self, keys: torch.Tensor) -> None:
        """Forget `keys` (held ones; the others are ignored)."""
        _, where = self._find(keys)
        where = where[where >= 0]
        self._values[where] = TOMBSTONE
        gone = len(where)
        self._live -= gone
        self._tombstones += gone

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, slots: int64) of every key held, in bucket order."""
        held = torch.nonzero(self._values >= 0).ravel()
        return self._keys[held], self._values[held].long()

    def _rebuild(self, keys_to_hold: int) -> None:
        """A fresh map without tombstones, grown to hold `keys_to_hold` at load <= 1/2."""
        keys, slots = self.items()
        self._allocate(max(self._bits, _bits_for(keys_to_hold)))
        self._place(keys, slots)

    def _place(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Linear probing in rounds (see the module's docstring); keys distinct and absent."""
        position = torch.arange(len(keys), device=self.device)  # the keys still looking for a bucket
        start = self._home(keys)  # where each one's probe is: its home, or the bucket it lost last round
        reach = torch.zeros(len(keys), dtype=torch.int64, device=self.device)  # buckets past its home
        longest = 0
        while len(position):
            window = self._window(start)
            empty = self._values.index_select(0, window.ravel()).view(window.shape) == EMPTY
            has = empty.any(1)
            first = empty.int().argmax(1)
            full = torch.nonzero(~has).ravel()  # no empty bucket in the window: the next one
            start[full] += WINDOW
            reach[full] += WINDOW
            trying = torch.nonzero(has).ravel()
            at = (start.index_select(0, trying) + first.index_select(0, trying)) & (self.buckets - 1)
            candidates = position.index_select(0, trying)
            self._claims.scatter_reduce_(0, at, candidates.int(), "amin")
            won = self._claims.index_select(0, at) == candidates
            self._claims.index_fill_(0, at, _NO_CLAIM)
            winners, into = candidates[won], at[won]
            self._keys.index_copy_(0, into, keys.index_select(0, winners))
            self._values.index_copy_(0, into, slots.index_select(0, winners).int())
            reached = reach[trying[won]] + first[trying[won]]
            if len(reached):
                longest = max(longest, int(reached.max()))
            lost = trying[~won]  # look again from the bucket taken
            start[lost] = at[~won]
            reach[lost] += first[lost]
            placed = torch.zeros(len(position), dtype=torch.bool, device=self.device)
            placed[trying[won]] = True
            left = torch.nonzero(~placed).ravel()
            position, start, reach = position[left], start[left], reach[left]
        # a key `longest` buckets past its home is found in this many windows
        self._rounds = max(self._rounds, longest // WINDOW + 1)


def _bits_for(keys: int) -> int:
    """Bits of a bucket count that holds `keys` at load <= 1/2."""
    return max(_MIN_BITS, (2 * max(keys, 1) - 1).bit_length())
