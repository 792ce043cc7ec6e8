"""The PS shards as the driver's phases reach them, wherever they live: :class:`ShardHandle`, one
interface with two implementations chosen once when the actor set starts.

* :class:`RemoteShard` — a PSShard actor of its own: each method is the actor's method.
* :class:`HostedShard` — a PSShard object inside DataWorker 0's process (a plan with one DataWorker
  and no replicated stage): each method runs on it through ``DataWorker.on_shard``, on whichever
  DataWorker 0 is current (a recovery replaces it).

Every method returns an ObjectRef, so a phase gathers the shards' answers with one ``ray.get``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from heterps_ray.ps.shard import PSShard


class ShardHandle(Protocol):
    """One PS shard for the driver: snapshots (written by the shard itself, streamed), state, counts
    and the fence of a recovery."""

    def snapshot(self, path: str, delta: bool = False) -> Any: ...

    def snapshot_durable(self) -> Any: ...

    def pending_share(self) -> Any: ...

    def write_rows(self, path: str, table: str) -> Any: ...

    def restore_chain(self, paths: list[str]) -> Any: ...

    def state(self) -> Any: ...

    def load_state(self, state: dict[str, np.ndarray]) -> Any: ...

    def applied(self) -> Any: ...

    def stats(self) -> Any: ...

    def fence(self, generation: int) -> Any: ...


class RemoteShard:
    """A shard that is an actor of its own (`actor`: its handle, for placement, kills and dense tables)."""

    def __init__(self, actor: Any):
        self.actor = actor

    def snapshot(self, path: str, delta: bool = False) -> Any:
        return self.actor.snapshot.remote(path, delta)

    def snapshot_durable(self) -> Any:
        return self.actor.snapshot_durable.remote()

    def pending_share(self) -> Any:
        return self.actor.pending_share.remote()

    def write_rows(self, path: str, table: str) -> Any:
        return self.actor.write_rows.remote(path, table)

    def restore_chain(self, paths: list[str]) -> Any:
        return self.actor.restore_chain.remote(paths)

    def state(self) -> Any:
        return self.actor.state.remote()

    def load_state(self, state: dict[str, np.ndarray]) -> Any:
        return self.actor.load_state.remote(state)

    def applied(self) -> Any:
        return self.actor.applied.remote()

    def stats(self) -> Any:
        return self.actor.stats.remote()

    def fence(self, generation: int) -> Any:
        return self.actor.fence.remote(generation)


class HostedShard:
    """Shard `index` hosted in the process of the DataWorker that `host()` returns (DataWorker 0)."""

    def __init__(self, host: Callable[[], Any], index: int):
        self.host, self.index = host, index

    def _on(self, call: Callable[[PSShard], Any]) -> Any:
        return self.host().on_shard.remote(self.index, call)

    def snapshot(self, path: str, delta: bool = False) -> Any:
        return self._on(lambda shard: shard.snapshot(path, delta))

    def snapshot_durable(self) -> Any:
        return self._on(PSShard.snapshot_durable)

    def pending_share(self) -> Any:
        return self._on(PSShard.pending_share)

    def write_rows(self, path: str, table: str) -> Any:
        return self._on(lambda shard: shard.write_rows(path, table))

    def restore_chain(self, paths: list[str]) -> Any:
        return self._on(lambda shard: shard.restore_chain(paths))

    def state(self) -> Any:
        return self._on(PSShard.state)

    def load_state(self, state: dict[str, np.ndarray]) -> Any:
        return self._on(lambda shard: shard.load_state(state))

    def applied(self) -> Any:
        return self._on(PSShard.applied)

    def stats(self) -> Any:
        return self._on(PSShard.stats)

    def fence(self, generation: int) -> Any:
        return self._on(lambda shard: shard.fence(generation))
