"""The problem the closed loop plans on, as the cluster changes: a problem file given instead of a
profile, the same problem with its table on the PS type's disk (to weigh against RAM), the problem
restricted to the resource types present now, and a type that joins mid-run profiled when it joins."""

from __future__ import annotations

from pathlib import Path

from heterps_ray.closedloop.probes import WarmHosts, run_probe
from heterps_ray.config import JobConfig
from heterps_ray.costmodel import Problem, load_problem, problem_from_dict
from heterps_ray.costmodel.table_memory import TableEstimate, with_table
from heterps_ray.errors import ConfigError, InfeasibleError
from heterps_ray.models import build_model
from heterps_ray.profiling.profiler import ProfileSettings, fit_runs, measure


def given_problem(path: Path, job: JobConfig, copy: Path, estimate: TableEstimate | None) -> Problem:
    """`heterps run --problem FILE`: the problem to plan on instead of a profile, checked against the
    job (same layers, and types of the job's cluster) and given the job's floor, batch size, samples
    and table (`estimate`, the run's); saved as output_dir/problem.yaml."""
    if not path.is_file():
        raise ConfigError(str(path), "--problem", "an existing problem file (YAML or JSON)", str(path))
    problem = load_problem(path)
    layers = [layer.name for layer in build_model(job.model).layers]
    if problem.layer_names != layers:
        raise ConfigError(str(path), "layers", f"the layers of the job's model {layers}", problem.layer_names)
    types = {t.name for t in job.cluster.resource_types}
    unknown = sorted(set(problem.type_names) - types)
    if unknown:
        raise ConfigError(str(path), "resources", f"resource types of cluster {job.cluster.name!r}", unknown)
    data = problem.to_dict()
    data.update(throughput_min=job.throughput_min, batch_size=job.batch_size, samples=job.samples)
    with_table(data, job, estimate=estimate)  # the job's table, not the one the problem was profiled with
    problem = problem_from_dict(data, str(path))
    if path.resolve() != copy.resolve():
        problem.save(copy)
    return problem


def with_table_estimate(problem: Problem, job: JobConfig, estimate: TableEstimate) -> Problem:
    """`problem` with `job`'s table as `estimate` has it (its ``ps.table`` section rewritten): the same
    layers, types and runtime terms, the table's shards and place (RAM, or the PS type's disk) changed."""
    data = problem.to_dict()
    with_table(data, job, estimate=estimate)
    return problem_from_dict(data, f"{problem.name} (the job's table as estimated)")


def restrict_problem(problem: Problem, types: list[str]) -> Problem:
    """`problem` (a costmodel Problem) with only the resource `types`; profiles of the others are
    dropped from this copy only. InfeasibleError when the PS type or some layer's every type is gone."""
    data = problem.to_dict()
    keep = [r for r in data["resources"] if r["name"] in types]
    if problem.ps_resource not in types:
        raise InfeasibleError(
            f"the PS resource type {problem.ps_resource!r} is not in the cluster now (present: {types}); "
            "no plan can place the parameter servers",
            0.0,
        )
    data["resources"] = keep
    if data.get("hosts"):  # a shared machine keeps only the types still present on it
        for host in data["hosts"]:
            host["types"] = [t for t in host["types"] if t in types]
        data["hosts"] = [host for host in data["hosts"] if host["types"]] or None
    data.setdefault("ps", {})["resource"] = problem.ps_resource
    for layer in data["layers"]:
        layer["time_ms"] = {t: v for t, v in layer["time_ms"].items() if t in types}
        if not layer["time_ms"]:
            raise InfeasibleError(
                f"layer {layer['name']!r} can run on none of the resource types present now ({types})", 0.0
            )
    return problem_from_dict(data)


def profile_joined_types(
    job: JobConfig,
    problem: Problem,
    types: list[str],
    settings: ProfileSettings,
    estimate: TableEstimate | None,
) -> tuple[Problem, list[str]]:
    """`problem` with the `types` it has no profile of (they joined the cluster mid-run) measured now on
    real actors, with the same `settings` (a ProfileSettings) and table `estimate` as the first profile, and their fitted
    entries merged in: each layer's time_ms on them (calibrated by their runtime probes), their resource
    entry (bandwidth and latency from transfers to their own kind and to the PS type, read rate, per-call
    work) and their probes' call_ms (DESIGN.md §3b). The PS type is
    profiled beside them (its actors host the PS run and the other end of the transfers; a PS shard on
    a joined type could find no slot beside its two profiling actors) but its entries, like every
    other type's, the PS service rate and the parallel fractions, stay as first measured. Returns the
    problem and the types profiled (none when no type joined, or the PS type is gone: no plan then)."""
    joined = [t for t in types if t not in problem.type_names]
    if not joined or problem.ps_resource not in types:
        return problem, []
    measured = [problem.ps_resource, *joined]
    cluster = job.cluster.model_copy(
        update={
            "resource_types": [job.cluster.type(t) for t in measured],
            "ps": job.cluster.ps.model_copy(update={"resource": problem.ps_resource}),
        }
    )
    both = job.model_copy(update={"cluster": cluster})
    # in the runtime's warm actors (the run's idle ones reconfigured, others making room: warm.py)
    run = measure(both, build_model(job.model), settings, run_probe, WarmHosts())
    fitted = fit_runs(both, [run], settings, estimate).problem
    data = problem.to_dict()
    data["resources"] += [r for r in fitted["resources"] if r["name"] in joined]
    by_name = {layer["name"]: layer for layer in fitted["layers"]}
    for layer in data["layers"]:
        layer["time_ms"].update({t: v for t, v in by_name[layer["name"]]["time_ms"].items() if t in joined})
    calls = (fitted.get("runtime") or {}).get("call_ms", {})  # the probes' call terms of the joined types
    if "runtime" in data and calls:
        data["runtime"]["call_ms"] = {
            **data["runtime"].get("call_ms", {}),
            **{t: calls[t] for t in joined if t in calls},
        }
    return problem_from_dict(data), joined
