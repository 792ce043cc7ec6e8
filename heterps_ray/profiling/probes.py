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

This module says what to probe. Running a probe trains with the runtime, which sits above profiling:
the runner is passed in (:data:`ProbeRunner`; heterps_ray.closedloop.probes.run_probe).
"""

from __future__ import annotations

from collections.abc import Callable

from heterps_ray.config import JobConfig

# (job, layers, caller type, callee type, split, steps) -> steady ms per batch of that sync plan
ProbeRunner = Callable[[JobConfig, list[str], str, str, int, int], float]

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
