"""The runtime terms of the cost model (DESIGN.md §3b): what a plan achieves as heterps_ray.runtime
runs it, where the base model of §3 takes each stage on cores of its own with free messages.

Per micro-batch of ``b = B / K`` samples (``K`` = micro-batches), for stage ``j`` of ``S`` on type ``t_j``:

* compute ``C_j = Σ_l fixed(l, t_j) + per_sample(l, t_j) · b``;
* a boundary carries the activation and its gradient, ``2 · out_bytes · b``, paid at each side's
  bandwidth (as in §3);
* every stage after the first receives calls from the DataWorker: two (forward, backward), or one
  (forward + loss + backward) for the last stage; a call's round trip is its type's ``call_ms``, of
  which the stage is busy its ``call_overhead_ms`` (the rest is in flight and at the caller);
* stage 0 (the DataWorker) also reads its input and pays for its sparse rows where they live
  (:func:`table_rate`): ``ps_wait_ms_per_row`` per row waiting for shard actors,
  ``ps_hosted_ms_per_row`` when it hosts the shards itself (``ps_hosting: auto``, one DataWorker, no
  replicated stage), and, hosting them on a cuda type with a measured ``gpu_table_ms_per_row``, that
  per row with the rows in its GPU memory, plus ``gpu_miss_ms_per_row`` for the share its GPU memory
  does not serve (``ps.table.gpu_hit_rate``: a cache in front of the shards); shard actors whose RAM
  cannot hold the table (``ps.table.disk_rows``) add ``disk_ms_per_row`` for the share of rows their RAM
  misses (``1 - ps.table.ram_hit_rate``);
* ``busy_j`` = all of the above that stage ``j``'s actor spends per micro-batch.

A DataWorker waits for a micro-batch's round through every stage: ``loop = Σ_j busy_j`` plus the
calls' round trips beyond their callees' share. Then

* sync (one batch at a time, GPipe over its micro-batches): ``T = loop + (K - 1) · max_j busy_j``,
  ``Θ_loop = 1000 · B / T``; replicas add nothing;
* async: ``q`` micro-batches in flight per DataWorker (``in_flight``), ``k_0`` DataWorkers:
  ``Θ_loop = k_0 · q · 1000 · b / loop``;
* each stage caps the throughput at ``θ_j(k_j) = 1000 · B / (K · busy_j) / ((1-α) + α/k_j)`` (§3's Amdahl);
* a shared host (``hosts``) caps it at its free cores over the CPU per batch of the actors on it: a
  busy actor's compute keeps ``min(threads, cores)`` cores busy, everything else one, and each call
  costs the host's ``call_cpu_ms`` of Ray's own processes;
* ``Θ = min(Θ_loop, min_j θ_j, Θ_host, θ_ps(m))``, without ``θ_ps`` for hosted shards.

`limits` returns every term, so a plan says what bounds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from heterps_ray.costmodel.formulas import BYTES_PER_MS_PER_GBPS, MS_PER_S, stage_throughput
from heterps_ray.costmodel.problem import Problem, RuntimeTerms

if TYPE_CHECKING:
    from heterps_ray.costmodel.analytic import CostModel


@dataclass(frozen=True)
class TableRate:
    """Where a plan's sparse rows live (DESIGN.md "Table tiers": ``gpu``, all in stage 0's GPU memory;
    ``gpu_cache``, the hot ones there in front of the shards; ``ps``, on the shards) and what one row of a
    batch costs its DataWorker there, ms."""

    place: str
    ms_per_row: float
    hit_rate: float = 1.0


def table_rate(problem: Problem, terms: RuntimeTerms, type_name: str, hosted: bool) -> TableRate:
    """The place and per-row cost of the rows of a plan whose stage 0 runs on `type_name`: in its GPU's
    memory when the plan hosts its shards (one DataWorker trains: a row it holds is the row), the type's
    tier was measured (``gpu_table_ms_per_row``) and ``gpu_table`` is auto; else on the shards, where
    shard actors whose RAM cannot hold the table (``ps.table.disk_rows``) add the rows RAM misses at
    ``disk_ms_per_row``. The runtime places them by the same rule (costmodel/table_memory.table_place)."""
    shards = TableRate("ps", terms.ps_hosted_ms_per_row if hosted else terms.ps_wait_ms_per_row)
    table = problem.ps.table
    if not hosted and table is not None and table.disk_rows:  # the shards' hot rows in RAM, the rest on disk
        miss = (1.0 - table.ram_hit_rate) * terms.disk_ms_per_row
        return TableRate("ps", shards.ms_per_row + miss, table.ram_hit_rate)
    if not hosted or terms.gpu_table != "auto" or type_name not in terms.gpu_table_ms_per_row:
        return shards
    if table is not None and table.gpu_rows.get(type_name, 1) < 1:
        return shards
    hit = table.gpu_hit_rate.get(type_name, 1.0) if table is not None else 1.0
    miss = (1.0 - hit) * terms.gpu_miss_ms_per_row.get(type_name, 0.0)  # each row's first lookup at least
    fits = table is None or table.gpu_rows.get(type_name, table.rows) >= table.rows
    return TableRate("gpu" if fits else "gpu_cache", terms.gpu_table_ms_per_row[type_name] + miss, hit)


@dataclass(frozen=True)
class RuntimeLimits:
    """What bounds one plan in the runtime: per stage and overall, in samples/s."""

    stage_ms: tuple[float, ...]  # per stage: one replica's busy ms per batch
    stage_throughput: tuple[float, ...]  # per stage, with its replicas
    loop_ms: float  # a batch's round trip as its DataWorker waits for it (sync: with the GPipe bubble)
    loop_throughput: float  # what the DataWorkers' loops allow
    host_throughput: float  # what the shared hosts' cores allow (inf: none shared)
    ps_hosted: bool  # the DataWorker hosts the shards (no PS call leaves its process)
    table: TableRate = TableRate("ps", 0.0)  # where the rows live and a row's cost to stage 0 there

    @property
    def throughput(self) -> float:
        return min((*self.stage_throughput, self.loop_throughput, self.host_throughput))

    def bound(self, ps_throughput: float) -> str:
        """What limits the plan: 'stage j', 'loop', 'host' or 'ps'."""
        terms = {f"stage {j}": t for j, t in enumerate(self.stage_throughput)}
        terms.update(loop=self.loop_throughput, host=self.host_throughput, ps=ps_throughput)
        return min(terms, key=lambda name: terms[name])


def call_ms(problem: Problem, terms: RuntimeTerms, type_name: str) -> float:
    """One call's fixed round trip to a stage of `type_name` (default: twice its latency, as §3)."""
    if type_name in terms.call_ms:
        return terms.call_ms[type_name]
    return 2.0 * problem.resource(type_name).latency_ms


def limits(
    model: CostModel,
    stages: Sequence[tuple[int, int, int]],
    replicas: Sequence[int],
    alphas: Sequence[float],
) -> RuntimeLimits:
    """The runtime terms of one plan: `stages` as (start, end, type index), replicas per stage."""
    terms = _terms(model)
    hosted = terms.ps_hosting == "auto" and all(k == 1 for k in replicas)
    work = _busy(model, stages, hosted)
    K, S = terms.micro_batches, len(stages)
    table = table_rate(model.problem, terms, model.problem.resources[stages[0][2]].name, hosted)
    counts = [1] * S if terms.mode == "sync" else list(replicas)  # sync: one replica does all the work
    return RuntimeLimits(
        stage_ms=tuple(K * ms for ms in work.busy),
        stage_throughput=tuple(
            _stage_throughput(model, ms, a, k) for ms, a, k in zip(work.busy, alphas, counts, strict=True)
        ),
        loop_ms=_loop_ms(terms, work),
        loop_throughput=_loop_throughput(model, work, counts[0]),
        host_throughput=_host_throughput(model, stages, work, K, hosted),
        ps_hosted=hosted,
        table=table,
    )


def throughput_tables(
    model: CostModel,
    stages: Sequence[tuple[int, int, int]],
    alphas: Sequence[float],
    max_replicas: Sequence[int],
) -> tuple[list[np.ndarray], float]:
    """For provisioning, with the shards on actors: per stage the throughput with k = 1..max
    replicas (stage 0's includes its DataWorkers' loops), and the cap no count changes (host, and the
    loop in sync)."""
    terms = _terms(model)
    work = _busy(model, stages, hosted=False)
    host = _host_throughput(model, stages, work, terms.micro_batches, hosted=False)
    tables = []
    for j, (ms, a, k_max) in enumerate(zip(work.busy, alphas, max_replicas, strict=True)):
        k = np.arange(1, k_max + 1)
        if terms.mode == "sync":
            table = np.full(len(k), _stage_throughput(model, ms, a, 1))
        else:
            table = np.asarray(_stage_throughput(model, ms, a, k))
            if j == 0:
                table = np.minimum(table, k * _loop_throughput(model, work, 1))
        tables.append(table)
    cap = host if terms.mode == "async" else min(host, _loop_throughput(model, work, 1))
    return tables, cap


def _terms(model: CostModel) -> RuntimeTerms:
    terms = model.problem.runtime
    if terms is None:
        raise ValueError(f"problem {model.problem.name!r} has no `runtime` section (DESIGN.md §3b)")
    return terms


@dataclass(frozen=True)
class _Work:
    """Per stage, per micro-batch: what its actor is busy with, split into compute and the rest,
    and the part of its calls' round trips it is not busy (in flight, at the caller)."""

    busy: list[float]
    compute: list[float]
    waiting: list[float]

    @property
    def loop(self) -> float:
        return sum(self.busy) + sum(self.waiting)


def _busy(model: CostModel, stages: Sequence[tuple[int, int, int]], hosted: bool) -> _Work:
    """What each stage spends per micro-batch (DESIGN.md §3b). A call's round trip is `call_ms`; of
    it the callee is busy its type's `call_overhead_ms` (its own work per call received)."""
    problem = model.problem
    terms = _terms(model)
    b = model.batch_size / terms.micro_batches
    S = len(stages)
    types = [problem.resources[t] for _, _, t in stages]

    def side_ms(j: int, nbytes: float) -> float:
        return nbytes / (types[j].bandwidth_gbps * BYTES_PER_MS_PER_GBPS)

    out = [problem.layers[end - 1].out_bytes_per_sample * b for _, end, _ in stages]
    work = _Work([], [], [])
    for j, (start, end, t) in enumerate(stages):
        compute = float((model.fixed_ms[start:end, t] + model.per_sample_ms[start:end, t] * b).sum())
        other = waiting = 0.0
        if j > 0:
            calls = 2 if j < S - 1 else 1
            round_trip = call_ms(problem, terms, types[j].name)
            own = min(types[j].call_overhead_ms, round_trip)
            other += calls * own + side_ms(j, 2.0 * out[j - 1])
            waiting = calls * (round_trip - own)
        if j < S - 1:
            other += side_ms(j, 2.0 * out[j])
        if j == 0:
            other += problem.input_bytes_per_sample * b / (types[0].io_gbps * BYTES_PER_MS_PER_GBPS)
            rows = model.rows_per_sample * b
            other += rows * table_rate(problem, terms, types[0].name, hosted).ms_per_row
        work.busy.append(compute + other)
        work.compute.append(compute)
        work.waiting.append(waiting)
    return work


def _loop_ms(terms: RuntimeTerms, work: _Work) -> float:
    """A batch as its DataWorker waits for it: sync with the GPipe fill and drain of its micro-batches."""
    K = terms.micro_batches
    if terms.mode == "sync":
        return work.loop + (K - 1) * max(work.busy)
    return work.loop * K / terms.in_flight


def _loop_throughput(model: CostModel, work: _Work, data_workers: Any) -> Any:
    loop_ms = _loop_ms(_terms(model), work)
    if loop_ms <= 0:
        return math.inf
    return data_workers * MS_PER_S * model.batch_size / loop_ms


def _stage_throughput(model: CostModel, busy_ms: float, alpha: float, replicas: Any) -> Any:
    """θ_j(k) of DESIGN.md §3 with the stage's runtime busy time."""
    return stage_throughput(model.batch_size, _terms(model).micro_batches * busy_ms, alpha, replicas)


def _host_throughput(
    model: CostModel, stages: Sequence[tuple[int, int, int]], work: _Work, K: int, hosted: bool
) -> float:
    """samples/s the shared hosts' free cores allow (inf when no stage shares a host): per batch, the
    compute of its actors at min(threads, cores) cores, the rest of their work and their calls'
    round trips (the caller's side) at one, the PS shards' service, and Ray's CPU per call."""
    problem = model.problem
    names = problem.type_names
    best = math.inf
    for host in problem.hosts or ():
        work_ms, calls = 0.0, 0
        for j, (compute, busy, waiting) in enumerate(zip(work.compute, work.busy, work.waiting, strict=True)):
            rtype = problem.resources[stages[j][2]]
            if rtype.name not in host.types:
                continue
            work_ms += compute * min(rtype.threads or 1, host.cores) + (busy - compute) + waiting
            calls += 0 if j == 0 else (2 if j < len(work.busy) - 1 else 1)
        if not hosted and names[model.ps_type] in host.types and math.isfinite(model.ps_rows_per_second):
            rows = model.rows_per_sample * model.batch_size / K
            work_ms += rows / model.ps_rows_per_second * MS_PER_S  # the shards' service, beside the wait
        call_cpu = host.call_cpu_ms if host.call_cpu_ms is not None else 0.0
        work_ms = K * (work_ms + calls * call_cpu)
        if work_ms > 0:
            best = min(best, MS_PER_S * model.batch_size * (host.cores - host.background_cores) / work_ms)
    return best
