"""Config validation: every bad config names the file, the field and what was expected; exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from heterps_ray.config import load_cluster, load_job
from heterps_ray.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
LOCAL_CLUSTER = REPO / "configs" / "clusters" / "local.yaml"


def _job(**changes) -> dict:
    job = {
        "name": "t",
        "model": {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [16, 8]},
        "cluster": str(LOCAL_CLUSTER),
        "data": {"path": "data"},
        "batch_size": 64,
        "samples": 10_000,
        "throughput_min": 100,
        "output_dir": "out",
    }
    job.update(changes)
    return job


def _write(tmp_path: Path, data: dict, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_valid_job_resolves_paths_against_its_file(tmp_path):
    job = load_job(_write(tmp_path, _job()))
    assert job.cluster.name == "local-two-cpu"
    assert job.data.path == (tmp_path / "data").resolve()
    assert job.output_dir == (tmp_path / "out").resolve()
    assert job.model.params == {"embedding_dim": 4, "hidden": [16, 8]}


def test_shipped_clusters_are_valid():
    for path in sorted((REPO / "configs" / "clusters").glob("*.yaml")):
        cluster = load_cluster(path)
        assert cluster.ps_resource in {t.name for t in cluster.resource_types}


def test_local_cluster_declares_two_cpu_types_with_different_threads():
    cluster = load_cluster(LOCAL_CLUSTER)
    threads = {t.name: t.torch_threads for t in cluster.resource_types}
    assert len(threads) == 2 and len(set(threads.values())) == 2
    opts = cluster.type("cpu_big").actor_options()
    assert opts["resources"] == {"cpu_big": 1.0} and opts["num_gpus"] == 0
    # "auto" with no job to decide: torch's OpenMP threads sleep while waiting (the types share cores)
    assert opts["runtime_env"] == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}
    spinning = cluster.type("cpu_big").model_copy(update={"omp_wait_policy": "active"})
    assert spinning.actor_options()["runtime_env"]["env_vars"]["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, "ACTIVE"),  # sync, one micro-batch: no two stages compute at once
        ({"mode": "async"}, "PASSIVE"),
        ({"runtime": {"micro_batches": 2}}, "PASSIVE"),  # GPipe: stages overlap
    ],
)
def test_auto_wait_policy_spins_only_where_stages_never_compute_at_once(tmp_path, changes, expected):
    job = load_job(_write(tmp_path, _job(**changes)))
    for rtype in job.cluster.resource_types:
        assert rtype.actor_options()["runtime_env"]["env_vars"]["OMP_WAIT_POLICY"] == expected
    # the resolved job round-trips (a job dumped to a file, as the tests and `heterps run` do)
    assert load_job(_write(tmp_path, job.model_dump(mode="json"), "again.yaml")).cluster == job.cluster


def test_a_types_own_wait_policy_is_kept_whatever_the_mode(tmp_path):
    cluster = yaml.safe_load(LOCAL_CLUSTER.read_text())
    cluster["resource_types"][1]["omp_wait_policy"] = "passive"
    job = load_job(_write(tmp_path, _job(cluster=cluster)))
    policies = {t.name: t.wait_policy for t in job.cluster.resource_types}
    assert policies == {"cpu_small": "active", "cpu_big": "passive"}


@pytest.mark.parametrize(
    ("changes", "field", "expected"),
    [
        ({"batchsize": 64}, "batchsize", "unknown field"),
        ({"batch_size": "big"}, "batch_size", "integer"),
        ({"mode": "fast"}, "mode", "'sync' or 'async'"),
        ({"throughput_min": -1}, "throughput_min", "greater than or equal to 0"),
        ({"runtime": {"micro_batches": 5}}, "runtime", "micro_batches (5) to divide batch_size (64)"),
    ],
)
def test_bad_job_field_names_file_field_and_expectation(tmp_path, changes, field, expected):
    path = _write(tmp_path, _job(**changes))
    with pytest.raises(ConfigError) as err:
        load_job(path)
    message = str(err.value)
    assert str(path) in message and f"'{field}'" in message and expected in message


def test_missing_field(tmp_path):
    raw = _job()
    del raw["samples"]
    with pytest.raises(ConfigError, match=r"field 'samples': expected a value \(the field is required\)"):
        load_job(_write(tmp_path, raw))


def test_negative_price_in_cluster_file_names_the_cluster_file(tmp_path):
    cluster = yaml.safe_load(LOCAL_CLUSTER.read_text())
    cluster["resource_types"][1]["price_per_hour"] = -0.5
    cluster_path = _write(tmp_path, cluster, "cluster.yaml")
    with pytest.raises(ConfigError) as err:
        load_job(_write(tmp_path, _job(cluster="cluster.yaml")))
    assert str(cluster_path) in str(err.value)
    assert "'resource_types.1.price_per_hour'" in str(err.value)


def test_unknown_ps_resource_type(tmp_path):
    cluster = yaml.safe_load(LOCAL_CLUSTER.read_text())
    cluster["ps"]["resource"] = "a100"
    with pytest.raises(ConfigError, match="ps.resource 'a100' is not a resource type"):
        load_cluster(_write(tmp_path, cluster, "cluster.yaml"))


def test_duplicate_resource_type(tmp_path):
    cluster = yaml.safe_load(LOCAL_CLUSTER.read_text())
    cluster["resource_types"][1]["name"] = "cpu_small"
    with pytest.raises(ConfigError, match="must be unique"):
        load_cluster(_write(tmp_path, cluster, "cluster.yaml"))


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="a readable YAML file"):
        load_job(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="a mapping at the top level"):
        load_job(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="valid YAML"):
        load_job(tmp_path / "broken.yaml")


def test_cli_bad_config_exits_2_and_writes_nothing(tmp_path):
    path = _write(tmp_path, _job(batch_size=-3))
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = subprocess.run(
        [sys.executable, "-m", "heterps_ray", "check", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "batch_size" in proc.stderr and str(path) in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_removed_compiled_graph_option_is_refused_naming_it(tmp_path):
    """runtime.compiled_graph was removed (Ray Compiled Graphs are in maintenance mode upstream): a job
    that still sets it is bad input naming the field, not silently trained without it."""
    path = _write(tmp_path, _job(runtime={"compiled_graph": True}))
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert "runtime.compiled_graph" in str(err.value) and "unknown field" in str(err.value)
    proc = subprocess.run(
        [sys.executable, "-m", "heterps_ray", "check", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "compiled_graph" in proc.stderr


def test_cli_check_ok(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "heterps_ray", "check", str(_write(tmp_path, _job()))],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "cpu_small" in proc.stdout and "cpu_big" in proc.stdout
