"""The two training modes as one seam, chosen once when a run starts (:func:`mode_of`): everything
in which sync and async differ sits in :class:`Sync` and :class:`Async`, and the workers and the
driver's phases ask the run's mode instead of testing it.

What differs:

* the plan: sync trains exactly like one process, so every stage has one replica;
* sparse rows: pulled and pushed per batch (sync) or per micro-batch, with batches overlapping up to
  ``runtime.batches_ahead`` (async), see sparse.py;
* dense weights: always in the worker (sync); on a PS shard for a stage with several replicas, and
  forwards run on a snapshot of the weights (weight stashing) where they stay local (async), see stage.py;
* the fence before a snapshot and after a restore: async replicas settle their last dense push, and
  take the restored weights from the PS;
* resuming into another plan: sync needs as many DataWorkers (each resumes its own partitions); async
  moves dense weights between workers and PS shards by layer name;
* the accounting: every batch applied exactly once on every shard (sync), or the updates sent (async).

A mode is plain data with methods (picklable): the same object travels to the actors inside
``WorkerSettings``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import ray

from heterps_ray.errors import ConfigError
from heterps_ray.runtime.faults import batch_accounting
from heterps_ray.runtime.sparse import PerBatch, PerMicroBatch, SparseLink, SparseSchedule


class Mode(ABC):
    """What one training mode decides; see the module docstring."""

    name = ""
    stashes_weights = False  # forwards may run ahead of the optimizer step: each keeps its weights
    moves_dense = False  # a checkpoint of another plan may keep a stage's weights elsewhere (worker/PS)

    def check_replicas(self, replicas: int, file: str | None, field: str) -> None:
        """Refuse a stage replica count this mode cannot train (ConfigError); any count by default."""
        return None

    def dense_home(self, replicas: int) -> str:
        """'local' (in the worker) or 'ps' (on a PS shard): where a stage's dense weights live."""
        return "local"

    @abstractmethod
    def sparse_schedule(self, sparse: SparseLink, busy: Any, batches_ahead: int) -> SparseSchedule:
        """When this mode pulls and pushes sparse rows (sparse.py)."""

    def settle_dense(self, workers: list[Any]) -> list[Any]:
        """Refs of the calls that bring the workers' dense weights to one version (before a snapshot,
        after a restore)."""
        return []

    def resumes_with(self, saved_workers: int | None, workers: int | None) -> bool:
        """Whether a checkpoint written by `saved_workers` DataWorkers resumes into `workers`."""
        return True

    @abstractmethod
    def accounting(
        self, shards: list[Any], positions: dict[int, int], progress: dict[int, dict[str, int]]
    ) -> dict[str, Any]:
        """The check that every batch was applied as this mode promises (faults.batch_accounting)."""


class Sync(Mode):
    """Numerically the reference trainer: one replica per stage, one batch at a time."""

    name = "sync"

    def check_replicas(self, replicas: int, file: str | None, field: str) -> None:
        if replicas != 1:
            raise ConfigError(
                file,
                field,
                "1 in sync mode (sync trains exactly like one process); set `mode: async` in the job for replicas",
                replicas,
            )

    def sparse_schedule(self, sparse: SparseLink, busy: Any, batches_ahead: int) -> SparseSchedule:
        return PerBatch(sparse, busy)

    def resumes_with(self, saved_workers: int | None, workers: int | None) -> bool:
        return saved_workers == workers

    def accounting(
        self, shards: list[Any], positions: dict[int, int], progress: dict[int, dict[str, int]]
    ) -> dict[str, Any]:
        """Batches applied exactly once on every PS shard, lost and duplicated (the shards' own counts)."""
        return batch_accounting(ray.get([s.applied() for s in shards]), positions)


class Async(Mode):
    """Paddle's a_sync: replicas without a barrier, one update per micro-batch, bounded staleness."""

    name = "async"
    stashes_weights = True
    moves_dense = True

    def dense_home(self, replicas: int) -> str:
        return "ps" if replicas > 1 else "local"

    def sparse_schedule(self, sparse: SparseLink, busy: Any, batches_ahead: int) -> SparseSchedule:
        return PerMicroBatch(sparse, busy, batches_ahead)

    def settle_dense(self, workers: list[Any]) -> list[Any]:
        return [w.refresh.remote() for w in workers]

    def accounting(
        self, shards: list[Any], positions: dict[int, int], progress: dict[int, dict[str, int]]
    ) -> dict[str, Any]:
        """The sparse updates the DataWorkers sent."""
        return {"updates": sum(p["updates"] for p in progress.values())}


MODES: dict[str, Mode] = {"sync": Sync(), "async": Async()}


def mode_of(name: str) -> Mode:
    """The mode named `name` (the job's ``mode``: sync or async, validated by the config)."""
    return MODES[name]
