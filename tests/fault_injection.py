"""Fault injection for the fault tests and the chaos benchmark: kill one actor of a running job
mid-chunk, through ``driver.train``'s ``on_chunk`` hook."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import ray


class ActorKiller:
    """Fault injection, an ``on_chunk`` hook of ``driver.train``: at the first chunk boundary it picks
    the first actor of `kind` (ps_shard | data_worker | stage_worker), then a thread kills it, by
    `method` ("ray.kill" or "sigkill" of its process), once the last PS shard has applied `after`
    pushes: while the DataWorkers are mid-chunk. `killed_at` is the push count it struck at."""

    def __init__(self, kind: str, method: str, after: int, timeout_s: float = 300.0):
        self.kind, self.method, self.after, self.timeout_s = kind, method, after, timeout_s
        self.thread: threading.Thread | None = None
        self.killed_at: int | None = None

    def __call__(self, live: Any) -> None:
        if self.thread is not None:
            return
        victim = {  # lazily: a plan whose shards are hosted in DataWorker 0 has no shard actors
            "ps_shard": lambda: live.shards[0],
            "data_worker": lambda: live.data_workers[0],
            "stage_worker": lambda: live.stage_workers[0][0],
        }[self.kind]()
        pid = ray.get(victim.describe.remote())["pid"]
        watched = live.ps[-1]  # never the victim unless the plan has a single shard
        self.thread = threading.Thread(target=self._strike, args=(victim, pid, watched), daemon=True)
        self.thread.start()

    def _strike(self, victim: Any, pid: int, watched: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            pushes = int(ray.get(watched.stats())["pushes"])
            if pushes >= self.after:
                break
            time.sleep(0.002)
        self.killed_at = pushes
        if self.method == "ray.kill":
            ray.kill(victim, no_restart=True)
        else:
            os.kill(pid, signal.SIGKILL)


class PhaseKiller:
    """An ``on_chunk`` hook that arms one actor (heterps_ray.chaos.FaultPoints) at the first chunk
    boundary from step `at` on, so that it dies inside its next call of phase `point` (checkpoint,
    evaluate, save, ...): by "sigkill" of its own process, or by "ray.kill" from a thread here once the
    actor signals that it is inside the call. `victim` picks the actor from the LiveActors."""

    def __init__(self, kind: str, point: str, method: str, at: int, flag_dir: str):
        self.kind, self.point, self.method, self.at, self.flag_dir = kind, point, method, at, flag_dir
        self.armed_at: int | None = None
        self.struck = threading.Event()

    def __call__(self, live: Any) -> None:
        if self.armed_at is not None or live.step < self.at:
            return
        victim = {  # lazily: a plan whose shards are hosted in DataWorker 0 has no shard actors
            "ps_shard": lambda: live.shards[0],
            "data_worker": lambda: live.data_workers[0],
            "stage_worker": lambda: live.stage_workers[0][0] if live.stage_workers else None,
        }[self.kind]()
        flag = os.path.join(self.flag_dir, f"{self.kind}-{self.point}.flag")
        how = "sigkill" if self.method == "sigkill" else "wait"
        ray.get(victim.arm_fault.remote(self.point, how, flag))
        self.armed_at = live.step
        if how == "wait":
            threading.Thread(target=self._kill_when_inside, args=(victim, flag), daemon=True).start()

    def _kill_when_inside(self, victim: Any, flag: str) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not os.path.exists(flag):
            time.sleep(0.01)
        ray.kill(victim, no_restart=True)
        self.struck.set()
