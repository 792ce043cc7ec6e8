"""Actor faults during training: telling an actor's death from a bug, describing how it died, what
each recovery did, and the count that proves a sync run applied every batch exactly once.

The driver recovers (recovery.py): it finds the dead actors, re-creates them with the same
actor options, rolls every actor back to the newest recovery point (a checkpoint, else the run's
start) and replays the batches since it. See :class:`FaultRecord` for what the run summary lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from heterps_ray.errors import HeterPSError

EXIT_TOO_MANY_FAULTS = 1


class TooManyFaults(HeterPSError):
    """More actors died than ``runtime.max_restarts`` allows."""

    category = "faults"
    exit_code = EXIT_TOO_MANY_FAULTS


@dataclass
class FaultRecord:
    """One recovery: which actors died and how, at which step, and what it cost."""

    step: int  # batches the driver had counted when the fault surfaced
    actors: list[dict[str, Any]]  # {"kind": ps_shard|data_worker|stage_worker, "stage", "replica", "how"}
    rolled_back_to: int  # the step of the recovery point
    recovery_point: str  # a checkpoint directory, or "start" (the run's in-memory start state)
    recovery_s: float  # from the fault surfacing to the actors being ready again
    batches_replayed: int  # batches trained after the recovery point, trained again
    updates_lost: int  # sparse updates applied after the recovery point that the restore discarded
    lower_bound: bool  # a DataWorker died mid-chunk: the two counts above are at least these
    phase: str = (
        "train"  # what the run was doing: train, or a phase after the last batch (evaluate, save, ...)
    )


_DEATHS = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


def is_actor_death(exc: BaseException) -> bool:
    """True when `exc` comes from a dead actor (directly, or through the task that called it)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _DEATHS):
            return True
        if isinstance(current, ray.exceptions.RayTaskError):
            cause = getattr(current, "cause", None)
            if isinstance(cause, _DEATHS):
                return True
            current = cause
            continue
        current = current.__cause__
    return False


def how_it_died(exc: BaseException) -> str:
    """A short reason from Ray's error text: killed by ray.kill, its process died, its node died."""
    text = str(exc).lower()
    if "ray.kill" in text:
        return "killed by ray.kill"
    if "node" in text and ("died" in text or "dead" in text) and "worker" not in text:
        return "its node died"
    if "sigkill" in text or "exit" in text or "process" in text or "worker" in text:
        return "its worker process died"
    return type(exc).__name__


def batch_accounting(applied: list[dict[int, np.ndarray]], positions: dict[int, int]) -> dict[str, int]:
    """From every PS shard's applied-push counts per (DataWorker, batch) and each DataWorker's
    position (batches trained): batches applied exactly once on every shard, lost, duplicated."""
    applied_once = lost = duplicated = 0
    for worker, position in positions.items():
        counts = np.zeros((len(applied), position), dtype=np.int64)
        for s, shard in enumerate(applied):
            mine = shard.get(worker, np.zeros(0, dtype=np.int64))[:position]
            counts[s, : len(mine)] = mine
            extra = shard.get(worker, np.zeros(0, dtype=np.int64))[position:]
            duplicated += int((extra > 0).sum())  # pushes for batches never trained: replayed twice
        applied_once += int((counts == 1).all(axis=0).sum())
        lost += int((counts == 0).any(axis=0).sum())
        duplicated += int((counts > 1).any(axis=0).sum())
    return {"batches_applied": applied_once, "batches_lost": lost, "batches_duplicated": duplicated}
