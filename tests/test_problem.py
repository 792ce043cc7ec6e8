"""Problem files: YAML and JSON load, defaults apply, mistakes name the file and the field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from heterps_ray.costmodel import load_problem, problem_from_dict
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling.generator import generate_problem

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = sorted((REPO / "configs" / "problems").glob("*.yaml"))


def minimal() -> dict:
    return {
        "name": "min",
        "batch_size": 64,
        "samples": 1000,
        "throughput_min": 10,
        "resources": [{"name": "cpu", "price_per_hour": 0.1, "max_instances": 2, "bandwidth_gbps": 10}],
        "layers": [
            {"name": "l0", "out_bytes_per_sample": 4, "time_ms": {"cpu": {"fixed": 0.1, "per_sample": 0.001}}}
        ],
    }


@pytest.mark.parametrize("path", PROBLEMS, ids=lambda p: p.name)
def test_example_problems_load(path):
    problem = load_problem(path)
    assert problem.num_layers >= 5 and {"cpu", "t4", "v100", "a100"} <= set(problem.type_names)


def test_there_are_example_problems():
    assert {p.name for p in PROBLEMS} >= {"ctr_dnn_cloud.yaml", "bst_attention_cloud.yaml"}


def test_defaults_of_optional_fields():
    problem = problem_from_dict(minimal())
    layer, resource = problem.layers[0], problem.resources[0]
    assert layer.parallel_fraction == 1.0 and layer.sparse_rows_per_sample == 0
    assert resource.latency_ms == 0 and resource.io_gbps == resource.bandwidth_gbps
    assert problem.input_bytes_per_sample == 0
    assert problem.ps.min_shards == 1 and math.isinf(problem.ps_rows_per_second)
    assert problem.ps_resource == "cpu"


def test_yaml_and_json_give_the_same_problem(tmp_path):
    data = minimal()
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "p.json").write_text(json.dumps(data))
    assert load_problem(tmp_path / "p.yaml") == load_problem(tmp_path / "p.json")


def test_save_and_load_round_trip(tmp_path):
    problem = generate_problem(3, num_layers=(5, 5))
    assert load_problem(problem.save(tmp_path / "g.yaml")) == problem
    assert load_problem(problem.save(tmp_path / "g.json")) == problem


def _error(data: dict, tmp_path: Path) -> ConfigError:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_problem(path)
    assert str(path) in str(info.value)
    return info.value


def test_missing_field_is_named(tmp_path):
    data = minimal()
    del data["throughput_min"]
    assert _error(data, tmp_path).field == "throughput_min"


def test_misspelt_field_is_named(tmp_path):
    data = minimal()
    data["resources"][0]["prize_per_hour"] = 1.0
    assert _error(data, tmp_path).field == "resources.0.prize_per_hour"


def test_negative_price_is_rejected(tmp_path):
    data = minimal()
    data["resources"][0]["price_per_hour"] = -1
    assert _error(data, tmp_path).field == "resources.0.price_per_hour"


def test_parallel_fraction_above_one_is_rejected(tmp_path):
    data = minimal()
    data["layers"][0]["parallel_fraction"] = 1.5
    assert _error(data, tmp_path).field == "layers.0.parallel_fraction"


def test_layer_time_on_unknown_type_is_named(tmp_path):
    data = minimal()
    data["layers"][0]["time_ms"]["h100"] = {"fixed": 1, "per_sample": 0}
    err = _error(data, tmp_path)
    assert err.field == "layers.0.time_ms.h100" and "cpu" in err.expected


def test_layer_without_any_type_is_rejected(tmp_path):
    data = minimal()
    data["layers"][0]["time_ms"] = {}
    assert _error(data, tmp_path).field == "layers.0.time_ms"


def test_duplicate_names_are_rejected(tmp_path):
    data = minimal()
    data["resources"].append(dict(data["resources"][0]))
    assert _error(data, tmp_path).field == "resources.1.name"
    data = minimal()
    data["layers"].append(dict(data["layers"][0]))
    assert _error(data, tmp_path).field == "layers.1.name"


def test_unknown_ps_resource_is_named(tmp_path):
    data = minimal()
    data["ps"] = {"resource": "gpu"}
    assert _error(data, tmp_path).field == "ps.resource"


def test_more_min_shards_than_instances_is_rejected(tmp_path):
    data = minimal()
    data["ps"] = {"min_shards": 3}
    assert _error(data, tmp_path).field == "ps.min_shards"


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError):
        load_problem(tmp_path / "absent.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError):
        load_problem(tmp_path / "list.yaml")
