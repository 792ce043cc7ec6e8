"""The pipeline's processes played out on the event engine (`sim_engine`): the runtime as the
simulator (`heterps_ray.costmodel.simulator`) models it, in per-stage times it has already derived.

* each replica of the first stage is a DataWorker: it reads a batch, pulls its sparse rows from the
  PS (blocking), runs stage 0 on each of ``K`` micro-batches and submits the calls of the other
  stages, keeps at most ``max_in_flight`` micro-batches in flight and submits backward calls
  ``max_in_flight - 1`` micro-batches behind their forwards (1F1B); it waits for the oldest
  micro-batch's gradient, runs stage 0's backward and pushes the sparse gradients;
* every other replica is a StageWorker actor: one call at a time, calls from one DataWorker in the
  order they were submitted, a call starting only when its input has arrived;
* M replicas of a stage feed N of the next by the runtime's round robin;
* PS shards are FIFO servers of limited rate, shared by all DataWorkers (contention);
* ``sync``: one pull per batch before its first micro-batch, one push after its last (the next
  batch's pull queues behind it on the shards: the barrier); the dense step rides on the last
  micro-batch. ``async``: a pull and a push per micro-batch, and with ``dense_push_ms`` set, each
  backward of a stage also pushes its dense gradients to a PS shard (waiting for the previous push).

Shared hosts (the problem's optional ``hosts``): every busy actor, PS request and Ray call on a host is
a job weighted by the threads it keeps busy (Ray's own work per call, ``call_cpu_ms``: weight 1); while
the weights exceed the host's free cores (``cores - background_cores``) every job progresses at
free cores / total weight of its solo speed (processor sharing), and the Amdahl stretch is not applied.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import pandas as pd

from heterps_ray.costmodel.sim_engine import Engine, Event, Process, SharedHost
from heterps_ray.costmodel.sim_models import PSModel, SimResult, StageModel

_SETTLE_PER_SHARD = 4  # async DataWorkers wait for sparse pushes beyond 4 per shard (runtime.workers)


def simulate_pipeline(
    stages: Sequence[StageModel],
    ps: PSModel,
    *,
    batch_size: int,
    batches: int = 40,
    micro_batches: int = 1,
    mode: Literal["sync", "async"] = "sync",
    max_in_flight: int | None = 4,
    startup_ms: float = 0.0,
    drain_every: int | None = None,
    hosts: Sequence[tuple[float, float]] = (),
) -> SimResult:
    """Run the event simulation of `batches` batches (over all DataWorkers) through `stages`;
    `hosts` are (cores, background cores) of the shared machines the stages' `host` index."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async' (got {mode!r})")
    if batches < 1 or micro_batches < 1:
        raise ValueError("batches and micro_batches must be >= 1")
    sim = _Simulation(
        list(stages), ps, batch_size, micro_batches, mode, max_in_flight, startup_ms, drain_every, hosts
    )
    sim.run(batches)
    return sim.result()


@dataclass
class _Call:
    """One actor call on a StageWorker: waits for `needs`, then takes `ms`, then fires `out`."""

    caller: int
    seq: int
    kind: str
    ms: float
    needs: Event | None
    out: Event
    batch: int
    micro: int


@dataclass
class _Micro:
    """A micro-batch in flight at its DataWorker."""

    batch: int
    micro: int
    route: list[int]
    grad: Event | None = None
    grad_from: int = 0  # the stage that sends `grad`


class _Simulation:
    def __init__(
        self,
        stages: list[StageModel],
        ps: PSModel,
        batch_size: int,
        micro_batches: int,
        mode: str,
        max_in_flight: int | None,
        startup_ms: float,
        drain_every: int | None,
        hosts: Sequence[tuple[float, float]] = (),
    ):
        self.stages, self.ps, self.mode = stages, ps, mode
        self.startup_ms, self.drain_every = startup_ms, drain_every
        self.sync = mode == "sync"
        self.batch_size, self.k = batch_size, micro_batches
        self.window = max_in_flight if max_in_flight is not None else 1 << 40
        self.engine = Engine()
        self.n = len(stages)
        self.busy_count = [0] * self.n  # replicas of each stage computing right now
        self.busy_ms = [0.0] * self.n
        self.hosts = [SharedHost(self.engine, cores, background) for cores, background in hosts]
        self.shard_queue: list[deque[tuple[float, str, int, int, Event]]] = [
            deque() for _ in range(max(ps.shards, 1))
        ]
        self.shard_idle = [True] * len(self.shard_queue)
        self.shard_wake = [Event() for _ in self.shard_queue]
        self.shard_busy_ms = 0.0
        self.spans: list[tuple[float, float, int, int, str, int, int]] = []
        self.queue_log: list[tuple[float, int, int, int]] = []
        self.in_flight = [0] * stages[0].replicas
        # StageWorkers: per replica, per caller, calls in submission order
        self.calls: list[list[dict[int, deque[_Call]]]] = [[{} for _ in range(st.replicas)] for st in stages]
        self.idle: list[list[bool]] = [[True] * st.replicas for st in stages]
        self.wake: list[list[Event]] = [[Event() for _ in range(st.replicas)] for st in stages]
        self._last_dense: dict[tuple[int, int], Event] = {}  # each replica's previous dense push
        self.samples_done = 0
        self.end_ms = 0.0
        self._seq = itertools.count()

    # -- running ---------------------------------------------------------------------------------
    def run(self, batches: int) -> None:
        workers = self.stages[0].replicas
        for shard in range(len(self.shard_queue)):
            self.engine.spawn(self._shard_server(shard))
        for s in range(1, self.n):
            for r in range(self.stages[s].replicas):
                self.engine.spawn(self._stage_worker(s, r))
        for w in range(workers):
            mine = len(range(w, batches, workers))  # batches are dealt to DataWorkers round-robin
            self.engine.spawn(self._data_worker(w, mine))
        self.engine.run()

    def _amdahl(self, stage: int) -> float:
        if self.stages[stage].host is not None:  # the shared host's cores model the contention
            return 1.0
        busy = self.busy_count[stage]  # including the caller
        return 1.0 + (busy - 1) * (1.0 - self.stages[stage].parallel_fraction)

    def _cpu(self, ms: float, threads: int, host: int | None) -> Process:
        """Take `ms` of solo time, on a shared host as one job weighted by `threads`."""
        if host is None:
            yield ms
        else:
            yield self.hosts[host].run(ms, threads)

    def _daemons(self, ms: float, host: int | None) -> None:
        """Ray's own processes (raylet, object store) working for a call: a message's latency is
        their CPU time, which on a shared host runs beside the actors and takes a core."""
        if host is not None and ms > 0:
            self.hosts[host].run(ms, 1)

    def _compute(self, stage: int, replica: int, ms: float, kind: str, batch: int, micro: int) -> Process:
        """Occupy a replica for `ms` (stretched by the replicas busy at once, or by its shared host)."""
        if ms <= 0:
            return
        self.busy_count[stage] += 1
        ms *= self._amdahl(stage)
        start = self.engine.now
        yield from self._cpu(ms, self.stages[stage].threads, self.stages[stage].host)
        self.busy_count[stage] -= 1
        self.busy_ms[stage] += self.engine.now - start
        self.spans.append((start, self.engine.now, stage, replica, kind, batch, micro))

    # -- the PS ----------------------------------------------------------------------------------
    def _ps(self, rows: float, pull: bool, batch: int, micro: int) -> Event:
        """A pull or push of `rows` rows, split evenly over the shards (FIFO each); done when all are."""
        if rows <= 0 or math.isinf(self.ps.rows_per_second_per_shard):
            done = Event()
            done.done = True
            return done
        part = self.ps.service_ms(rows, pull)
        parts = [
            self._enqueue(shard, part, "pull" if pull else "push", batch, micro)
            for shard in range(len(self.shard_queue))
        ]
        return self._all(parts)

    def _dense_push(self, stage: int, batch: int, micro: int) -> Event:
        """Async: one optimizer step of a stage's dense table on its PS shard (stage mod shards)."""
        shard = stage % len(self.shard_queue)
        return self._enqueue(shard, self.stages[stage].dense_push_ms, f"dense{stage}", batch, micro)

    def _enqueue(self, shard: int, ms: float, kind: str, batch: int, micro: int) -> Event:
        done = Event()
        self.shard_queue[shard].append((ms, kind, batch, micro, done))
        if self.shard_idle[shard] and not self.shard_wake[shard].done:
            self.engine.trigger(self.shard_wake[shard])
        return done

    def _all(self, events: list[Event]) -> Event:
        """An event that fires when every one of `events` has."""
        done = Event()
        waiting = [e for e in events if not e.done]
        if not waiting:
            done.done = True
            return done
        left = [len(waiting)]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.engine.trigger(done)

        for e in waiting:
            e.callbacks.append(one_done)
        return done

    def _shard_server(self, shard: int) -> Process:
        """One PS shard: requests in arrival order, one at a time."""
        queue = self.shard_queue[shard]
        while True:
            if not queue:
                self.shard_idle[shard] = True
                self.shard_wake[shard] = Event()
                yield self.shard_wake[shard]
                continue
            self.shard_idle[shard] = False
            ms, kind, batch, micro, done = queue.popleft()
            self._daemons(self.ps.call_cpu_ms, self.ps.host)
            start = self.engine.now
            if ms > 0:
                yield from self._cpu(ms, self.ps.threads, self.ps.host)
            self.shard_busy_ms += self.engine.now - start
            self.spans.append((start, self.engine.now, -1, shard, kind, batch, micro))
            self.engine.trigger(done)

    # -- StageWorkers ----------------------------------------------------------------------------
    def _submit(self, stage: int, replica: int, call: _Call) -> None:
        self.calls[stage][replica].setdefault(call.caller, deque()).append(call)
        self._log(stage)
        if call.needs is not None and not call.needs.done:
            call.needs.callbacks.append(lambda: self._poke(stage, replica))
        self._poke(stage, replica)

    def _poke(self, stage: int, replica: int) -> None:
        if self.idle[stage][replica] and not self.wake[stage][replica].done:
            self.engine.trigger(self.wake[stage][replica])

    def _next_call(self, stage: int, replica: int) -> _Call | None:
        """Among each caller's oldest call (Ray keeps one caller's calls in order), the earliest
        submitted whose input has arrived."""
        best: _Call | None = None
        for queue in self.calls[stage][replica].values():
            if queue and (queue[0].needs is None or queue[0].needs.done):
                if best is None or queue[0].seq < best.seq:
                    best = queue[0]
        if best is not None:
            self.calls[stage][replica][best.caller].popleft()
        return best

    def _stage_worker(self, stage: int, replica: int) -> Process:
        while True:
            call = self._next_call(stage, replica)
            if call is None:
                self.idle[stage][replica] = True
                self.wake[stage][replica] = Event()
                yield self.wake[stage][replica]
                continue
            self.idle[stage][replica] = False
            self._log(stage)
            self._daemons(self.stages[stage].call_cpu_ms, self.stages[stage].host)
            yield from self._compute(stage, replica, call.ms, call.kind, call.batch, call.micro)
            self.engine.trigger(call.out)
            dense_ms = self.stages[stage].dense_push_ms
            if not self.sync and dense_ms > 0 and call.kind != "forward":
                yield from self._dense_update(stage, replica, call)

    def _dense_update(self, stage: int, replica: int, call: _Call) -> Process:
        """Async: wait for this replica's previous dense push, then send the next (runtime.workers)."""
        key = (stage, replica)
        previous = self._last_dense.get(key)
        if previous is not None and not previous.done:
            yield previous
        self._last_dense[key] = self._dense_push(stage, call.batch, call.micro)

    # -- DataWorkers -----------------------------------------------------------------------------
    def _data_worker(self, worker: int, batches: int) -> Process:
        st0 = self.stages[0]
        fwd_q: deque[_Micro] = deque()
        bwd_q: deque[_Micro] = deque()
        pushes: deque[Event] = deque()
        lag = max(0, self.window - 1)
        counter = 0
        replicas = [st.replicas for st in self.stages[1:]]
        yield from self._compute(0, worker, self.startup_ms, "startup", -1, -1)
        for i in range(batches):
            batch = worker + i * st0.replicas
            if self.drain_every and i and i % self.drain_every == 0:  # the driver's chunk ends: drain
                yield from self._drain(worker, fwd_q, bwd_q, pushes)
            yield from self._compute(0, worker, st0.input_ms * self.k, "read", batch, -1)
            if self.sync:
                while pushes:  # the previous batch's sparse update lands before this pull
                    yield pushes.popleft()
                yield self._ps(self.ps.rows * self.k, True, batch, -1)
            for j in range(self.k):
                item = _Micro(batch, j, [(counter + worker) % k for k in replicas])
                counter += 1
                while len(fwd_q) + len(bwd_q) >= self.window:
                    if not bwd_q:
                        self._backward(worker, fwd_q.popleft(), bwd_q)
                    yield from self._finish(worker, bwd_q.popleft(), pushes)
                yield from self._forward(worker, item)
                fwd_q.append(item)
                self.in_flight[worker] = len(fwd_q) + len(bwd_q)
                self._log(0)
                if len(fwd_q) > lag:
                    self._backward(worker, fwd_q.popleft(), bwd_q)
            if self.sync:
                while fwd_q:
                    self._backward(worker, fwd_q.popleft(), bwd_q)
                while bwd_q:
                    yield from self._finish(worker, bwd_q.popleft(), pushes)
                yield from self._push(worker, self.ps.rows * self.k, batch, -1, pushes)
        yield from self._drain(worker, fwd_q, bwd_q, pushes)
        self.end_ms = max(self.end_ms, self.engine.now)

    def _drain(
        self, worker: int, fwd_q: deque[_Micro], bwd_q: deque[_Micro], pushes: deque[Event]
    ) -> Process:
        """Finish every micro-batch in flight and wait for every push (end of a DataWorker's run)."""
        while fwd_q:
            self._backward(worker, fwd_q.popleft(), bwd_q)
        while bwd_q:
            yield from self._finish(worker, bwd_q.popleft(), pushes)
        while pushes:
            yield pushes.popleft()

    def _push(self, worker: int, rows: float, batch: int, micro: int, pushes: deque[Event]) -> Process:
        """The DataWorker sums the gradients (its own work), then the shards apply them (not waited for)."""
        yield from self._compute(0, worker, self.ps.client_ms(rows), "push", batch, micro)
        pushes.append(self._ps(rows, False, batch, micro))

    def _forward(self, worker: int, item: _Micro) -> Process:
        st0 = self.stages[0]
        if not self.sync:
            yield self._ps(self.ps.rows, True, item.batch, item.micro)
        if self.n == 1:  # one-stage pipeline: the loss and backward run here too
            yield from self._compute(
                0, worker, st0.forward_ms + st0.backward_ms, "forward", item.batch, item.micro
            )
            return
        yield from self._compute(
            0, worker, st0.forward_ms + st0.send_forward_ms, "forward", item.batch, item.micro
        )
        ready: Event | None = None
        for s in range(1, self.n):
            ready = self.engine.after(ready, self._flight(s - 1, s))
            st = self.stages[s]
            last = s == self.n - 1
            ms = (
                st.call_ms
                + st.recv_forward_ms
                + st.forward_ms
                + (st.backward_ms + st.send_backward_ms if last else st.send_forward_ms)
            )
            out = Event()
            kind = "forward_backward" if last else "forward"
            self._submit(
                s,
                item.route[s - 1],
                _Call(worker, next(self._seq), kind, ms, ready, out, item.batch, item.micro),
            )
            ready = out
        item.grad, item.grad_from = ready, self.n - 1

    def _flight(self, a: int, b: int) -> float:
        """Latency of a message between stages a and b: in flight, not on either actor."""
        return self.stages[a].in_flight_ms + self.stages[b].in_flight_ms

    def _backward(self, worker: int, item: _Micro, bwd_q: deque[_Micro]) -> None:
        """Submit the backward calls of the middle stages, last to first (no waiting here)."""
        for s in range(self.n - 2, 0, -1):
            st = self.stages[s]
            ms = st.call_ms + st.recv_backward_ms + st.backward_ms + st.send_backward_ms
            out = Event()
            needs = self.engine.after(item.grad, self._flight(item.grad_from, s))
            self._submit(
                s,
                item.route[s - 1],
                _Call(worker, next(self._seq), "backward", ms, needs, out, item.batch, item.micro),
            )
            item.grad, item.grad_from = out, s
        bwd_q.append(item)

    def _finish(self, worker: int, item: _Micro, pushes: deque[Event]) -> Process:
        """Wait for the gradient, run stage 0's backward, push sparse gradients (async)."""
        st0 = self.stages[0]
        grad = self.engine.after(item.grad, self._flight(item.grad_from, 0)) if self.n > 1 else None
        if grad is not None and not grad.done:
            yield grad
        if self.n > 1:
            ms = st0.recv_backward_ms + st0.backward_ms
            yield from self._compute(0, worker, ms, "backward", item.batch, item.micro)
        if not self.sync:
            yield from self._push(worker, self.ps.rows, item.batch, item.micro, pushes)
            while len(pushes) > _SETTLE_PER_SHARD * len(self.shard_queue):
                yield pushes.popleft()
            if st0.dense_push_ms > 0:
                yield from self._dense_update(
                    0, worker, _Call(worker, 0, "backward", 0.0, None, Event(), item.batch, item.micro)
                )
        self.samples_done += self.batch_size // self.k
        self.in_flight[worker] -= 1
        self._log(0)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _log(self, stage: int) -> None:
        if stage == 0:
            queued = 0
            in_flight = sum(self.in_flight)
        else:
            queued = sum(len(q) for rep in self.calls[stage] for q in rep.values())
            in_flight = 0
        self.queue_log.append((self.engine.now, stage, queued, in_flight))

    def result(self) -> SimResult:
        makespan = self.end_ms
        throughput = self.samples_done / makespan * 1000.0 if makespan > 0 else math.inf
        utilisation = [
            self.busy_ms[s] / (self.stages[s].replicas * makespan) if makespan > 0 else 0.0
            for s in range(self.n)
        ]
        ps_util = self.shard_busy_ms / (len(self.shard_queue) * makespan) if makespan > 0 else 0.0
        spans = pd.DataFrame(
            self.spans, columns=["start_ms", "end_ms", "stage", "replica", "kind", "batch", "micro_batch"]
        ).sort_values("start_ms", kind="stable", ignore_index=True)
        queues = pd.DataFrame(self.queue_log, columns=["time_ms", "stage", "queued", "in_flight"])
        return SimResult(
            throughput, utilisation, ps_util, makespan, self.samples_done, spans, queues, list(self.stages)
        )


