"""Runtime probes, run: a probe (heterps_ray.profiling.probes says which) is a short sync run of the
real runtime, trained by the driver; its steady rate is one measurement row of the profile."""

from __future__ import annotations

from heterps_ray.config import JobConfig
from heterps_ray.costmodel.plan import Plan, PlanStage
from heterps_ray.profiling.fit import FitResult
from heterps_ray.profiling.probes import PROBE_STEPS, probe_steps
from heterps_ray.profiling.profiler import ProfileSettings, profile
from heterps_ray.runtime.driver import train
from heterps_ray.runtime.warm import release_idle


def profile_job(job: JobConfig, settings: ProfileSettings) -> FitResult:
    """The job's whole profile on the live Ray: every layer on every type, then the runtime probes
    (which reuse one another's actors, warm.py; they stay warm for the run that follows). Idle warm
    actors of an earlier run go first: the profiling actors need their resources."""
    release_idle()
    return profile(job, settings, run_probe)


def run_probe(
    job: JobConfig, layers: list[str], caller: str, callee: str, split: int, steps: int = PROBE_STEPS
) -> float:
    """ms per batch, at the steady rate, of the sync plan `caller` for layers[:split], then `callee`."""
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
    probe_job = job.model_copy(
        update={
            "mode": "sync",
            "runtime": job.runtime.model_copy(
                update={"micro_batches": 1, "batches_ahead": 0, "ps_hosting": "auto", "checkpoint_every": 0, "checkpoint_interval_s": 0,
                        "train_steps": None, "ps_shards": None, "epochs": 1000}
            ),
        }
    )  # fmt: skip
    summary = train(probe_job, plan, steps=probe_steps(job, steps), progress=False, save=False)
    rate = summary.steady_throughput or summary.throughput
    return 1000.0 * job.batch_size / rate
