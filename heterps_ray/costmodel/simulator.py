"""A discrete-event simulation of a plan running as the runtime (heterps_ray.runtime) runs it.

Where the analytic model (DESIGN.md §3) takes the slowest stage, this plays the pipeline out in time:

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

Times come from the problem: a layer takes ``fixed + per_sample · b`` ms at micro-batch size ``b``
(split forward/backward by `forward_fraction`); each side of a boundary spends ``bytes / bandwidth +
latency`` per message; a DataWorker reads ``input_bytes_per_sample · B`` at its io bandwidth per
batch. With ``n`` replicas of a stage busy at once a call takes ``1 + (n-1)(1-α)`` times longer:
Amdahl's law of DESIGN.md §3 when all replicas are busy.

Example::

    result = simulate(problem, plan, batches=50, mode="sync", micro_batches=4)
    result.throughput, result.summary(), result.queues   # samples/s, per stage, DataFrame over time
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from heterps_ray.costmodel.problem import Layer, Problem, Resource
from heterps_ray.errors import ConfigError

_BYTES_PER_MS_PER_GBPS = 125_000.0  # 1 Gbit/s = 125,000 bytes/ms (DESIGN.md §3)
_SETTLE_PER_SHARD = 4  # async DataWorkers wait for sparse pushes beyond 4 per shard (runtime.workers)


@dataclass(frozen=True)
class StageModel:
    """One stage as the simulator sees it: ms per micro-batch of `b` samples (one replica, alone)."""

    resource: str
    replicas: int
    forward_ms: float  # compute only
    backward_ms: float  # compute only (with the optimizer step)
    recv_forward_ms: float = 0.0  # one side of the activation message from the previous stage
    send_forward_ms: float = 0.0  # one side of the activation message to the next stage
    recv_backward_ms: float = 0.0  # one side of the gradient message from the next stage
    send_backward_ms: float = 0.0  # one side of the gradient message to the previous stage
    input_ms: float = 0.0  # first stage: reading one micro-batch worth of input
    parallel_fraction: float = 1.0
    dense_push_ms: float = 0.0  # async: PS service time of one push of this stage's dense gradients


@dataclass(frozen=True)
class PSModel:
    """The PS tier: `shards` FIFO servers; a micro-batch pulls and pushes `rows` rows."""

    shards: int
    rows: float  # sparse rows per micro-batch (before de-duplication, as the rate is measured)
    rows_per_second_per_shard: float  # of pull + push together, as the problem file gives it
    pull_share: float = 0.5  # fraction of a row's service time spent on its pull
    push_client_share: float = 0.0  # fraction of a push done by the DataWorker itself (summing gradients)

    def service_ms(self, rows: float, pull: bool) -> float:
        """One shard's time for its part (1/shards) of a request of `rows` rows."""
        share = self.pull_share if pull else (1.0 - self.pull_share) * (1.0 - self.push_client_share)
        return rows / self.shards * share / self.rows_per_second_per_shard * 1000.0

    def client_ms(self, rows: float) -> float:
        """The DataWorker's own work for a push of `rows` rows (before it goes to the shards)."""
        return (
            rows * (1.0 - self.pull_share) * self.push_client_share / self.rows_per_second_per_shard * 1000.0
        )


@dataclass
class SimResult:
    """Throughput (samples/s: all samples over the whole run, as the runtime measures it),
    per-stage utilisation and the timelines."""

    throughput: float
    utilisation: list[float]  # per stage: busy time / (replicas · makespan)
    ps_utilisation: float
    makespan_ms: float
    samples: int
    spans: pd.DataFrame  # start_ms, end_ms, stage (-1: PS), replica, kind, batch, micro_batch
    queues: pd.DataFrame  # time_ms, stage, queued (calls waiting at the stage), in_flight (DataWorkers')
    stages: list[StageModel] = field(default_factory=list)

    def summary(self) -> pd.DataFrame:
        """Per-stage table: type, replicas, utilisation, time-averaged and peak queue depth."""
        rows = []
        for s, stage in enumerate(self.stages):
            q = self.queues[self.queues["stage"] == s]
            rows.append(
                {
                    "stage": s,
                    "type": stage.resource,
                    "replicas": stage.replicas,
                    "utilisation": self.utilisation[s],
                    "mean_queue": _time_average(q, "queued", self.makespan_ms),
                    "max_queue": int(q["queued"].max()) if len(q) else 0,
                    "max_in_flight": int(q["in_flight"].max()) if len(q) else 0,
                }
            )
        return pd.DataFrame(rows)


def simulate(
    problem: Problem,
    plan: Any,
    *,
    batches: int = 40,
    micro_batches: int = 1,
    mode: Literal["sync", "async"] = "sync",
    max_in_flight: int | None = 4,
    forward_fraction: float = 1.0 / 3.0,
    ps_limit: bool = True,
    pull_share: float = 0.5,
    push_client_share: float = 0.0,
    dense_ms_per_param: float = 0.0,
    dense_params: Mapping[str, int] | None = None,
    startup_ms: float = 0.0,
    drain_every: int | None = None,
) -> SimResult:
    """Simulate `plan` (a Plan or its JSON mapping) on `problem` for `batches` batches.

    `max_in_flight` None is unbounded; `ps_limit` False gives the PS infinite rate. The rest are
    runtime details a profile measures (:func:`heterps_ray.profiling.fit.simulator_options`): the
    pull's share of PS time, the share of a push done by the DataWorker itself, async dense pushes
    (`dense_ms_per_param` x `dense_params` per layer name), a DataWorker's one-time start-up before
    its first batch, and `drain_every` (the runtime's driver drains the pipeline every 20 batches).
    """
    stages, ps = pipeline_model(
        problem, plan, micro_batches, forward_fraction, dense_ms_per_param, dense_params or {}
    )
    rate = ps.rows_per_second_per_shard if ps_limit else math.inf
    ps = PSModel(ps.shards, ps.rows, rate, pull_share, push_client_share)
    return simulate_pipeline(
        stages,
        ps,
        batch_size=problem.batch_size,
        batches=batches,
        micro_batches=micro_batches,
        mode=mode,
        max_in_flight=max_in_flight,
        startup_ms=startup_ms,
        drain_every=drain_every,
    )


def pipeline_model(
    problem: Problem,
    plan: Any,
    micro_batches: int = 1,
    forward_fraction: float = 1.0 / 3.0,
    dense_ms_per_param: float = 0.0,
    dense_params: Mapping[str, int] | None = None,
) -> tuple[list[StageModel], PSModel]:
    """Per-micro-batch stage times and the PS tier of `plan` on `problem`, in DESIGN.md §3 terms."""
    plan_map = _plan_mapping(plan)
    b = problem.batch_size / micro_batches
    layers = problem.layers
    raw_stages = list(plan_map["stages"])
    if not raw_stages:
        raise ConfigError(None, "plan.stages", "at least one stage")
    stage_layers = [[_layer_index(x, problem.layer_names) for x in s["layers"]] for s in raw_stages]
    params = dense_params or {}

    def message_ms(layer: int, rtype: Resource) -> float:
        """One side of one message (activation or gradient) after `layer`, at micro-batch size b."""
        wire_ms = layers[layer].out_bytes_per_sample * b / (rtype.bandwidth_gbps * _BYTES_PER_MS_PER_GBPS)
        return wire_ms + rtype.latency_ms

    stages = []
    for s, raw in enumerate(raw_stages):
        rtype = problem.resource(raw["type"])
        idx = stage_layers[s]
        times = [_layer_ms(layers[i], rtype.name, b) for i in idx]
        compute = float(sum(times))
        alphas = [layers[i].parallel_fraction for i in idx]
        alpha = float(np.average(alphas, weights=times)) if compute > 0 else 1.0
        recv = message_ms(stage_layers[s - 1][-1], rtype) if s > 0 else 0.0
        send = message_ms(idx[-1], rtype) if s < len(raw_stages) - 1 else 0.0
        input_ms = (
            problem.input_bytes_per_sample * b / (rtype.io_gbps * _BYTES_PER_MS_PER_GBPS) if s == 0 else 0.0
        )
        stage_params = sum(int(params.get(layers[i].name, 0)) for i in idx)
        stages.append(
            StageModel(
                resource=rtype.name,
                replicas=int(raw.get("replicas", 1)),
                forward_ms=compute * forward_fraction,
                backward_ms=compute * (1.0 - forward_fraction),
                recv_forward_ms=recv,
                send_forward_ms=send,
                recv_backward_ms=send,
                send_backward_ms=recv,
                input_ms=input_ms,
                parallel_fraction=alpha,
                dense_push_ms=stage_params * dense_ms_per_param,
            )
        )
    rows = b * sum(layer.sparse_rows_per_sample for layer in layers)
    shards = int(plan_map.get("ps_shards") or problem.ps.min_shards)
    return stages, PSModel(shards=shards, rows=rows, rows_per_second_per_shard=problem.ps_rows_per_second)


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
) -> SimResult:
    """Run the event simulation of `batches` batches (over all DataWorkers) through `stages`."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async' (got {mode!r})")
    if batches < 1 or micro_batches < 1:
        raise ValueError("batches and micro_batches must be >= 1")
    sim = _Simulation(
        list(stages), ps, batch_size, micro_batches, mode, max_in_flight, startup_ms, drain_every
    )
    sim.run(batches)
    return sim.result()


# ---------------------------------------------------------------------------------------------
# A minimal process engine: a process is a generator yielding a delay (ms) or an _Event to wait on.

_Process = Generator[Any, None, None]


class _Event:
    """Something that happens once (a call's result, a PS request served); callbacks run then."""

    __slots__ = ("done", "callbacks")

    def __init__(self) -> None:
        self.done = False
        self.callbacks: list[Callable[[], None]] = []


class _Engine:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), action))

    def trigger(self, event: _Event) -> None:
        event.done = True
        callbacks, event.callbacks = event.callbacks, []
        for cb in callbacks:
            self.at(self.now, cb)

    def event_at(self, time: float) -> _Event:
        event = _Event()
        self.at(time, lambda: self.trigger(event))
        return event

    def spawn(self, process: _Process) -> None:
        self._step(process)

    def _step(self, process: _Process) -> None:
        try:
            command = next(process)
        except StopIteration:
            return
        if isinstance(command, _Event):
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


@dataclass
class _Call:
    """One actor call on a StageWorker: waits for `needs`, then takes `ms`, then fires `out`."""

    caller: int
    seq: int
    kind: str
    ms: float
    needs: _Event | None
    out: _Event
    batch: int
    micro: int


@dataclass
class _Micro:
    """A micro-batch in flight at its DataWorker."""

    batch: int
    micro: int
    route: list[int]
    grad: _Event | None = None


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
    ):
        self.stages, self.ps, self.mode = stages, ps, mode
        self.startup_ms, self.drain_every = startup_ms, drain_every
        self.sync = mode == "sync"
        self.batch_size, self.k = batch_size, micro_batches
        self.window = max_in_flight if max_in_flight is not None else 1 << 40
        self.engine = _Engine()
        self.n = len(stages)
        self.busy_count = [0] * self.n  # replicas of each stage computing right now
        self.busy_ms = [0.0] * self.n
        self.shard_free = [0.0] * max(ps.shards, 1)
        self.shard_busy_ms = 0.0
        self.spans: list[tuple[float, float, int, int, str, int, int]] = []
        self.queue_log: list[tuple[float, int, int, int]] = []
        self.in_flight = [0] * stages[0].replicas
        # StageWorkers: per replica, per caller, calls in submission order
        self.calls: list[list[dict[int, deque[_Call]]]] = [[{} for _ in range(st.replicas)] for st in stages]
        self.idle: list[list[bool]] = [[True] * st.replicas for st in stages]
        self.wake: list[list[_Event]] = [[_Event() for _ in range(st.replicas)] for st in stages]
        self._last_dense: dict[tuple[int, int], _Event] = {}  # each replica's previous dense push
        self.samples_done = 0
        self.end_ms = 0.0
        self._seq = itertools.count()

    # -- running ---------------------------------------------------------------------------------
    def run(self, batches: int) -> None:
        workers = self.stages[0].replicas
        for s in range(1, self.n):
            for r in range(self.stages[s].replicas):
                self.engine.spawn(self._stage_worker(s, r))
        for w in range(workers):
            mine = len(range(w, batches, workers))  # batches are dealt to DataWorkers round-robin
            self.engine.spawn(self._data_worker(w, mine))
        self.engine.run()

    def _amdahl(self, stage: int) -> float:
        busy = self.busy_count[stage]  # including the caller
        return 1.0 + (busy - 1) * (1.0 - self.stages[stage].parallel_fraction)

    def _compute(self, stage: int, replica: int, ms: float, kind: str, batch: int, micro: int) -> _Process:
        """Occupy a replica for `ms` (stretched by the replicas busy at once)."""
        if ms <= 0:
            return
        self.busy_count[stage] += 1
        ms *= self._amdahl(stage)
        start = self.engine.now
        yield ms
        self.busy_count[stage] -= 1
        self.busy_ms[stage] += ms
        self.spans.append((start, start + ms, stage, replica, kind, batch, micro))

    # -- the PS ----------------------------------------------------------------------------------
    def _ps(self, rows: float, pull: bool, batch: int, micro: int) -> _Event:
        """A pull or push of `rows` rows, split evenly over the shards (FIFO each); done when all are."""
        if rows <= 0 or math.isinf(self.ps.rows_per_second_per_shard):
            done = _Event()
            done.done = True
            return done
        part = self.ps.service_ms(rows, pull)
        now, end = self.engine.now, self.engine.now
        for shard in range(len(self.shard_free)):
            start = max(now, self.shard_free[shard])
            self.shard_free[shard] = start + part
            self.shard_busy_ms += part
            end = max(end, start + part)
            self.spans.append((start, start + part, -1, shard, "pull" if pull else "push", batch, micro))
        return self.engine.event_at(end)

    def _dense_push(self, stage: int, batch: int, micro: int) -> _Event:
        """Async: one optimizer step of a stage's dense table on its PS shard (stage mod shards)."""
        ms = self.stages[stage].dense_push_ms
        shard = stage % len(self.shard_free)
        start = max(self.engine.now, self.shard_free[shard])
        self.shard_free[shard] = start + ms
        self.shard_busy_ms += ms
        self.spans.append((start, start + ms, -1, shard, f"dense{stage}", batch, micro))
        return self.engine.event_at(start + ms)

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

    def _stage_worker(self, stage: int, replica: int) -> _Process:
        while True:
            call = self._next_call(stage, replica)
            if call is None:
                self.idle[stage][replica] = True
                self.wake[stage][replica] = _Event()
                yield self.wake[stage][replica]
                continue
            self.idle[stage][replica] = False
            self._log(stage)
            yield from self._compute(stage, replica, call.ms, call.kind, call.batch, call.micro)
            self.engine.trigger(call.out)
            dense_ms = self.stages[stage].dense_push_ms
            if not self.sync and dense_ms > 0 and call.kind != "forward":
                yield from self._dense_update(stage, replica, call)

    def _dense_update(self, stage: int, replica: int, call: _Call) -> _Process:
        """Async: wait for this replica's previous dense push, then send the next (runtime.workers)."""
        key = (stage, replica)
        previous = self._last_dense.get(key)
        if previous is not None and not previous.done:
            yield previous
        self._last_dense[key] = self._dense_push(stage, call.batch, call.micro)

    # -- DataWorkers -----------------------------------------------------------------------------
    def _data_worker(self, worker: int, batches: int) -> _Process:
        st0 = self.stages[0]
        fwd_q: deque[_Micro] = deque()
        bwd_q: deque[_Micro] = deque()
        pushes: deque[_Event] = deque()
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
        self, worker: int, fwd_q: deque[_Micro], bwd_q: deque[_Micro], pushes: deque[_Event]
    ) -> _Process:
        """Finish every micro-batch in flight and wait for every push (end of a DataWorker's run)."""
        while fwd_q:
            self._backward(worker, fwd_q.popleft(), bwd_q)
        while bwd_q:
            yield from self._finish(worker, bwd_q.popleft(), pushes)
        while pushes:
            yield pushes.popleft()

    def _push(self, worker: int, rows: float, batch: int, micro: int, pushes: deque[_Event]) -> _Process:
        """The DataWorker sums the gradients (its own work), then the shards apply them (not waited for)."""
        yield from self._compute(0, worker, self.ps.client_ms(rows), "push", batch, micro)
        pushes.append(self._ps(rows, False, batch, micro))

    def _forward(self, worker: int, item: _Micro) -> _Process:
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
        ready: _Event | None = None
        for s in range(1, self.n):
            st = self.stages[s]
            last = s == self.n - 1
            ms = (
                st.recv_forward_ms
                + st.forward_ms
                + (st.backward_ms + st.send_backward_ms if last else st.send_forward_ms)
            )
            out = _Event()
            kind = "forward_backward" if last else "forward"
            self._submit(
                s,
                item.route[s - 1],
                _Call(worker, next(self._seq), kind, ms, ready, out, item.batch, item.micro),
            )
            ready = out
        item.grad = ready

    def _backward(self, worker: int, item: _Micro, bwd_q: deque[_Micro]) -> None:
        """Submit the backward calls of the middle stages, last to first (no waiting here)."""
        for s in range(self.n - 2, 0, -1):
            st = self.stages[s]
            ms = st.recv_backward_ms + st.backward_ms + st.send_backward_ms
            out = _Event()
            self._submit(
                s,
                item.route[s - 1],
                _Call(worker, next(self._seq), "backward", ms, item.grad, out, item.batch, item.micro),
            )
            item.grad = out
        bwd_q.append(item)

    def _finish(self, worker: int, item: _Micro, pushes: deque[_Event]) -> _Process:
        """Wait for the gradient, run stage 0's backward, push sparse gradients (async)."""
        st0 = self.stages[0]
        if item.grad is not None and not item.grad.done:
            yield item.grad
        if self.n > 1:
            ms = st0.recv_backward_ms + st0.backward_ms
            yield from self._compute(0, worker, ms, "backward", item.batch, item.micro)
        if not self.sync:
            yield from self._push(worker, self.ps.rows, item.batch, item.micro, pushes)
            while len(pushes) > _SETTLE_PER_SHARD * len(self.shard_free):
                yield pushes.popleft()
            if st0.dense_push_ms > 0:
                yield from self._dense_update(
                    0, worker, _Call(worker, 0, "backward", 0.0, None, _Event(), item.batch, item.micro)
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
        ps_util = self.shard_busy_ms / (len(self.shard_free) * makespan) if makespan > 0 else 0.0
        spans = pd.DataFrame(
            self.spans, columns=["start_ms", "end_ms", "stage", "replica", "kind", "batch", "micro_batch"]
        ).sort_values("start_ms", kind="stable", ignore_index=True)
        queues = pd.DataFrame(self.queue_log, columns=["time_ms", "stage", "queued", "in_flight"])
        return SimResult(
            throughput, utilisation, ps_util, makespan, self.samples_done, spans, queues, list(self.stages)
        )


# ---------------------------------------------------------------------------------------------
# Helpers


def _plan_mapping(plan: Any) -> Mapping[str, Any]:
    if isinstance(plan, Mapping):
        return plan
    if hasattr(plan, "to_dict"):
        return plan.to_dict()
    raise TypeError(f"expected a plan mapping or a Plan (got {type(plan).__name__})")


def _layer_index(ref: Any, names: list[str]) -> int:
    if isinstance(ref, int | np.integer):
        return int(ref)
    if ref not in names:
        raise ConfigError(None, "plan.stages.layers", f"layer names of the problem ({names})", ref)
    return names.index(ref)


def _layer_ms(layer: Layer, resource: str, b: float) -> float:
    if resource not in layer.time_ms:
        raise ConfigError(None, f"plan: layer {layer.name!r}", f"a type that can run it (not {resource!r})")
    coeff = layer.time_ms[resource]
    return coeff.fixed + coeff.per_sample * b


def _time_average(q: pd.DataFrame, column: str, horizon: float) -> float:
    """Time-weighted mean of a step function logged at its change points."""
    if q.empty or horizon <= 0:
        return 0.0
    t = q["time_ms"].to_numpy()
    v = q[column].to_numpy(dtype=float)
    widths = np.diff(np.append(t, max(horizon, t[-1])))
    return float(np.sum(v * widths) / max(horizon - t[0], 1e-12))
