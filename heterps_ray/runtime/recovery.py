"""Fault recovery: finds the dead actors, re-creates them with the same options, rolls every actor
back to the recovery point (the newest checkpoint, else the run's start kept in memory) and records
the fault. The caller replays the batches since the recovery point.

Sync mode ends with the model an undisturbed run gives; PS shards count the pushes they applied
per (DataWorker, batch), so the run summary proves no batch was lost or applied twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from heterps_ray.runtime.actors import READY_TIMEOUT_S, ActorSet
from heterps_ray.runtime.elastic import ResourcesChanged, present_types
from heterps_ray.runtime.faults import FaultRecord, TooManyFaults, how_it_died, is_actor_death
from heterps_ray.runtime.snapshots import Source, StateStore

SETTLE_TIMEOUT_S = 60.0  # after a fault: a DataWorker still busy by then is taken for hung
_PROBE_TIMEOUT_S = 30.0  # after a fault: an actor not answering a probe by then is taken for dead


@dataclass
class RecoveryPoint:
    """Where a fault rolls back to: the step, samples and number of losses kept, each DataWorker's
    progress, and the state's source (a checkpoint directory or the in-memory start state)."""

    step: int
    samples: int
    losses: int
    progress: dict[int, dict[str, int]]
    source: Source

    @property
    def checkpoint(self) -> Path | None:
        return self.source if isinstance(self.source, Path) else None


@dataclass
class Recovery:
    """Recovers a run's actors; counts the deaths against ``runtime.max_restarts``."""

    actors: ActorSet
    store: StateStore
    faults: list[FaultRecord] = field(default_factory=list)
    restarts: int = 0
    progress: dict[int, dict[str, int]] = field(default_factory=dict)  # per DataWorker, last boundary
    point: RecoveryPoint | None = None

    def mark(self, step: int, samples: int, losses: list[float], source: Source | str) -> None:
        """The current state (at `step`, in `source`) becomes the recovery point."""
        self.point = RecoveryPoint(
            step=step,
            samples=samples,
            losses=len(losses),
            progress={i: dict(p) for i, p in self.progress.items()},
            source=Path(source) if isinstance(source, str) else source,
        )

    def recover(
        self,
        exc: BaseException,
        hung: set[int],
        step: int,
        plan_types: set[str] | None,
        types_before: list[str],
        phase: str = "train",
    ) -> RecoveryPoint:
        """Re-create the dead actors, roll every actor back to the recovery point and record the fault.
        `hung`: DataWorkers whose chunk did not end after the fault. `plan_types` (elastic runs): raise
        ResourcesChanged when a dead actor's type has left the cluster. `phase`: what the run was doing
        (train, evaluate, save, ...). Returns the recovery point."""
        assert self.point is not None, "mark() a recovery point before training"
        point, actors, job = self.point, self.actors, self.actors.job
        t0 = time.perf_counter()
        dead = self._find_dead(hung)
        if not dead:
            raise exc
        self.restarts += len(dead)
        if self.restarts > job.runtime.max_restarts:
            names = ", ".join(f"{d['kind']} {d['stage']}/{d['replica']} ({d['how']})" for d in dead)
            raise TooManyFaults(
                f"{self.restarts} actor deaths, more than runtime.max_restarts="
                f"{job.runtime.max_restarts}; the last: {names}. Raise runtime.max_restarts or "
                "find why actors die (memory, preemption); resume with --resume from the newest checkpoint"
            ) from exc
        if plan_types is not None:
            now = present_types(job.cluster)
            gone = sorted({actors.type_of(d["kind"], d["stage"]) for d in dead} - set(now))
            if gone:
                raise ResourcesChanged(
                    f"actors of resource type(s) {gone} died and the type is gone",
                    types_before,
                    now,
                    point.step,
                    point.checkpoint,
                ) from exc
        at_fault = self._progress_now(dead)
        actors.replace(dead, _ReplacementWait(actors, point, plan_types, types_before).placed)
        self.store.roll_back_shards(point.source)
        actors.rewire()
        self.store.roll_back_actors(point.source)
        self.progress = {i: dict(p) for i, p in point.progress.items()}
        self.faults.append(
            FaultRecord(
                step=step,
                actors=[{k: v for k, v in d.items() if k != "handle"} for d in dead],
                rolled_back_to=point.step,
                recovery_point=str(point.checkpoint) if point.checkpoint else "start",
                recovery_s=time.perf_counter() - t0,
                batches_replayed=sum(at_fault[i]["position"] - point.progress[i]["position"] for i in point.progress),
                updates_lost=sum(at_fault[i]["updates"] - point.progress[i]["updates"] for i in point.progress),
                lower_bound=any(d["kind"] == "data_worker" for d in dead),
                phase=phase,
            )
        )  # fmt: skip
        return point

    def _find_dead(self, hung_workers: set[int]) -> list[dict[str, Any]]:
        """Probe every actor; the ones that do not answer (or whose chunk never ended) are dead."""
        everyone = self.actors.all_actors()
        probes = [a.describe.remote() for *_, a in everyone]
        ray.wait(probes, num_returns=len(probes), timeout=_PROBE_TIMEOUT_S)
        dead = []
        for (kind, stage, replica, handle), probe in zip(everyone, probes, strict=True):
            how = None
            try:
                ray.get(probe, timeout=0)
            except ray.exceptions.GetTimeoutError:
                how = "did not answer (hung)"
            except Exception as err:
                if not is_actor_death(err):
                    raise
                how = how_it_died(err)
            if how is None and kind == "data_worker" and replica in hung_workers:
                how = "its chunk did not end (hung)"
            if how is not None:
                dead.append({"kind": kind, "stage": stage, "replica": replica, "how": how, "handle": handle})
        return dead

    def _progress_now(self, dead: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
        """Each DataWorker's progress at the fault: asked of the live ones, the last known of the dead."""
        gone = {d["replica"] for d in dead if d["kind"] == "data_worker"}
        out = {i: dict(p) for i, p in self.progress.items()}
        out.update(self.actors.progress([i for i in range(self.actors.num_workers) if i not in gone]))
        return out


class _ReplacementWait:
    """Waits for re-created actors to be placed. With elastic re-planning on, a type of the plan that
    leaves the cluster meanwhile (its node died with the actors) raises ResourcesChanged instead of
    waiting for a placement that cannot come."""

    _POLL_S = 2.0

    def __init__(
        self, actors: ActorSet, point: RecoveryPoint, plan_types: set[str] | None, types_before: list[str]
    ):
        self.actors, self.point, self.plan_types, self.types_before = actors, point, plan_types, types_before

    def placed(self, actors: list[Any]) -> None:
        if not actors:
            return
        probes = [a.describe.remote() for a in actors]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, pending = ray.wait(probes, num_returns=len(probes), timeout=self._POLL_S)
            try:
                ray.get(ready)  # a replacement placed on a node that is dying raises here
            except Exception as err:
                if not is_actor_death(err) or self.plan_types is None:
                    raise
                for _ in range(10):  # the GCS may take a moment to drop the dead node's resources
                    self._check_types(err)
                    time.sleep(1.0)
                raise
            if not pending:
                return
            self._check_types(None)
        raise self.actors.not_placed()  # the ConfigError naming the demand (no second wait)

    def _check_types(self, cause: BaseException | None) -> None:
        """Elastic runs: raise ResourcesChanged when a type of the plan has left the cluster."""
        if self.plan_types is None:
            return
        now = present_types(self.actors.job.cluster)
        gone = sorted(self.plan_types - set(now))
        if gone:
            raise ResourcesChanged(
                f"resource type(s) {gone} of the plan disappeared (actors died with them)",
                self.types_before,
                now,
                self.point.step,
                self.point.checkpoint,
            ) from cause
