"""Host CPU sharing in the simulator: actors of types declared on one machine share its cores, in
proportion to their threads; without `hosts` nothing changes."""

from __future__ import annotations

import json

import pytest

from heterps_ray.cli import main
from heterps_ray.costmodel import problem_from_dict
from heterps_ray.costmodel.simulator import simulate
from heterps_ray.errors import ConfigError

B = 512


def _problem(hosts=None, threads=(1, 1), fixed_ms=(0.0, 10.0, 10.0)):
    """Three layers; with plan [a, b, b] -> stage 0 (layer emb on a), stage 1 (fc1, fc2 on b).
    No messages, no PS limit, so the stages' compute is all that takes time."""
    data = {
        "name": "hosts",
        "batch_size": B,
        "samples": 1e7,
        "throughput_min": 0,
        "resources": [
            {"name": "a", "price_per_hour": 1, "max_instances": 8, "bandwidth_gbps": 1e9, "threads": threads[0]},
            {"name": "b", "price_per_hour": 1, "max_instances": 8, "bandwidth_gbps": 1e9, "threads": threads[1]},
        ],
        "layers": [
            {"name": name, "out_bytes_per_sample": 0, "time_ms": {t: {"fixed": ms, "per_sample": 0.0} for t in "ab"}}
            for name, ms in zip(("emb", "fc1", "fc2"), fixed_ms, strict=True)
        ],
    }  # fmt: skip
    if hosts is not None:
        data["hosts"] = hosts
    return problem_from_dict(data)


def _plan(stages):
    return {
        "stages": [{"layers": layers, "type": t, "replicas": k} for layers, t, k in stages],
        "ps_shards": 1,
    }


# two CPU-bound stages of 10 ms each: the DataWorker's stage (emb + fc1 on a), and fc2 on b
_TWO_STAGES = _plan([(["emb", "fc1"], "a", 1), (["fc2"], "b", 1)])


def _rate(problem, plan=_TWO_STAGES, **kw):
    return simulate(problem, plan, batches=200, mode="async", max_in_flight=4, **kw).throughput


def test_two_cpu_bound_stages_on_one_core_take_twice_as_long():
    apart = _rate(_problem())
    shared = _rate(_problem(hosts=[{"name": "box", "cores": 1, "types": ["a", "b"]}]))
    assert apart == pytest.approx(B / 10.0 * 1000.0, rel=0.03)  # pipelined: one stage's 10 ms per batch
    assert apart / shared == pytest.approx(2.0, rel=0.03)


def test_enough_cores_change_nothing_and_threads_weigh_in():
    apart = _rate(_problem(threads=(1, 2)))
    two_cores = _rate(_problem(hosts=[{"name": "box", "cores": 3, "types": ["a", "b"]}], threads=(1, 2)))
    assert two_cores == pytest.approx(apart, rel=1e-9)
    # 1 + 2 threads busy on 2 cores: each runs at 2/3 of its solo speed while both are busy
    short = _rate(_problem(hosts=[{"name": "box", "cores": 2, "types": ["a", "b"]}], threads=(1, 2)))
    assert apart / short == pytest.approx(1.5, rel=0.03)
    # background load takes cores away
    loaded = _rate(
        _problem(
            hosts=[{"name": "box", "cores": 2, "types": ["a", "b"], "background_cores": 0.5}], threads=(1, 2)
        )
    )
    assert apart / loaded == pytest.approx(2.0, rel=0.03)


def test_without_hosts_or_with_sharing_off_results_are_unchanged():
    declared = _problem(hosts=[{"name": "box", "cores": 1, "types": ["a", "b"]}])
    plain = simulate(_problem(), _TWO_STAGES, batches=50, mode="sync", micro_batches=4)
    off = simulate(declared, _TWO_STAGES, batches=50, mode="sync", micro_batches=4, host_sharing=False)
    assert off.throughput == plain.throughput
    assert off.utilisation == plain.utilisation
    # sync, one micro-batch: the stages never overlap, so sharing a core costs nothing
    sync_plain = simulate(_problem(), _TWO_STAGES, batches=20, mode="sync")
    sync_shared = simulate(declared, _TWO_STAGES, batches=20, mode="sync")
    assert sync_shared.throughput == pytest.approx(sync_plain.throughput, rel=1e-9)


def test_the_ps_shard_shares_the_host_too():
    data = _problem().model_dump(mode="json", exclude_none=True)
    data["ps"] = {"resource": "a", "rows_per_second_per_shard": 512 * 26 / 0.010}  # 10 ms per batch
    data["layers"][0]["sparse_rows_per_sample"] = 26
    plan = _plan([(["emb", "fc1", "fc2"], "a", 2)])
    apart = _rate(problem_from_dict(data), plan, ps_limit=True)
    data["hosts"] = [{"name": "box", "cores": 1, "types": ["a", "b"]}]
    shared = _rate(problem_from_dict(data), plan, ps_limit=True)
    assert shared < apart * 0.7


@pytest.mark.parametrize(
    "hosts, field",
    [
        ([{"name": "box", "cores": 2, "types": ["a", "z"]}], "hosts.0.types"),
        (
            [{"name": "x", "cores": 2, "types": ["a"]}, {"name": "y", "cores": 2, "types": ["a"]}],
            "hosts.1.types",
        ),
        ([{"name": "box", "cores": 2, "types": ["a"], "background_cores": 2}], "hosts.0.background_cores"),
        ([{"name": "box", "cores": 0, "types": ["a"]}], "hosts.0.cores"),
    ],
)
def test_bad_hosts_are_named(hosts, field):
    with pytest.raises(ConfigError) as err:
        _problem(hosts=hosts)
    assert field in str(err.value)


def test_simulate_command_shows_the_shared_host(tmp_path, capsys):
    problem = _problem(hosts=[{"name": "box", "cores": 1, "types": ["a", "b"]}])
    problem_file = problem.save(tmp_path / "problem.yaml")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(_TWO_STAGES))
    assert (
        main(["simulate", "--problem", str(problem_file), "--plan", str(plan_file), "--mode", "async"]) == 0
    )
    out = capsys.readouterr().out
    assert "host box: 1 cores shared by a, b" in out
    assert (
        main(["simulate", "--problem", str(problem_file), "--plan", str(plan_file), "--no-host-sharing"]) == 0
    )
    assert "host box" not in capsys.readouterr().out
