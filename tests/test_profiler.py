"""`heterps profile` on the real local Ray: actors per resource type measure a tiny model, and the
result is a valid problem file with every layer on both local types, plus the raw measurements."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from heterps_ray.cli import main
from heterps_ray.config import load_job
from heterps_ray.costmodel import CostModel, load_problem
from heterps_ray.models import build_model
from heterps_ray.profiling.probes import ONE_STAGE_AGREE
from heterps_ray.profiling.profiler import ProfileSettings
from heterps_ray.runtime import warm

REPO = Path(__file__).resolve().parents[1]


# Four torch actors start on 2 cores: ~25 s on a quiet machine, over a minute on a busy one.
@pytest.mark.slow
def test_profile_command_writes_a_valid_problem_for_both_local_types(ray_local, tmp_path, capsys):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-profile",
                "model": {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [16, 8]},
                "cluster": str(REPO / "configs" / "clusters" / "local.yaml"),
                "data": {"path": str(tmp_path / "no-data-yet")},  # the profiler makes a small one
                "batch_size": 128,
                "samples": 1_000_000,
                "throughput_min": 100,
                "output_dir": str(tmp_path / "out"),
            }
        )
    )
    job = load_job(job_file)
    spec = build_model(job.model)
    output = tmp_path / "problem.yaml"

    before = warm.counts()
    code = main(
        [
            "profile",
            str(job_file),
            "--output",
            str(output),
            "--batch-sizes",
            "32,64,128",
            "--quick",
            "--probe-steps",
            "60",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "wrote" in out
    assert "the profile's own spread: cpu_small ±" in out  # the one-stage probes' runs, per type
    # the layer timings ran in the runtime's actors: one DataWorker and one StageWorker per type started,
    # every probe (2 two-stage of two actors, 2 x 2 one-stage of one) reconfigured them
    used = {k: warm.counts()[k] - before[k] for k in before}
    assert used["started"] <= 4 and used["reused"] >= 8, used

    problem = load_problem(output)
    # where the probe phase's time went: the runs' training loops, and the rest (start, first read, stop)
    (probe_note,) = [line for line in (problem.notes or "").splitlines() if line.startswith("runtime probes:")]
    assert re.fullmatch(r"runtime probes: ([6-9]|10) runs in [\d.]+ s, [\d.]+ s of it in their training .*", probe_note)
    assert problem.layer_names == [layer.name for layer in spec.layers]
    assert problem.type_names == ["cpu_small", "cpu_big"]
    for layer in problem.layers:
        assert set(layer.time_ms) == {"cpu_small", "cpu_big"}, layer.name
        assert 0.0 <= layer.parallel_fraction <= 1.0
        # somewhere between free and absurd for a 128-sample batch of a tiny layer
        for coeff in layer.time_ms.values():
            assert 0.0 < coeff.fixed + coeff.per_sample * 128 < 5_000.0
    for resource in problem.resources:
        cluster_type = job.cluster.type(resource.name)
        assert resource.price_per_hour == cluster_type.price_per_hour
        assert resource.max_instances == cluster_type.max_instances
        assert resource.bandwidth_gbps > 0 and resource.latency_ms > 0 and resource.io_gbps > 0
    assert problem.ps.resource == "cpu_small" and problem.ps_rows_per_second > 0
    assert problem.layers[0].sparse_rows_per_sample == spec.num_slots
    assert problem.input_bytes_per_sample == spec.input_bytes_per_sample
    assert "cpu_small: cpu x1 threads" in problem.notes and "cpu_big: cpu x2 threads" in problem.notes
    # Both local types run on this one machine: a shared host with its cores and measured background.
    assert [r.threads for r in problem.resources] == [1, 2]
    assert problem.hosts is not None and len(problem.hosts) == 1
    host = problem.hosts[0]
    assert set(host.types) == {"cpu_small", "cpu_big"}
    assert host.cores == len(os.sched_getaffinity(0))
    assert 0.0 <= host.background_cores < host.cores
    assert host.call_cpu_ms is not None and host.call_cpu_ms >= 0.0  # Ray's own CPU per actor call

    raw = pd.read_parquet(tmp_path / "problem.measurements.parquet")
    # "probe_disturbed": a one-stage run that other work on the machine ran beside, taken again
    assert set(raw["kind"]) - {"probe_disturbed"} == {
        "layer",
        "layer_pair",
        "transfer",
        "ps",
        "ps_dense",
        "input",
        "host",
        "call_cpu",
        "call",
        "stage",
        "probe",
    }
    calls = raw[raw["kind"] == "call"]  # every type's own work per call, at each message size
    assert set(calls["resource"]) == {"cpu_small", "cpu_big"} and (calls["ms"] > 0).all()
    assert all(r.call_overhead_ms >= 0.0 for r in problem.resources)
    # the whole model as one stage, at every batch size: what a stage shares of its layers' fixed times
    assert len(raw[raw["kind"] == "stage"]) == 2 * 3 * 2  # types x batch sizes x repeats
    for r in problem.resources:  # fusing the layers saves at most their fixed times, all together
        assert 0.0 <= r.fused_saving_ms <= sum(layer.time_ms[r.name].fixed for layer in problem.layers)
    layers = raw[raw["kind"] == "layer"]
    assert len(layers) == 2 * spec.num_layers * 3 * 2  # types x layers x batch sizes x repeats (quick: 2)
    assert (layers["forward_ms"] > 0).all() and (layers["backward_ms"] > 0).all()
    assert set(raw.loc[raw["kind"] == "transfer", "peer"]) == {"cpu_small", "cpu_big"}
    quality = pd.read_csv(tmp_path / "problem.fit.csv")
    assert len(quality[quality["what"] == "layer"]) == 2 * spec.num_layers
    assert quality["r2"].dropna().between(-1e9, 1.0 + 1e-9).all()
    # Poor fits are listed on top of the problem file and printed, never dropped.
    flagged = quality["flags"].fillna("").str.len().gt(0).sum()
    head = output.read_text().splitlines()[: flagged + 8]
    assert any(line.startswith("# POOR FITS") for line in head) == (flagged > 0)
    # The runtime terms (DESIGN.md §3b): the job's execution, then the probes: each type's layer times
    # calibrated to its one-stage run, then each callee's call. Priced with them, every probe's plan takes
    # the ms per batch it was measured at (unless a term was clamped: a ratio clipped, a call at 0).
    assert problem.runtime is not None and problem.runtime.mode == "sync"
    assert set(problem.runtime.call_ms) == {"cpu_small", "cpu_big"}
    assert problem.runtime.ps_wait_ms_per_row > 0
    runs = raw[raw["kind"] == "probe"]
    assert (runs["ms"] > 0).all()
    # two stages each way once, one stage on each type twice: each type's first right after the two-stage
    # probe that warmed its DataWorker, the second round reversed (a drift of the machine's speed favours
    # neither type: the fit takes the median); then a third for a type whose two runs disagree
    order = list(zip(runs["peer"], runs["resource"], runs["repeat"], strict=True))
    assert order[:6] == [
        ("cpu_small", "cpu_big", 0), ("", "cpu_small", 0), ("cpu_big", "cpu_small", 0),
        ("", "cpu_big", 0), ("", "cpu_big", 1), ("", "cpu_small", 1),
    ]  # fmt: skip
    alone = runs[runs["peer"] == ""]
    first_two = alone[alone["repeat"] < 2].groupby("resource")["ms"]
    disagree = set(first_two.max()[(first_two.max() - first_two.min()) > ONE_STAGE_AGREE * first_two.mean()].index)
    # the thirds share a budget (probe_extra) with the retakes of disturbed runs taken before them
    kinds = raw.loc[raw["kind"].isin(["probe", "probe_disturbed"]), "kind"].tolist()
    sixth = [i for i, kind in enumerate(kinds) if kind == "probe"][5]
    budget = ProfileSettings.quick().probe_extra - kinds[:sixth].count("probe_disturbed")
    thirds = [("", name, 2) for name in ("cpu_small", "cpu_big") if name in disagree]
    assert order[6:] == thirds[: max(budget, 0)]
    # the profile's own spread: half the range of each type's one-stage runs over their median
    for name, group in runs[runs["peer"] == ""].groupby("resource"):
        half = (group["ms"].max() - group["ms"].min()) / (2 * group["ms"].median())
        assert problem.runtime.spread[name] == pytest.approx(half, rel=1e-3, abs=1e-6)
    probes = runs.groupby(["resource", "peer", "layer"], as_index=False)["ms"].median()
    scales = quality[quality["what"] == "probe"].dropna(subset=["layer_scale"])
    assert set(scales["resource"]) == {"cpu_small", "cpu_big"}
    model = CostModel(problem)
    names = problem.layer_names
    for _, probe in probes.iterrows():
        split = names.index(probe["layer"]) + 1
        first = probe["peer"] or probe["resource"]
        assignment = [first] * split + [probe["resource"]] * (len(names) - split)
        limits = model.evaluate(assignment, [1] * (1 + (split < len(names))), 1).runtime
        assert limits is not None
        clamped = problem.runtime.call_ms[probe["resource"]] == 0.0 if probe["peer"] else False
        if not clamped and not scales["flags"].fillna("").str.len().gt(0).any():
            assert limits.loop_ms == pytest.approx(probe["ms"], rel=1e-3)
    # the simulator's measured details are problem fields: no side file beside it
    assert not (tmp_path / "problem.runtime.yaml").exists()
    assert problem.layers[1].dense_params == spec.layers[1].dense_params
    assert problem.ps.pull_share is not None and 0.0 < problem.ps.pull_share < 1.0

    # The profiler's actors and PS shard are gone: every unit of both types is free again.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        free = ray_local.available_resources()
        if free.get("cpu_small", 0) == 4 and free.get("cpu_big", 0) == 2:
            break
        time.sleep(0.5)
    free = ray_local.available_resources()
    assert (free.get("cpu_small"), free.get("cpu_big")) == (4, 2)


def test_a_probe_sees_other_work_on_the_machine_but_not_the_clusters_own(ray_local):
    """What the profiler counts beside a runtime probe (a disturbed one-stage run is taken again): CPU
    spent outside this driver's Ray, not the cluster's own work."""
    import subprocess
    import sys

    from heterps_ray.host_cpu import OtherWork

    @ray_local.remote(num_cpus=0)
    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    # Earlier tests' processes (a notebook's own Ray, a stopped cluster) may still be winding down:
    # start from a quiet machine, as a quiet profile does, or their CPU would read as other work here.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with OtherWork() as idle:
            time.sleep(0.5)
        if idle.cores < 0.2:
            break
    ray_local.get(spin.remote(0.01))  # the worker that runs it is up before the window opens
    owns = []
    for _ in range(3):  # a task of this cluster: its own work. Counted as other work it reads ~1 core in
        with OtherWork() as own:  # every window; a burst outside the cluster (an earlier test's Ray
            ray_local.get(spin.remote(1.0))  # winding down) lands in one window at most: the least
        owns.append(own.cores)
        if own.cores < 0.5:
            break
    assert min(owns) < 0.5, (owns, idle.cores)
    # a process outside it: started by a shell that exits at once, so it is no descendant of this one
    code = "import time\nend = time.perf_counter() + 1.5\nwhile time.perf_counter() < end: pass"
    subprocess.run(["sh", "-c", f'{sys.executable} -c "{code}" &'], check=True)
    with OtherWork() as other:
        time.sleep(1.0)
    assert other.cores > 0.6, other.cores
    assert other.cpu_ms == pytest.approx(other.cores * 1000.0 * 1.0, rel=0.2)


def test_a_slow_types_probes_train_about_probe_seconds_and_at_least_one_read_chunk(tmp_path):
    """Probe length: 100 steady batches where a batch is fast; where it is slow (a CPU type at a big
    batch) as many as last PROBE_SECONDS, never fewer than one of the data's read chunks."""
    from helpers import TINY_MODEL, local_job

    from heterps_ray.data.dataset import READ_ROWS
    from heterps_ray.profiling.probes import PROBE_SECONDS, PROBE_WARMUP, batch_ms_of, probe_steps
    from heterps_ray.profiling.rows import Row

    job = local_job("probe", TINY_MODEL, tmp_path, tmp_path / "out", batch_size=2048)
    chunk = READ_ROWS // 2048
    assert probe_steps(job) == probe_steps(job, batch_ms=3.0) == PROBE_WARMUP + 100
    assert probe_steps(job, batch_ms=30.0) == PROBE_WARMUP + int(PROBE_SECONDS * 1000 / 30)
    assert probe_steps(job, batch_ms=300.0) == PROBE_WARMUP + chunk
    assert probe_steps(job, steps=7, batch_ms=300.0) == 7
    rows = [Row("stage", "cpu", batch_size=b, ms=0.5 + 0.01 * b) for b in (64, 256, 1024)]
    rows += [Row("layer", "cpu", layer="fc1", batch_size=64, ms=99.0)]
    assert batch_ms_of(rows, 2048) == pytest.approx({"cpu": 0.5 + 0.01 * 2048})


# -- a cluster whose types hold one actor each (issue 41) ----------------------------------------


def _one_instance_job(folder: Path, data: Path) -> Path:
    """The tiny model on the local types with max_instances 1 each (PS shards on cpu_small)."""
    cluster = yaml.safe_load((REPO / "configs" / "clusters" / "local.yaml").read_text())
    for rtype in cluster["resource_types"]:
        rtype["max_instances"] = 1
    job = {
        "name": "one-instance",
        "model": {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [16, 8]},
        "cluster": cluster,
        "data": {"path": str(data)},
        "batch_size": 64,
        "samples": 1_000_000,
        "throughput_min": 0,
        "output_dir": str(folder / "out"),
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_the_ps_shard_has_no_room_beside_the_profiling_actors_of_a_one_instance_type():
    """Decided before anything starts: a type's one instance (or one Ray unit) taken by its profiling
    actor leaves none for the PS shard, whose calls would wait for placement forever."""
    from heterps_ray.config import ResourceType
    from heterps_ray.profiling.placement import actor_counts, shard_room

    small = ResourceType(name="cpu_small", price_per_hour=0.1, max_instances=1, ray_resources={"CPU": 0.25})
    node = {"Alive": True, "Resources": {"CPU": 2.0, "cpu_small": 1.0}}
    counts = actor_counts([small], [node], "cpu_small")
    assert counts == {"cpu_small": 1}
    assert shard_room(small, [node], counts) == (
        "its max_instances (1) are all taken by the profiling actors: a PS shard needs one more 'cpu_small' actor"
    )
    # four instances declared, one unit in the cluster: the unit is the limit
    four = small.model_copy(update={"max_instances": 4})
    assert shard_room(four, [node], actor_counts([four], [node], "cpu_small")) == (
        "the Ray cluster declares 1 unit(s) of 'cpu_small', all taken by the profiling actors: a PS shard "
        "needs one more"
    )
    # two instances and two units: one profiling actor, the other instance kept for the shard
    two = small.model_copy(update={"max_instances": 2})
    roomy = {"Alive": True, "Resources": {"CPU": 2.0, "cpu_small": 4.0}}
    assert actor_counts([two], [roomy], "cpu_small") == {"cpu_small": 1}
    assert shard_room(two, [roomy], {"cpu_small": 1}) is None
    assert actor_counts([four], [roomy], "cpu_small") == {"cpu_small": 2}  # 3 of 4: both actors and the shard


def test_profile_of_one_instance_types_measures_what_it_can_and_names_what_it_could_not(
    ray_local, tmp_path, capsys
):
    """The reported hang: the PS probe's shard could not be placed beside the profiling actor of its
    type, and the profile waited for it for minutes. Now the shard is not started and is named (printed
    and in the problem's notes). The runtime probes host their shard in their DataWorker, which takes
    no instance of cpu_small: those into and on cpu_small run on its one profiling actor, reconfigured."""
    from heterps_ray.data.synth import synthesize

    data = tmp_path / "data"
    synthesize(data, 3_000, seed=2)
    job_file = _one_instance_job(tmp_path, data)
    output = tmp_path / "problem.yaml"
    argv = ["profile", str(job_file), "-o", str(output), "--quick", "--probe-steps", "12", "--no-progress"]
    started = time.monotonic()
    assert main(argv) == 0, capsys.readouterr().err
    took = time.monotonic() - started
    printed = capsys.readouterr().out
    ps_line = (
        "not measured: the PS shard's rates ('cpu_small': its max_instances (1) are all taken by the "
        "profiling actors: a PS shard needs one more 'cpu_small' actor)"
    )
    assert ps_line in printed and "runtime probe" not in printed, printed
    notes = load_problem(output).notes or ""
    assert ps_line.removeprefix("not measured: ") in notes, notes
    raw = pd.read_parquet(output.with_suffix(".measurements.parquet"))
    assert raw[raw["kind"].isin(["ps", "ps_dense"])].empty  # no PS shard was started
    probes = raw[raw["kind"] == "probe"]
    assert set(probes["resource"]) == {"cpu_small", "cpu_big"}  # one stage on each, and two stages
    assert (probes["peer"] != "").any()
    assert took < 120, took


def test_a_ps_shard_that_other_work_keeps_from_its_units_is_noted_not_waited_for(ray_local, tmp_path):
    """Room on paper (4 units of cpu_small, 2 profiling actors), none in fact: other work holds the two
    units left. The profile's shard waits for placement until the start deadline, then the profile goes
    on without it (the PS round trips would have waited for it until the 900 s call timeout)."""
    from heterps_ray.profiling.profiler import profile

    small = yaml.safe_load((REPO / "configs" / "clusters" / "local.yaml").read_text())["resource_types"][0]
    assert small["name"] == "cpu_small" and small["max_instances"] == 4
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        yaml.safe_dump(
            {
                "name": "busy-ps-type",
                "model": {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [16, 8]},
                "cluster": {"name": "one-type", "resource_types": [small]},
                "data": {"path": str(tmp_path / "no-data-yet")},
                "batch_size": 64,
                "samples": 1_000_000,
                "throughput_min": 0,
                "output_dir": str(tmp_path / "out"),
            }
        )
    )
    warm.release_idle()  # the units free now are the ones the blockers and the profile get

    @ray_local.remote(num_cpus=0, resources={"cpu_small": 1})
    class Blocker:
        def ready(self) -> bool:
            return True

    units = int(ray_local.cluster_resources()["cpu_small"])  # 4: the profile's two actors get the last two
    blockers = [Blocker.remote() for _ in range(units - 2)]
    try:
        ray_local.get([b.ready.remote() for b in blockers], timeout=60)
        started = time.monotonic()
        result = profile(load_job(job_file), ProfileSettings.quick(progress=False, start_timeout_s=30.0))
        took = time.monotonic() - started
    finally:
        for b in blockers:
            ray_local.kill(b)
    assert len(result.unmeasured) == 1, result.unmeasured
    assert result.unmeasured[0].startswith(
        "the PS shard's rates: its actor on 'cpu_small' was not placed within 30 s"
    ), result.unmeasured
    assert "not measured: the PS shard's rates" in result.problem["notes"]
    assert result.measurements[result.measurements["kind"] == "ps"].empty
    assert "rows_per_second_per_shard" not in result.problem["ps"]  # unmeasured, not made up
    assert took < 120, took
