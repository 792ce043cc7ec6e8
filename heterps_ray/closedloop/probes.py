"""Runtime probes, run: a probe (heterps_ray.profiling.probes says which) is a short sync run of the
real runtime, trained by the driver; its steady rate is one measurement row of the profile."""

from __future__ import annotations

from typing import Any

import ray

from heterps_ray.config import JobConfig, ResourceType
from heterps_ray.costmodel.plan import Plan, PlanStage
from heterps_ray.costmodel.table_memory import TableEstimate, estimate_table
from heterps_ray.errors import ConfigError
from heterps_ray.models import build_model
from heterps_ray.profiling.fit import FitResult
from heterps_ray.profiling.probes import PROBE_STEPS, PROBE_WARMUP, ProbeSkipped, ProbeTiming, probe_steps
from heterps_ray.profiling.profiler import ProfileSettings, profile
from heterps_ray.runtime import warm
from heterps_ray.runtime.actors import hosts_shards
from heterps_ray.runtime.driver import train
from heterps_ray.runtime.loop import LiveActors
from heterps_ray.runtime.pipeline import check_capacity, resolve_stages
from heterps_ray.runtime.stage_worker import StageWorker
from heterps_ray.runtime.workers import DataWorker


def profile_job(
    job: JobConfig, settings: ProfileSettings, estimate: TableEstimate | None = None
) -> FitResult:
    """The job's whole profile on the live Ray: every layer on every type, then the runtime probes,
    all in the runtime's warm actors (:class:`WarmHosts`): a torch-importing process starts once per
    role and type, and stays warm for the run that follows. `estimate`: the run's table estimate
    (None: estimated from the job's dataset)."""
    return profile(job, settings, run_probe, WarmHosts(), estimate)


class WarmHosts:
    """The profiler's actors are the runtime's (profiling.placement.Hosts): per type a blank DataWorker,
    then a blank StageWorker (warm.py; idle ones of an earlier run reconfigured), kept warm after, so
    that the probes (a DataWorker of one type calling a StageWorker of another, then a DataWorker
    alone) and the run reconfigure them instead of starting processes."""

    ROLES = (DataWorker, StageWorker)

    def start(self, rtype: ResourceType, count: int) -> list[Any]:
        if count > len(self.ROLES):
            raise ValueError(f"{count} profiling actors of {rtype.name!r}: at most {len(self.ROLES)} roles")
        started: list[Any] = []
        try:
            for cls in self.ROLES[:count]:
                started.append(warm.spawn(cls, rtype.actor_options()))
        except BaseException:  # the ones started before go (the profile never saw them)
            self.release(rtype, started, reuse=False)
            raise
        return started

    def release(self, rtype: ResourceType, actors: list[Any], reuse: bool) -> None:
        for cls, handle in zip(self.ROLES, actors, strict=False):
            if reuse:
                warm.keep_warm(handle, cls, rtype.actor_options())
            else:
                ray.kill(handle)


def run_probe(
    job: JobConfig, layers: list[str], caller: str, callee: str, split: int, steps: int = PROBE_STEPS
) -> ProbeTiming:
    """ms per batch, at the steady rate, of the sync plan `caller` for layers[:split], then `callee`,
    and the rows its GPU tier fetched from the shards over those batches; ProbeSkipped where its actors and PS shard
    (unless hosted) exceed a type's max_instances (train would refuse it)."""
    stages = [PlanStage(tuple(layers[:split]), caller, 1, 0.0, 0.0)]
    if split < len(layers):
        stages.append(PlanStage(tuple(layers[split:]), callee, 1, 0.0, 0.0))
    plan = Plan(
        problem=f"probe of {job.name}",
        assignment=tuple(t for s in stages for t in [s.type] * len(s.layers)),
        stages=tuple(stages),
        ps_shards=1,
        ps_type=job.cluster.ps_resource,
        ps_throughput=0.0,
        throughput=0.0,
        throughput_min=0.0,
        cost=0.0,
        cost_rate=0.0,
        feasible=True,
        scheduler="probe",
        seconds=0.0,
        batch_size=job.batch_size,
    )
    # a probe times the layers: its table (a few hundred batches' rows) is not held to the run's table
    # budget, which the plan meets with its own shard count (or the PS type's disk); 1 shard could not
    cluster = job.cluster.model_copy(
        update={"resource_types": [t.model_copy(update={"table_memory_gb": None}) for t in job.cluster.resource_types]}
    )
    probe_job = job.model_copy(
        update={
            "cluster": cluster,
            "mode": "sync",
            "runtime": job.runtime.model_copy(
                update={"micro_batches": 1, "batches_ahead": 0, "ps_hosting": "auto", "checkpoint_every": 0, "checkpoint_interval_s": 0,
                        "train_steps": None, "ps_shards": None, "epochs": 1000}
            ),
        }
    )  # fmt: skip
    model = build_model(job.model)
    specs = resolve_stages(plan, model, probe_job)
    estimate = estimate_table(probe_job, model.embedding_dim)
    shard_actors = 0 if hosts_shards(probe_job, specs, int(plan.ps_shards), estimate) else int(plan.ps_shards)
    try:
        check_capacity(specs, shard_actors, job.cluster)
    except ConfigError as exc:
        raise ProbeSkipped(f"{exc.expected}: it needs {exc.got}") from None
    warmed: list[tuple[int, int]] = []  # (step, rows the GPU tier fetched) at the end of the warm-up chunk

    def after_warmup(live: LiveActors) -> None:
        if not warmed:
            stats = ray.get([w.table_stats.remote() for w in live.data_workers])
            warmed.append((live.step, sum(int(s.get("fetched", 0)) for s in stats)))

    summary = train(
        probe_job,
        plan,
        steps=probe_steps(job, steps),
        progress=False,
        save=False,
        evaluation=False,
        first_chunk=PROBE_WARMUP,
        on_chunk=after_warmup,
        estimate=estimate,
    )
    rate = summary.steady_throughput or summary.throughput
    # a probe starts with an empty GPU tier: its steady batches still meet keys for the first time (cold
    # misses a long run amortizes); the fit prices them apart instead of into the layers
    fetched, batches = 0, 0
    table = summary.extra.get("table", {})
    if warmed and "fetched" in table:
        batches = summary.steps - warmed[0][0]
        fetched = int(table["fetched"]) - warmed[0][1]
    return ProbeTiming(1000.0 * job.batch_size / rate, fetched, batches, summary.seconds)
