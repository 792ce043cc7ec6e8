"""The simulator's event engine: processes are generators that yield a delay (ms) or an Event to wait
on; a shared host runs CPU jobs under processor sharing. Nothing here knows about the runtime: the
runtime's model of DataWorkers, StageWorkers and PS shards is heterps_ray.costmodel.simulator."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator
from typing import Any

Process = Generator[Any, None, None]


class Event:
    """Something that happens once (a call's result, a PS request served); callbacks run then."""

    __slots__ = ("done", "callbacks", "time")

    def __init__(self) -> None:
        self.done = False
        self.callbacks: list[Callable[[], None]] = []
        self.time = 0.0  # when it happened (once done)


class Engine:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), action))

    def trigger(self, event: Event) -> None:
        event.done = True
        event.time = self.now
        callbacks, event.callbacks = event.callbacks, []
        for cb in callbacks:
            self.at(self.now, cb)

    def after(self, event: Event | None, delay: float) -> Event | None:
        """An event `delay` ms after `event` happens (after now when `event` is None)."""
        if delay <= 0:
            return event
        later = Event()
        if event is None:
            self.at(self.now + delay, lambda: self.trigger(later))
        elif event.done:
            self.at(max(self.now, event.time + delay), lambda: self.trigger(later))
        else:
            event.callbacks.append(lambda: self.at(self.now + delay, lambda: self.trigger(later)))
        return later

    def event_at(self, time: float) -> Event:
        event = Event()
        self.at(time, lambda: self.trigger(event))
        return event

    def spawn(self, process: Process) -> None:
        self._step(process)

    def _step(self, process: Process) -> None:
        try:
            command = next(process)
        except StopIteration:
            return
        if isinstance(command, Event):
            if command.done:
                self.at(self.now, lambda: self._step(process))
            else:
                command.callbacks.append(lambda: self._step(process))
        else:
            self.at(self.now + float(command), lambda: self._step(process))

    def run(self) -> None:
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()


class SharedHost:
    """Processor sharing of one machine's cores: each running job has a weight (the threads its
    actor keeps busy); while the weights add up to more than the free cores (`cores` less the
    `background`), every job progresses at free cores / total weight of its solo speed."""

    def __init__(self, engine: Engine, cores: float, background: float):
        self.engine = engine
        self.free = max(cores - background, 1e-6)
        self.jobs: dict[int, list[Any]] = {}  # id -> [remaining solo ms, weight, done event]
        self._ids = itertools.count()
        self._last = 0.0
        self._token = 0

    def rate(self) -> float:
        weight = sum(job[1] for job in self.jobs.values())
        return 1.0 if weight <= self.free else self.free / weight

    def run(self, ms: float, weight: float) -> Event:
        """A job of `ms` solo milliseconds; the event fires when it is done."""
        self._advance()
        done = Event()
        self.jobs[next(self._ids)] = [ms, weight, done]
        self._reschedule()
        return done

    def _advance(self) -> None:
        elapsed = (self.engine.now - self._last) * self.rate()
        for job in self.jobs.values():
            job[0] -= elapsed
        self._last = self.engine.now

    def _reschedule(self) -> None:
        self._token += 1
        if self.jobs:
            token = self._token
            first = min(job[0] for job in self.jobs.values())
            self.engine.at(self.engine.now + max(first, 0.0) / self.rate(), lambda: self._finish(token))

    def _finish(self, token: int) -> None:
        if token != self._token:  # the set of jobs changed since this was scheduled
            return
        self._advance()
        for key in [k for k, job in self.jobs.items() if job[0] <= 1e-9]:
            self.engine.trigger(self.jobs.pop(key)[2])
        self._reschedule()
