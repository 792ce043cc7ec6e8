"""Live profiling: measure a model's layers, the PS and the links on every resource type of a Ray cluster.

One pair of actors (each a :class:`~heterps_ray.profiling_host.LayerProfiler` in a process that
placement.py's hosts give: the runtime's warm actors in ``heterps profile``) per resource type present
in the cluster (pinned by the type's Ray resources, torch threads set, ``cuda`` where the type is a
GPU type: a DeviceError where its actor finds no GPU; one actor where the cluster's GPUs do not hold
two, refused before any wait where they hold none) runs every layer forward and backward (plus its Adam step) at several
batch sizes, with warm-up and repeats; the same layer on one actor and on both at once gives the
parallel fraction; messages of several sizes between actors give each type's bandwidth and latency;
a real :class:`~heterps_ray.ps.shard.PSShard` gives the PS service rate, and the PS type's local
disk (where it declares one) the price of a row its shards' RAM misses (ps/disk_timing.py). This
module starts the actors, runs each kind of measurement (measurements.py) and gathers their rows (:class:`ProfileRun`;
the runtime probes after them: probes.py);
:func:`heterps_ray.profiling.fit.fit_problem` turns the measurements into a problem file.

Example::

    connect(job.cluster)  # heterps_ray.cluster: embedded local Ray with the types declared
    result = profile(job, ProfileSettings(repeats=5))
    write_problem(result, "problem.yaml")
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import pandas as pd
import ray

from heterps_ray.config import JobConfig, ResourceType
from heterps_ray.costmodel.table_memory import TableEstimate, gpu_table_setting, with_table
from heterps_ray.errors import ConfigError
from heterps_ray.models import ModelSpec, build_model
from heterps_ray.profiling.fit import COLUMNS, FitResult, LayerInfo, fit_problem
from heterps_ray.profiling.measurements import (
    PSProbe,
    call_runs,
    device_table_runs,
    disk_runs,
    host_runs,
    input_runs,
    layer_rounds,
    pair_runs,
    transfer_runs,
)
from heterps_ray.profiling.placement import (
    Hosts,
    OwnHosts,
    Waiter,
    actor_counts,
    shard_room,
    start_all,
)
from heterps_ray.profiling.probes import (
    ONE_STAGE_AGREE,
    ONE_STAGE_REPEATS,
    PROBE_STEPS,
    ProbeRunner,
    batch_ms_of,
    probe_runs,
)
from heterps_ray.profiling.rows import GPU_COLUMNS, Row

_BYTES_PER_MB = 1 << 20


@dataclass(frozen=True)
class ProfileSettings:
    """How much to measure. For ctr_dnn on the local cluster of a busy 2-core machine the defaults
    measured for 35-75 s (plus up to a minute starting the actors); `quick` measures for seconds."""

    batch_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024)
    warmup: int = 2
    """untimed calls before each timed series"""
    repeats: int = 5
    """timed calls per (layer, type, batch size); the fit uses their mean"""
    pair_repeats: int = 1
    """1- vs 2-replica wall-time runs per (layer, type)"""
    pair_ms: float = 50.0
    """each 1-/2-replica run repeats the layer on each actor for this long"""
    transfer_bytes: tuple[int, ...] = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
    ps_calls: int = 8
    """pull+push requests per PS repeat"""
    ps_repeats: int = 3
    input_rows: int = 1 << 16
    """rows read per input-rate repeat: one chunk of heterps_ray.data.dataset (it converts 65,536 at a time)"""
    host_window_s: float = 0.3
    """how long each type's first actor watches its machine's CPU use while idle (background load)"""
    host_calls: int = 100
    """actor calls whose CPU cost in Ray's own processes (the raylet) is measured, per type"""
    call_count: int = 40
    """calls per message size, 4 in flight, that time an actor's own work per call received, per type"""
    call_sizes: int = 3
    """message sizes of those calls: this many of `transfer_bytes`, the smallest, the largest and
    evenly between (the fit is a line in the size)"""
    input_repeats: int = 2
    """input-rate reads per type (the first is cold, start-up: the fit takes the rest)"""
    probe_steps: int | None = PROBE_STEPS
    """batches each runtime probe trains (probes.py; 0: the warm-up and one read chunk's worth; None: no
    probes, the problem gets no call terms and uncalibrated layer times)"""
    probe_repeats: int = ONE_STAGE_REPEATS
    """runs of each one-stage probe, interleaved across types (the fit takes their median)"""
    probe_agree: float = ONE_STAGE_AGREE
    """a type whose two one-stage runs lie further apart than this (of their mean) gets a third"""
    probe_background: float = 0.2
    """cores of other work beside a one-stage run (on the driver's machine, the cluster's own processes
    left out) above which it is taken again, the disturbed run kept as a "probe_disturbed" row"""
    probe_extra: int = 2
    """one-stage runs added at most per profile, both kinds together (each costs a probe's time)"""
    seed: int = 0
    progress: bool = True
    start_timeout_s: float = 120.0
    """the actors not placed by then: a ConfigError naming the types and what the cluster has"""
    call_timeout_s: float = 900.0
    """one measurement call not answered by then: a ProfileTimeout naming it (never a hang)"""

    @classmethod
    def quick(cls, **overrides: Any) -> ProfileSettings:
        """A fast, rough profile (2 rounds, short runs, fewer sizes): for smoke tests, not for planning.
        The input read stays whole (one chunk, a warm repeat): a shorter one times a chunk's conversion
        against a fraction of its rows, and a cold one the start-up (each 30x slow as a read rate)."""
        fields: dict[str, Any] = {
            "repeats": 2,
            "warmup": 1,
            "pair_repeats": 1,
            "pair_ms": 20.0,
            "transfer_bytes": (4 << 10, 256 << 10, 1 << 20),
            "ps_calls": 4,
            "ps_repeats": 1,
            "host_window_s": 0.3,
            "host_calls": 50,
            "call_count": 20,
            "probe_steps": None,
            "probe_repeats": 2,
        }
        return cls(**{**fields, **overrides})

    def scaled(self, factor: int) -> ProfileSettings:
        """More repeats everywhere (``heterps profile --repeat-factor``)."""
        return replace(
            self,
            repeats=self.repeats * factor,
            pair_repeats=self.pair_repeats * factor,
            ps_repeats=self.ps_repeats * factor,
            input_repeats=self.input_repeats * factor,
            probe_repeats=self.probe_repeats * factor,
        )


@dataclass
class ProfileRun:
    """What a profile measured, before fitting: the rows and where the actors ran."""

    measurements: pd.DataFrame
    actors: list[dict[str, Any]] = field(default_factory=list)
    skipped_types: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # what the cluster did not let the profile measure, and why (the PS shard, a runtime probe)
    unmeasured: list[str] = field(default_factory=list)
    # wall time: "start" (actors placed, layers built), "layers" (their timings), "probes"
    seconds: dict[str, float] = field(default_factory=dict)


def profile(
    job: JobConfig,
    settings: ProfileSettings | None = None,
    run_probe: ProbeRunner | None = None,
    hosts: Hosts | None = None,
    estimate: TableEstimate | None = None,
) -> FitResult:
    """Profile `job`'s model on the live Ray cluster (already initialised) and fit a problem file.
    `run_probe` trains the runtime probes (heterps_ray.closedloop.probes.run_probe); it is needed
    unless ``settings.probe_steps`` is None. `hosts`: the processes to measure in (placement.py;
    default: actors of the profile's own). `estimate`: the run's table estimate (None: estimated from
    the job's dataset)."""
    settings = settings or ProfileSettings()
    run = measure(job, build_model(job.model), settings, run_probe, hosts)
    return fit_runs(job, [run], settings, estimate)


def fit_runs(
    job: JobConfig, runs: list[ProfileRun], settings: ProfileSettings, estimate: TableEstimate | None = None
) -> FitResult:
    """Fit one problem from one or more profiles of `job` (their measurements together: profiles
    taken before and after something average the machine's speed over it); the problem's table from
    `estimate` (None: estimated from the job's dataset)."""
    spec = build_model(job.model)
    frames, offset = [], 0
    for run in runs:  # repeats numbered on across profiles (the fits read the first one as cold)
        frame = run.measurements.copy()
        frame["repeat"] = frame["repeat"] + offset
        offset = int(frame["repeat"].max()) + 1
        frames.append(frame)
    layers = [
        LayerInfo(
            layer.name,
            layer.out_bytes_per_sample,
            layer.sparse_rows_per_sample,
            layer.parallel_fraction,
            layer.dense_params,
        )
        for layer in spec.layers
    ]
    started = time.perf_counter()
    result = fit_problem(
        pd.concat(frames, ignore_index=True),
        cluster=job.cluster,
        layers=layers,
        batch_size=job.batch_size,
        samples=job.samples,
        throughput_min=job.throughput_min,
        name=f"{spec.name} on {job.cluster.name} (profiled)",
        input_bytes_per_sample=spec.input_bytes_per_sample,
        execution=execution_of(job),
    )
    # ps.table: the shards the table's memory needs; the rows each cuda type's GPU memory holds
    with_table(
        result.problem, job, spec.embedding_dim, _gpu_rows(pd.concat(frames, ignore_index=True)), estimate
    )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    devices = sorted({f"{a['type']}: {a['device']} x{a['torch_threads']} threads" for a in runs[0].actors})
    notes = [
        f"measured {stamp} by `heterps profile` ({job.name}): batch sizes {list(settings.batch_sizes)}, "
        f"{settings.warmup} warm-up + {settings.repeats} repeats (median)"
        + (f" in each of {len(runs)} profiles" if len(runs) > 1 else "")
        + f"; actors {'; '.join(devices)}",
        *(note for run in runs for note in run.notes),
    ]
    result.unmeasured = [item for run in runs for item in run.unmeasured]
    if result.unmeasured:
        notes.append("not measured: " + " | ".join(result.unmeasured))
    if result.flags:
        notes.append(f"{len(result.flags)} poor fits: " + " | ".join(result.flags))
    result.problem["notes"] = "\n".join(notes)
    measured = {a["type"]: str(a["device"]).split(":")[0] for run in runs for a in run.actors}
    for resource in result.problem["resources"]:  # what the actors computed on, not what was configured
        resource["device"] = measured.get(resource["name"], resource.get("device"))
    for run in runs:
        for part, took in run.seconds.items():
            result.seconds[part] = result.seconds.get(part, 0.0) + took
    result.seconds["fit"] = time.perf_counter() - started
    return result


def _gpu_rows(measurements: pd.DataFrame) -> dict[str, int]:
    """The rows each cuda type's GPU memory holds for the table, as its actor measured them (its free
    memory less a reserve; kind "gpu_rows")."""
    sel = measurements[measurements["kind"] == "gpu_rows"]
    return {str(name): int(rows) for name, rows in sel.groupby("resource")["rows"].min().items()}


def execution_of(job: JobConfig) -> dict[str, Any]:
    """How the runtime will execute `job` (the problem's `runtime` section, DESIGN.md §3b)."""
    rt = job.runtime
    return {
        "mode": job.mode,
        "micro_batches": rt.micro_batches,
        "max_in_flight": rt.max_in_flight,
        "batches_ahead": rt.batches_ahead if job.mode == "async" else 0,
        "ps_hosting": rt.ps_hosting,
        "gpu_table": gpu_table_setting(job),
    }


def measure(
    job: JobConfig,
    spec: ModelSpec,
    settings: ProfileSettings,
    run_probe: ProbeRunner | None = None,
    hosts: Hosts | None = None,
) -> ProfileRun:
    """Take every measurement on the live cluster; returns the raw rows (columns :data:`COLUMNS`).
    The runtime probes are trained by `run_probe`, in `hosts` (see :func:`profile`)."""
    from tqdm.auto import tqdm

    if settings.probe_steps is not None and run_probe is None:
        raise ValueError(
            "runtime probes need a runner: pass run_probe=heterps_ray.closedloop.probes.run_probe, "
            "or ProfileSettings(probe_steps=None) for no probes"
        )

    started = time.perf_counter()
    available = ray.cluster_resources()
    present = [t for t in job.cluster.resource_types if available.get(t.name, 0) >= 1]
    skipped = [t.name for t in job.cluster.resource_types if t not in present]
    if not present:
        raise ConfigError(
            None,
            "cluster.resource_types",
            f"at least one type declared as a Ray resource on the cluster (cluster has {sorted(available)})",
            [t.name for t in job.cluster.resource_types],
        )
    names = [t.name for t in present]
    ps_name = job.cluster.ps_resource if job.cluster.ps_resource in names else names[0]
    nodes = ray.nodes()
    counts = actor_counts(present, nodes, ps_name)
    unmeasured: list[str] = []
    # a PS shard that cannot be placed beside the profiling actors is not started: its calls would wait
    room = shard_room(job.cluster.type(ps_name), nodes, counts)
    if room is not None:
        unmeasured.append(f"the PS shard's rates ({ps_name!r}: {room})")
    hosts = hosts or OwnHosts()
    model = {"name": job.model.name, **job.model.params}
    actors: dict[str, list[Any]] = {}
    described = []
    ps: PSProbe | None = None
    try:
        for rtype in present:  # every type's processes start at once, and build their layers at once
            actors[rtype.name] = hosts.start(rtype, counts[rtype.name])
        if room is None:
            ps = PSProbe.start(job, spec, present, settings)  # its shard and keys while the actors start
        infos = start_all(
            [(t, actors[t.name]) for t in present], model, settings.seed, settings.start_timeout_s
        )
        described += [{"type": name, **info} for name, group in infos.items() for info in group]
    except BaseException:
        if ps is not None:
            ps.stop()
        _release(hosts, present, actors, reuse=False)
        raise
    seconds: dict[str, float] = {"start": time.perf_counter() - started}
    started = time.perf_counter()
    wait = Waiter(settings.call_timeout_s)

    rows: list[Row] = []
    notes: list[str] = []
    load_before = os.getloadavg()[0]
    pair_batch = min(job.batch_size, max(settings.batch_sizes))
    total = (
        len(present) * (settings.repeats + spec.num_layers)
        + len(present) * len(present) * len(settings.transfer_bytes)
        + 4
    )
    bar = tqdm(total=total, desc="profiling", unit="step", disable=not settings.progress)
    done = False
    try:
        rows += host_runs(present, actors, settings, wait, calls=False)  # background: before and at the end
        for rtype in present:
            rows += layer_rounds(actors[rtype.name], rtype, spec, settings, bar, wait, notes)
            bar.set_postfix_str(f"{rtype.name} layers, 1 vs 2 replicas")
            rows += pair_runs(actors[rtype.name], rtype, spec, pair_batch, settings, wait)
            bar.update(spec.num_layers)
        rows += transfer_runs(present, actors, settings, bar, notes, wait)
        bar.set_postfix_str("actors' own work per call")
        rows += call_runs(present, actors, settings, notes, wait)
        bar.update()
        bar.set_postfix_str("PS shard")
        if ps is not None:
            rows += ps.runs(spec, actors, settings, wait, unmeasured)
        bar.update()
        bar.set_postfix_str("input read rate")
        rows += input_runs(job, present, actors, settings, wait)
        if gpu_table_setting(job) == "auto":
            rows += device_table_runs(job, spec, present, actors, settings, wait)
        rows += disk_runs(job, spec, ps_name, actors, wait)
        bar.update()
        bar.set_postfix_str("machines and their background load")
        rows += host_runs(present, actors, settings, wait)
        bar.update()
        done = True
    finally:
        bar.close()
        if ps is not None:
            ps.stop()
        _release(hosts, present, actors, reuse=done)
    seconds["layers"] = time.perf_counter() - started
    if run_probe is not None and settings.probe_steps is not None:  # the probes reuse warm hosts
        started = time.perf_counter()
        rows += probe_runs(
            job,
            spec,
            [t.name for t in present],
            settings,
            run_probe,
            notes,
            batch_ms_of(rows, job.batch_size),
            unmeasured,
        )
        seconds["probes"] = time.perf_counter() - started
    if skipped:
        notes.append(f"resource types not in the cluster, not profiled: {skipped}")
    # Other processes on the machine inflate (and scatter) every time measured here; say how busy it was.
    notes.append(
        f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs)"
    )
    scarce = [t.name for t in present if counts[t.name] < 2 <= t.max_instances and t.num_gpus > 0]
    if scarce:
        notes.append(f"one actor of {scarce}: the cluster's GPUs do not hold two (no 1 vs 2 replica runs)")
    frame = pd.DataFrame([r.__dict__ for r in rows], columns=[*COLUMNS, *GPU_COLUMNS])
    return ProfileRun(
        measurements=frame,
        actors=described,
        skipped_types=skipped,
        notes=notes,
        unmeasured=unmeasured,
        seconds=seconds,
    )


def _release(hosts: Hosts, present: list[ResourceType], actors: dict[str, list[Any]], reuse: bool) -> None:
    for rtype in present:
        if rtype.name in actors:
            hosts.release(rtype, actors[rtype.name], reuse)
