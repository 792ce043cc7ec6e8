"""Runtime probes: short runs of the real runtime that measure the cost model's runtime terms
(DESIGN.md §3b) where no single-actor timing can: what a call between two stages costs inside the
runtime's loop, and what hosting the PS shards costs a DataWorker.

The probes train sync plans for a few seconds each on the job's own data and actors:

* one stage on each type (its DataWorker hosts the shards): the runtime's own speed on that type;
* for every type ``t`` but the first: the first layer on the first type, the rest on ``t`` (one call
  per batch to a stage of ``t``), and the first layer on the second type, the rest on the first.

Each probe is one measurement row (kind ``probe``): the plan's steady ms per batch, the callee type
in `resource` (empty for the one-stage probe), the caller in `peer`, the layer where the second stage
ends in `layer` (the last layer of the first stage). :func:`heterps_ray.profiling.fit.fit_problem` subtracts what the fitted layers,
bytes and input explain; the remainder is the term.
"""

from __future__ import annotations

from heterps_ray.config import JobConfig

PROBE_STEPS = 0  # batches per probe; 0: enough for two of the dataset's read chunks (probe_steps)


def probe_steps(job: JobConfig, steps: int = PROBE_STEPS) -> int:
    """Batches a probe trains: `steps`, or (0) the warm-up and two of the dataset's read chunks of
    READ_ROWS rows (a long run pays a chunk's conversion every READ_ROWS rows; a shorter probe would
    miss it and read fast), at least 120 (the warm-up chunk and two steady chunks)."""
    from heterps_ray.data.dataset import READ_ROWS

    return steps or max(120, 20 + 2 * READ_ROWS // job.batch_size)


def probe_plans(job: JobConfig, layers: list[str], types: list[str]) -> list[tuple[str, str, int]]:
    """(caller type, callee type, index of the second stage's first layer) per probe; callee '' and
    index len(layers) for the one-stage probe. `types` are those present that run every layer."""
    if not types:
        return []
    first = types[0]
    probes = [(t, "", len(layers)) for t in types]
    if len(layers) > 1:
        for callee in types[1:]:
            probes.append((first, callee, 1))
        if len(types) > 1:
            probes.append((types[1], first, 1))
    return probes


def run_probe(
    job: JobConfig, layers: list[str], caller: str, callee: str, split: int, steps: int = PROBE_STEPS
) -> float:
    """ms per batch, at the steady rate, of the sync plan `caller` for layers[:split], then `callee`."""
    from heterps_ray.costmodel.plan import Plan, PlanStage
    from heterps_ray.runtime.driver import train

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
                update={"micro_batches": 1, "batches_ahead": 0, "ps_hosting": "auto", "checkpoint_every": 0,
                        "train_steps": None, "compiled_graph": False, "ps_shards": None, "epochs": 1000}
            ),
        }
    )  # fmt: skip
    summary = train(probe_job, plan, steps=probe_steps(job, steps), progress=False, save=False)
    rate = summary.steady_throughput or summary.throughput
    return 1000.0 * job.batch_size / rate
