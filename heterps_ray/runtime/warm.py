"""Warm actors: a run's actors outlive it, idle, so that the next run in this driver (a runtime probe of
the same profile, a re-plan of the closed loop, an elastic restart, the next ``train()``) reconfigures
them instead of starting new processes. An actor that imports torch and builds its layers takes
seconds to be ready; reconfiguring one takes milliseconds.

An idle actor is reused by an actor of the same class and the same Ray options (so the same resource
type), reconfigured with the new run's arguments (heterps_ray.reusable: nothing of the last run
survives). It is killed when a new actor needs the resources it holds, after IDLE_S unused, by
:func:`release_idle` (or :func:`release_types`, its type's), or with its Ray session. A dead idle actor
is dropped when it is next tried.

While a :func:`hold` is open (``heterps run`` holds one from its profile to its last re-plan) no idle
actor expires: a re-plan or an elastic restart minutes into a run finds the actors the profile and the
earlier plans left, of every type, and reconfigures them. New actors still make room as above, so a
held actor never keeps one of this driver's own from being placed; the idle time of every actor
starts again when the last hold closes.

Example::

    actor = spawn(StageWorker, options, stage, replica, model, settings)  # warm if one is idle
    blank = spawn(DataWorker, options)  # a process only: the profiler times layers in it first
    ...
    keep_warm(actor, StageWorker, options)  # instead of ray.kill, once the run is quiescent
    with hold():  # a whole `heterps run`: idle actors wait for its re-plans
        ...
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from heterps_ray.reusable import blank_class

# An idle actor holds its resources (a type's unit, CPU): killed after this long unused (unless held),
# so that a Tune trial or another driver's actor waiting for them waits at most this long.
IDLE_S = 20.0
RECONFIGURE_TIMEOUT_S = 30.0  # an idle actor that does not answer by then is taken for dead
_SWEEP_S = 1.0  # how often the idle list is checked for actors past IDLE_S


@dataclass
class _Idle:
    handle: Any
    key: str
    bundle: dict[str, float]
    since: float


class _Pool:
    """The idle actors of this driver's Ray session."""

    def __init__(self) -> None:
        self._idle: list[_Idle] = []
        self._session: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None
        self._holds = 0  # open hold()s: while any, no idle actor expires
        # actors this pool started, not yet known placed: (their ready ref, bundle). Ray's available
        # resources count an actor only once it is scheduled, so two spawned in a row would both see
        # the first one's resources free, and the second wait behind an idle actor forever
        self._starting: list[tuple[Any, dict[str, float]]] = []
        self.reused = 0  # actors reconfigured instead of started (counts(): what the tests check)
        self.started = 0

    def spawn(self, cls: type, options: dict[str, Any], *args: Any) -> Any:
        key = _key(cls, options)
        while (entry := self._take(key)) is not None:
            try:
                ray.get(entry.handle.reconfigure.remote(*args), timeout=RECONFIGURE_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                _kill(entry.handle)
                continue
            except BaseException:
                # its constructor raised (bad input): the error is the caller's, and the actor, emptied
                # by reconfigure, goes
                _kill(entry.handle)
                raise
            self.reused += 1
            return entry.handle
        bundle = _bundle(options)
        self._make_room(bundle)
        self.started += 1
        handle: Any = ray.remote(cls if args else blank_class(cls)).options(**options).remote(*args)
        with self._lock:
            self._starting.append((handle.__ray_ready__.remote(), bundle))
        return handle

    def keep(self, handle: Any, cls: type, options: dict[str, Any]) -> None:
        with self._lock:
            self._check_session()
            self._idle.append(_Idle(handle, _key(cls, options), _bundle(options), time.monotonic()))
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep, name="heterps-warm-actors", daemon=True)
                self._sweeper.start()

    def release(self, older_than: float = 0.0, unless_held: bool = False) -> int:
        """Kill the idle actors unused for `older_than` seconds (all by default; none while held when
        `unless_held`: the idle expiry); returns how many."""
        now = time.monotonic()
        return self._kill_where(lambda e: now - e.since >= older_than, skip_if_held=unless_held)

    def release_types(self, types: set[str]) -> int:
        """Kill the idle actors pinned to any of `types` (their type's custom resource); returns how many."""
        return self._kill_where(lambda e: bool(types & e.bundle.keys()))

    def _kill_where(self, going: Callable[[_Idle], bool], skip_if_held: bool = False) -> int:
        with self._lock:
            self._check_session()
            if skip_if_held and self._holds:
                return 0
            killed = [e for e in self._idle if going(e)]
            self._idle = [e for e in self._idle if not going(e)]
        for entry in killed:
            _kill(entry.handle)
        return len(killed)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                if self._holds == 0:  # idle from now on: a held actor gets its IDLE_S like any other
                    now = time.monotonic()
                    for entry in self._idle:
                        entry.since = now

    def _take(self, key: str) -> _Idle | None:
        with self._lock:
            self._check_session()
            for i, entry in enumerate(self._idle):
                if entry.key == key:
                    return self._idle.pop(i)
        return None

    def _make_room(self, bundle: dict[str, float]) -> None:
        """Kill idle actors (longest idle first) holding what a new actor asks for and Ray lacks."""
        free = dict(ray.available_resources())
        for demand in self._still_starting():  # counted as taken (some may be already: then a spare goes)
            for k, v in demand.items():
                free[k] = free.get(k, 0.0) - v
        short = {k: v - free.get(k, 0.0) for k, v in bundle.items() if v - free.get(k, 0.0) > 1e-9}
        if not short:
            return
        going = []
        with self._lock:
            for entry in list(self._idle):
                if not any(k in short for k in entry.bundle):
                    continue
                going.append(entry)
                self._idle.remove(entry)
                for k, v in entry.bundle.items():
                    if k in short:
                        short[k] -= v
                short = {k: v for k, v in short.items() if v > 1e-9}
                if not short:
                    break
        for entry in going:
            _kill(entry.handle)

    def _still_starting(self) -> list[dict[str, float]]:
        """The bundles of the actors this pool started that are not placed yet (forgetting the rest)."""
        with self._lock:
            self._check_session()
            starting = list(self._starting)
        if not starting:
            return []
        refs = [ref for ref, _ in starting]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        waiting = set(pending)
        with self._lock:
            self._starting = [(ref, b) for ref, b in self._starting if ref in waiting or ref not in refs]
        return [b for ref, b in starting if ref in waiting]

    def _check_session(self) -> None:
        """Forget handles of an earlier Ray session (ray.shutdown took those actors with it)."""
        session = _session()
        if session != self._session:
            self._idle, self._starting, self._session = [], [], session

    def _sweep(self) -> None:
        while True:
            time.sleep(_SWEEP_S)
            if ray.is_initialized():
                try:
                    self.release(older_than=IDLE_S, unless_held=True)
                except Exception:  # a Ray shutting down under the thread: the next sweep sees it
                    continue


_POOL = _Pool()


def spawn(cls: type, options: dict[str, Any], *args: Any) -> Any:
    """An actor of `cls` with Ray `options` built from `args` (none: a blank one, heterps_ray.reusable):
    an idle one reconfigured, else a new one (idle actors holding resources it needs are killed first)."""
    return _POOL.spawn(cls, options, *args)


def keep_warm(handle: Any, cls: type, options: dict[str, Any]) -> None:
    """Keep a quiescent actor (no call of its run in flight) for the next :func:`spawn` of its kind."""
    _POOL.keep(handle, cls, options)


def release_idle() -> int:
    """Kill every idle actor now (before work that needs their resources); returns how many."""
    return _POOL.release()


def release_types(types: Iterable[str]) -> int:
    """Kill the idle actors of these resource types now (types that left the cluster, or a plan on an
    autoscaling cluster that gives their nodes back); returns how many."""
    return _POOL.release_types(set(types))


def hold() -> contextlib.AbstractContextManager[None]:
    """``with hold():`` no idle actor expires inside the block (nested holds: until the last closes);
    new actors still make room, :func:`release_idle` and :func:`release_types` still kill."""
    return _POOL.hold()


def counts() -> dict[str, int]:
    """Actors reconfigured and actors started by :func:`spawn` in this driver."""
    return {"reused": _POOL.reused, "started": _POOL.started}


def _key(cls: type, options: dict[str, Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__} {json.dumps(options, sort_keys=True, default=str)}"


def _bundle(options: dict[str, Any]) -> dict[str, float]:
    bundle = {"CPU": options.get("num_cpus") or 0.0, "GPU": options.get("num_gpus") or 0.0}
    bundle.update(options.get("resources") or {})
    return {k: float(v) for k, v in bundle.items() if v}


def _session() -> tuple[str, str] | None:
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return context.gcs_address, context.get_job_id()


def _kill(handle: Any) -> None:
    try:
        ray.kill(handle)
    except Exception:  # already dead, or its Ray is gone
        pass
