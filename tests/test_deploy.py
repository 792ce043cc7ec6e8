"""`heterps cluster render`: the KubeRay manifest and the `ray up` config of a cluster config, checked
structurally, and the `ray up` one by Ray's own validator (offline: schema and the AWS defaults)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from heterps_ray.cli import main
from heterps_ray.config import load_cluster
from heterps_ray.deploy.render import SHARED_MOUNT, kuberay_manifest, ray_up_config
from heterps_ray.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CLOUD = REPO / "configs" / "clusters" / "cloud_gpu.yaml"
LOCAL = REPO / "configs" / "clusters" / "local.yaml"
EC2 = {"cpu": "c5.2xlarge", "t4": "g4dn.xlarge", "v100": "p3.2xlarge", "a100": "p4d.24xlarge"}


def _start_resources(group: dict) -> dict:
    """The custom resources KubeRay passes to `ray start --resources=` (a shell-quoted JSON)."""
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


def test_kuberay_manifest_has_one_worker_group_per_resource_type(tmp_path, capsys):
    out = tmp_path / "raycluster.yaml"
    assert main(["cluster", "render", str(CLOUD), "--kuberay", "-o", str(out)]) == 0
    assert f"wrote {out}: KubeRay RayCluster cloud-gpu" in capsys.readouterr().out
    manifest = yaml.safe_load(out.read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    spec = manifest["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert list(groups) == ["cpu", "t4", "v100", "a100"]
    cluster = load_cluster(CLOUD)
    for rtype in cluster.resource_types:
        group = groups[rtype.name]
        assert _start_resources(group) == {rtype.name: 1}
        assert group["maxReplicas"] == rtype.max_instances
        assert group["minReplicas"] == (cluster.ps.min_shards if rtype.name == "cpu" else 0)  # PS type
        assert group["rayStartParams"]["num-cpus"] == str(int(rtype.ray_resources["CPU"]))
        labels = group["template"]["metadata"]["labels"]
        assert float(labels["heterps.io/price-per-hour"]) == rtype.price_per_hour
        assert labels["heterps.io/resource-type"] == rtype.name
        (container,) = group["template"]["spec"]["containers"]
        assert container["volumeMounts"] == [{"name": "shared", "mountPath": SHARED_MOUNT}]
        if rtype.device == "cuda":
            assert group["rayStartParams"]["num-gpus"] == "1"
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert container["image"].endswith("-gpu")
        else:
            assert "num-gpus" not in group["rayStartParams"] and "nvidia.com/gpu" not in container["resources"]["limits"]
    claims = {v["persistentVolumeClaim"]["claimName"] for g in [spec["headGroupSpec"], *groups.values()]
              for v in g["template"]["spec"]["volumes"]}  # fmt: skip
    assert claims == {"cloud-gpu-shared"}  # one shared volume: data and output_dir on every pod


def test_fractional_cpus_round_up_and_names_become_kubernetes_names():
    manifest = kuberay_manifest(load_cluster(LOCAL), pvc="my-claim")
    groups = manifest["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["cpu-small", "cpu-big"]  # RFC 1123: no underscores
    assert [_start_resources(g) for g in groups] == [{"cpu_small": 1}, {"cpu_big": 1}]  # Ray's names kept
    assert [g["rayStartParams"]["num-cpus"] for g in groups] == ["1", "1"]  # 0.25 and 0.5 CPU actors
    assert groups[0]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "my-claim"


def test_ray_up_config_passes_rays_validator(tmp_path, capsys):
    from ray.autoscaler._private.util import prepare_config, validate_config

    out = tmp_path / "cluster.yaml"
    argv = ["cluster", "render", str(CLOUD), "--ray-up", "-o", str(out), "--nfs", "fs-1.efs.amazonaws.com:/"]
    argv += [f"--instance-type={name}={ec2}" for name, ec2 in EC2.items()]
    assert main(argv) == 0
    config = yaml.safe_load(out.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    nodes = config["available_node_types"]
    assert config["head_node_type"] == "head" and nodes["head"]["resources"] == {"CPU": 0}
    assert nodes["t4"]["resources"] == {"CPU": 4, "GPU": 1, "t4": 1}
    assert nodes["cpu"]["resources"] == {"CPU": 8, "cpu": 1}
    assert nodes["a100"]["node_config"] == {"InstanceType": "p4d.24xlarge"}
    assert [nodes[t]["max_workers"] for t in EC2] == [64, 16, 8, 8] and nodes["cpu"]["min_workers"] == 2
    assert nodes["v100"]["labels"]["heterps.io/price-per-hour"] == "3.06"
    assert config["max_workers"] == 96
    assert any("mount -t nfs4 fs-1.efs.amazonaws.com:/ /mnt/heterps" in c for c in config["initialization_commands"])
    assert f"-v {SHARED_MOUNT}:{SHARED_MOUNT}" in config["docker"]["run_options"]
    # An invalid edit is caught by the same validator: the check is not vacuous.
    broken = copy.deepcopy(config)
    broken["available_node_types"]["t4"]["resources"]["GPU"] = 0.5
    with pytest.raises(Exception, match="0.5"):
        validate_config(prepare_config(broken))


def test_ray_up_without_an_instance_type_per_resource_type_exits_2(capsys):
    assert main(["cluster", "render", str(CLOUD), "--ray-up", "--instance-type", "cpu=c5.2xlarge"]) == 2
    err = capsys.readouterr().err
    assert "--instance-type" in err and "missing ['t4', 'v100', 'a100']" in err
    with pytest.raises(ConfigError, match="unknown"):
        ray_up_config(load_cluster(CLOUD), {**EC2, "h100": "p5.48xlarge"})
    assert main(["cluster", "render", str(CLOUD), "--ray-up", "--instance-type", "cpu"]) == 2
