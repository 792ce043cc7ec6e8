"""The workers' side of the parameter server: a :class:`PSClient` pulls and pushes rows across the
shards (ps/shard.py).

It de-duplicates keys, splits them by shard (a :class:`KeySplit`, computed once per batch and reused
by its pull and its push), sends one call per shard and reassembles the rows in the caller's order.
The shards are Ray actors, or, where a plan has a single DataWorker, :class:`PSShard` objects hosted
in that worker's own process (no call crosses a process then; see ``runtime.ps_hosting``). A single
hosted shard gets the batch's keys as they are: its table de-duplicates them and sums their gradients
in C, as the reference trainer's table does: 1.1-1.3 ms a Criteo batch where the split in numpy and
the pull and push took 1.8-2.0 ms (BENCHMARKS.md "The 4M-row epoch's gap, found").

Example::

    shards = start_shards(2, {"embedding": TableSpec(dim=9)}, actor_options={"num_cpus": 0.25})
    client = PSClient(shards)
    rows = client.pull("embedding", batch["keys"])          # float32[B, 26, 9]
    client.push("embedding", batch["keys"], grads)          # returns the per-shard ObjectRefs
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from heterps_ray.errors import WaitTimeout
from heterps_ray.ps.shard import PSShard
from heterps_ray.ps.spec import shard_of
from heterps_ray.ps.table import sum_rows

# A pull not answered by then: the shard is stuck, or was never placed (a profile's shard on a type whose
# units its own actors hold). A pull takes milliseconds; behind a snapshot of a big shard, seconds.
PULL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class KeySplit:
    """A batch's keys de-duplicated and split by shard: computed once (in a DataWorker's reader
    thread) and used by the batch's pull and its push."""

    shape: tuple[int, ...]
    unique: np.ndarray  # distinct keys, sorted
    inverse: np.ndarray  # keys.ravel() == unique[inverse]
    positions: list[np.ndarray] = field(default_factory=list)  # per shard: indices into `unique`


def split_keys(keys: np.ndarray, num_shards: int) -> KeySplit:
    """The :class:`KeySplit` of `keys` (any shape) over `num_shards` shards."""
    keys = np.asarray(keys)
    unique, inverse = np.unique(np.ascontiguousarray(keys, dtype=np.int64).ravel(), return_inverse=True)
    owner = shard_of(unique, num_shards)
    positions = [np.flatnonzero(owner == s) for s in range(num_shards)]
    return KeySplit(keys.shape, unique, inverse, positions)


class _ShardActors:
    """PSClient's shards as Ray actors: each call is a Ray call; what is asked is gathered, what is
    sent is left in flight (its refs returned)."""

    def __init__(self, handles: list[Any]):
        self.handles = handles

    def ask(self, method: str, calls: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
        refs = {s: getattr(self.handles[s], method).remote(*args) for s, args in calls.items()}
        try:
            answers = ray.get(list(refs.values()), timeout=PULL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WaitTimeout(
                f"PS shard(s) {sorted(refs)} did not answer a {method} within {PULL_TIMEOUT_S:.0f} s: stuck, "
                "or never placed (the units of their resource type all taken)"
            ) from None
        return dict(zip(refs, answers, strict=True))

    def send(self, method: str, calls: dict[int, tuple[Any, ...]]) -> list[Any]:
        return [getattr(self.handles[s], method).remote(*args) for s, args in calls.items()]

    def stats(self) -> list[dict[str, Any]]:
        return ray.get([h.stats.remote() for h in self.handles])

    def states(self) -> list[dict[str, np.ndarray]]:
        return ray.get([h.state.remote() for h in self.handles])


class _HostedShards:
    """PSClient's shards as PSShard objects of this process: plain calls, nothing serialised, and no
    call left in flight (applied on return)."""

    def __init__(self, shards: list[PSShard]):
        self.shards = shards

    def ask(self, method: str, calls: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
        return {s: getattr(self.shards[s], method)(*args) for s, args in calls.items()}

    def send(self, method: str, calls: dict[int, tuple[Any, ...]]) -> list[Any]:
        self.ask(method, calls)
        return []

    def stats(self) -> list[dict[str, Any]]:
        return [s.stats() for s in self.shards]

    def states(self) -> list[dict[str, np.ndarray]]:
        return [s.state() for s in self.shards]


class PSClient:
    """Pulls and pushes sparse rows across shards: one call per shard, keys de-duplicated.

    `shards` are PSShard actor handles, or with ``hosted=True`` PSShard objects of this process
    (called directly: nothing is serialised and no push is left in flight). Which of the two is
    decided here, once (:class:`_ShardActors` or :class:`_HostedShards`).
    """

    def __init__(self, shards: list[Any], hosted: bool = False):
        if not shards:
            raise ValueError("a PSClient needs at least one shard")
        self.shards = list(shards)
        self._link: _ShardActors | _HostedShards = (
            _HostedShards(self.shards) if hosted else _ShardActors(self.shards)
        )
        # one shard in this process: it takes the keys whole (repeats and all) and de-duplicates them
        self._whole: PSShard | None = self.shards[0] if hosted and len(self.shards) == 1 else None

    def split(self, keys: np.ndarray) -> KeySplit | None:
        """The keys' :class:`KeySplit`; None where nothing is split (one hosted shard)."""
        return None if self._whole is not None else split_keys(keys, len(self.shards))

    def pull(
        self,
        table: str,
        keys: np.ndarray,
        create: bool = True,
        split: KeySplit | None = None,
        step: int | None = None,
    ) -> np.ndarray:
        """Rows for `keys` of any shape: float32[*keys.shape, dim] (`split`: its precomputed split;
        `step`: the global batch index, for tables with admission or TTL)."""
        if self._whole is not None:
            rows = self._whole.pull(table, np.ravel(keys), create, False, step)
            return rows.reshape(*np.shape(keys), rows.shape[1])
        split = split or split_keys(keys, len(self.shards))
        parts = self._link.ask(
            "pull",
            {
                s: (table, split.unique[pos], create, True, step)
                for s, pos in enumerate(split.positions)
                if len(pos)
            }
        )
        dim = next(iter(parts.values())).shape[1]
        if len(parts) == 1:
            rows = next(iter(parts.values()))
        else:
            rows = np.empty((len(split.unique), dim), dtype=np.float32)
            for s, part in parts.items():
                rows[split.positions[s]] = part
        return rows[split.inverse].reshape(*split.shape, dim)

    def push(
        self,
        table: str,
        keys: np.ndarray,
        grads: np.ndarray,
        tag: tuple[int, int, int] | None = None,
        split: KeySplit | None = None,
    ) -> list[Any]:
        """Sum the gradients of equal keys here (float64), send each shard its part; returns refs
        (none for hosted shards: they have applied it on return). With a `tag` every shard gets a
        call (maybe with no keys), so each counts the batch."""
        if self._whole is not None:
            self._whole.push(table, np.ravel(keys), grads, tag, False)
            return []
        split = split or split_keys(keys, len(self.shards))
        summed = sum_rows(split.inverse, grads, len(split.unique))
        return self._link.send(
            "push",
            {
                s: (table, split.unique[pos], summed[pos], tag, True)
                for s, pos in enumerate(split.positions)
                if len(pos) or tag is not None
            }
        )

    def fetch_rows(
        self, table: str, keys: np.ndarray, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whole rows of distinct `keys` for a tier above (PSShard.fetch_rows), in the keys' order:
        (weights float32[n, dim], accumulators, admitted bool[n])."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        owner = shard_of(keys, len(self.shards))
        positions = {s: np.flatnonzero(owner == s) for s in range(len(self.shards))}
        parts = self._link.ask(
            "fetch_rows", {s: (table, keys[pos], step) for s, pos in positions.items() if len(pos)}
        )
        if len(parts) == 1:
            return next(iter(parts.values()))
        weights, accum, admitted = (np.asarray(a) for a in next(iter(parts.values())))
        out = (
            np.empty((len(keys), weights.shape[1]), np.float32),
            np.empty((len(keys), accum.shape[1]), np.float32),
            np.empty(len(keys), bool),
        )
        for s, part in parts.items():
            for whole, piece in zip(out, part, strict=True):
                whole[positions[s]] = piece
        return out

    def put_rows(
        self,
        table: str,
        keys: np.ndarray,
        weights: np.ndarray,
        accumulators: np.ndarray,
        tags: list[tuple[int, int, int]],
    ) -> list[Any]:
        """Write rows back to their shards (PSShard.put_rows); every shard gets a call, so each counts
        the batches of `tags`. Returns refs (none for hosted shards: written on return)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        owner = shard_of(keys, len(self.shards))
        calls = {}
        for s in range(len(self.shards)):
            pos = np.flatnonzero(owner == s)
            calls[s] = (table, keys[pos], weights[pos], accumulators[pos], tags)
        return self._link.send("put_rows", calls)

    def stats(self) -> list[dict[str, Any]]:
        return self._link.stats()

    def states(self) -> list[dict[str, np.ndarray]]:
        return self._link.states()
