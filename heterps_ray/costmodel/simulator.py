"""A discrete-event simulation of a plan running as the runtime (heterps_ray.runtime) runs it.

Where the analytic model (DESIGN.md §3) takes the slowest stage, this plays the pipeline out in time.
This file turns a problem and a plan into per-stage times (below); `sim_pipeline` plays the processes
(DataWorkers, StageWorkers, PS shards, shared hosts) out on the event engine.

Times come from the problem: a layer takes ``fixed + per_sample · b`` ms at micro-batch size ``b``
(split forward/backward by `forward_fraction`), and a stage of ``n`` layers ``(n-1) · fused_saving_ms``
less (one module: one autograd pass, one optimizer step); each side of a boundary spends ``bytes / bandwidth``
per message, and the message's latency (both ends) passes in flight before the call it feeds can start
(``latency_in_flight=False``: spent on both actors instead, as DESIGN.md §3 charges it); a StageWorker
also spends its type's ``call_overhead_ms`` on every call it receives; a DataWorker
reads ``input_bytes_per_sample · B`` at its io bandwidth per batch. With ``n`` replicas of a stage busy
at once a call takes ``1 + (n-1)(1-α)`` times longer: Amdahl's law of DESIGN.md §3 when all replicas
are busy.

Example::

    result = simulate(problem, plan, batches=50, mode="sync", micro_batches=4)
    result.throughput, result.summary(), result.queues   # samples/s, per stage, DataFrame over time
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

import numpy as np

from heterps_ray.costmodel.problem import Layer, Problem, Resource
from heterps_ray.costmodel.sim_models import PSModel, SimResult, StageModel
from heterps_ray.costmodel.sim_pipeline import simulate_pipeline
from heterps_ray.errors import ConfigError

__all__ = ["PSModel", "SimResult", "StageModel", "pipeline_model", "simulate", "simulate_pipeline"]

_BYTES_PER_MS_PER_GBPS = 125_000.0  # 1 Gbit/s = 125,000 bytes/ms (DESIGN.md §3)


def simulate(
    problem: Problem,
    plan: Any,
    *,
    batches: int = 40,
    micro_batches: int = 1,
    mode: Literal["sync", "async"] = "sync",
    max_in_flight: int | None = 4,
    forward_fraction: float | None = None,
    ps_limit: bool = True,
    pull_share: float | None = None,
    push_client_share: float | None = None,
    dense_ms_per_param: float | None = None,
    dense_params: Mapping[str, int] | None = None,
    startup_ms: float | None = None,
    drain_every: int | None = None,
    host_sharing: bool = True,
    latency_in_flight: bool = True,
) -> SimResult:
    """Simulate `plan` (a Plan or its JSON mapping) on `problem` for `batches` batches.

    `max_in_flight` None is unbounded; `ps_limit` False gives the PS infinite rate. The runtime details
    a profile measures come from the problem file unless given here (None): the pull's share of PS
    time (`ps.pull_share`), the share of a push done by the DataWorker itself (`ps.push_client_share`),
    async dense pushes (`ps.dense_ms_per_param` x each layer's `dense_params`), the forward pass's share
    of compute (`runtime.forward_fraction`), a DataWorker's one-time start-up (`runtime.startup_ms`),
    and `drain_every` (the runtime's driver drains the pipeline between chunks).
    With `host_sharing` (the default) the problem's `hosts` are modelled: actors on one host share
    its cores; False treats every actor as a machine of its own. With `latency_in_flight` (the
    default) a message's latency delays it without occupying either actor (Ray moves it while the
    actors compute); False charges it to both actors' time, as DESIGN.md §3 does.
    """
    terms = problem.runtime
    measured_fraction = terms.forward_fraction if terms is not None else None
    forward_fraction = _given(forward_fraction, measured_fraction, 1.0 / 3.0)
    pull_share = _given(pull_share, problem.ps.pull_share, 0.5)
    push_client_share = _given(push_client_share, problem.ps.push_client_share, 0.0)
    dense_ms_per_param = _given(dense_ms_per_param, problem.ps.dense_ms_per_param, 0.0)
    startup_ms = _given(startup_ms, terms.startup_ms if terms is not None else None, 0.0)
    if dense_params is None:
        dense_params = {layer.name: layer.dense_params or 0 for layer in problem.layers}
    stages, ps = pipeline_model(
        problem,
        plan,
        micro_batches,
        forward_fraction,
        dense_ms_per_param,
        dense_params or {},
        latency_in_flight,
    )
    rate = ps.rows_per_second_per_shard if ps_limit else math.inf
    ps = replace(
        ps, rows_per_second_per_shard=rate, pull_share=pull_share, push_client_share=push_client_share
    )
    hosts = [(h.cores, h.background_cores) for h in problem.hosts or ()] if host_sharing else []
    if not host_sharing:
        stages = [replace(st, host=None) for st in stages]
        ps = replace(ps, host=None)
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
        hosts=hosts,
    )


def pipeline_model(
    problem: Problem,
    plan: Any,
    micro_batches: int = 1,
    forward_fraction: float = 1.0 / 3.0,
    dense_ms_per_param: float = 0.0,
    dense_params: Mapping[str, int] | None = None,
    latency_in_flight: bool = False,
) -> tuple[list[StageModel], PSModel]:
    """Per-micro-batch stage times and the PS tier of `plan` on `problem`, in DESIGN.md §3 terms;
    with `latency_in_flight` a message's latency delays it instead of occupying the actors."""
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
        return wire_ms + (0.0 if latency_in_flight else rtype.latency_ms)

    stages = []
    for s, raw in enumerate(raw_stages):
        rtype = problem.resource(raw["type"])
        idx = stage_layers[s]
        times = [_layer_ms(layers[i], rtype.name, b) for i in idx]
        # the stage runs its layers as one module: their fixed costs are partly shared
        compute = max(float(sum(times)) - (len(idx) - 1) * rtype.fused_saving_ms, max(times))
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
                threads=rtype.threads or 1,
                host=_host_index(problem, rtype.name),
                call_cpu_ms=_call_cpu_ms(problem, rtype),
                in_flight_ms=rtype.latency_ms if latency_in_flight else 0.0,
                call_ms=rtype.call_overhead_ms,
            )
        )
    rows = b * sum(layer.sparse_rows_per_sample for layer in layers)
    shards = int(plan_map.get("ps_shards") or problem.ps_min_shards)
    ps_type = problem.resource(problem.ps_resource)
    ps = PSModel(
        shards=shards,
        rows=rows,
        rows_per_second_per_shard=problem.ps_rows_per_second,
        threads=ps_type.threads or 1,
        host=_host_index(problem, ps_type.name),
        call_cpu_ms=_call_cpu_ms(problem, ps_type),
    )
    return stages, ps


# ---------------------------------------------------------------------------------------------
# Helpers


def _given(value: float | None, measured: float | None, default: float) -> float:
    """An explicit argument, else the problem's measured value, else the default."""
    if value is not None:
        return value
    return measured if measured is not None else default


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


def _host_index(problem: Problem, type_name: str) -> int | None:
    hosts = list(problem.hosts or ())
    host = problem.host_of(type_name)
    return None if host is None else hosts.index(host)


def _call_cpu_ms(problem: Problem, rtype: Resource) -> float:
    """CPU of Ray's own processes per call to an actor of `rtype`: measured for its host, else the
    type's message latency at both ends."""
    host = problem.host_of(rtype.name)
    if host is not None and host.call_cpu_ms is not None:
        return host.call_cpu_ms
    return 2.0 * rtype.latency_ms


def _layer_ms(layer: Layer, resource: str, b: float) -> float:
    if resource not in layer.time_ms:
        raise ConfigError(None, f"plan: layer {layer.name!r}", f"a type that can run it (not {resource!r})")
    coeff = layer.time_ms[resource]
    return coeff.fixed + coeff.per_sample * b
