"""A cluster config rendered as a KubeRay ``RayCluster`` manifest or a ``ray up`` cluster config.

One worker group (KubeRay) or node type (``ray up``) per resource type. A resource type's price and
``max_instances`` count actors, so a node of the group hosts one actor: it declares the type's custom
resource ``{name: 1}``, the actor's CPUs (rounded up to whole CPUs) and, for ``cuda`` types, its GPUs;
replicas scale from 0 (the PS type: from ``ps.min_shards``) to ``max_instances``. Prices are kept as
labels. The head runs the driver and no actor (``num-cpus: 0``).

Several nodes read the same dataset and write the same output directory (DataWorkers read their
partitions, PS shards write checkpoint snapshots), so both live on storage every node mounts at the
same path: a PersistentVolumeClaim (ReadWriteMany) in the KubeRay manifest, an NFS export in the
``ray up`` config. Example::

    manifest = kuberay_manifest(load_cluster("configs/clusters/cloud_gpu.yaml"))
    config = ray_up_config(cluster, instance_types={"cpu": "c5.2xlarge", "t4": "g4dn.xlarge", ...})
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import ray

from heterps_ray.config import ClusterConfig, ResourceType
from heterps_ray.errors import ConfigError

SHARED_MOUNT = "/mnt/heterps"  # where every node sees the shared storage (data, output_dir)
IMAGE = f"rayproject/ray:{ray.__version__}-py311"  # + "-gpu" for cuda types; use one with heterps_ray
MEMORY_GIB_PER_CPU = 4
HEAD_CPUS = 2
LABEL_PREFIX = "heterps.io"


def node_resources(rtype: ResourceType) -> dict[str, int]:
    """What one node of ``rtype`` declares to Ray: whole CPUs, whole GPUs (cuda types), {name: 1}."""
    cpus = max(1, math.ceil(rtype.ray_resources.get("CPU", 1.0)))
    out = {"CPU": cpus}
    if rtype.device == "cuda":
        out["GPU"] = max(1, math.ceil(rtype.num_gpus))
    out[rtype.name] = 1
    return out


def replica_range(cluster: ClusterConfig, rtype: ResourceType) -> tuple[int, int]:
    """(min, max) nodes of ``rtype``: the PS type keeps its minimum shards up; others scale from 0."""
    low = cluster.ps.min_shards if rtype.name == cluster.ps_resource else 0
    return min(low, rtype.max_instances), rtype.max_instances


def kuberay_manifest(
    cluster: ClusterConfig,
    *,
    image: str = IMAGE,
    pvc: str | None = None,
    memory_gib_per_cpu: int = MEMORY_GIB_PER_CPU,
) -> dict[str, Any]:
    """A ``ray.io/v1`` RayCluster with one autoscaled worker group per resource type; every pod mounts
    the claim ``pvc`` (default ``<cluster>-shared``, ReadWriteMany) at :data:`SHARED_MOUNT`."""
    name = _dns_name(cluster.name, "cluster.name")
    claim = pvc or f"{name}-shared"

    def volumes() -> list[dict[str, Any]]:
        return [{"name": "shared", "persistentVolumeClaim": {"claimName": claim}}]

    def container(role: str, cpus: int, gpus: int, gpu_image: bool) -> dict[str, Any]:
        limits: dict[str, Any] = {"cpu": str(cpus), "memory": f"{cpus * memory_gib_per_cpu}Gi"}
        if gpus:
            limits["nvidia.com/gpu"] = str(gpus)
        spec: dict[str, Any] = {
            "name": f"ray-{role}",
            "image": f"{image}-gpu" if gpu_image and image == IMAGE else image,
            "resources": {"limits": limits, "requests": dict(limits)},
            "volumeMounts": [{"name": "shared", "mountPath": SHARED_MOUNT}],
        }
        if role == "head":
            spec["ports"] = [
                {"containerPort": 6379, "name": "gcs-server"},
                {"containerPort": 8265, "name": "dashboard"},
                {"containerPort": 10001, "name": "client"},
            ]
        return spec

    groups = []
    for rtype in cluster.resource_types:
        res = node_resources(rtype)
        low, high = replica_range(cluster, rtype)
        params = {"num-cpus": str(res["CPU"]), "resources": _quoted_json({rtype.name: 1})}
        if "GPU" in res:
            params["num-gpus"] = str(res["GPU"])
        groups.append(
            {
                "groupName": _dns_name(rtype.name, f"resource_types[{rtype.name}].name"),
                "replicas": low,
                "minReplicas": low,
                "maxReplicas": high,
                "rayStartParams": params,
                "template": {
                    "metadata": {"labels": _labels(cluster, rtype)},
                    "spec": {
                        "containers": [container("worker", res["CPU"], res.get("GPU", 0), rtype.device == "cuda")],
                        "volumes": volumes(),
                    },
                },
            }
        )
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "labels": {f"{LABEL_PREFIX}/cluster": name}},
        "spec": {
            "rayVersion": ray.__version__,
            "enableInTreeAutoscaling": True,
            "headGroupSpec": {
                "rayStartParams": {"num-cpus": "0"},  # the driver only: actors go to the worker groups
                "template": {
                    "metadata": {"labels": {f"{LABEL_PREFIX}/cluster": name}},
                    "spec": {"containers": [container("head", HEAD_CPUS, 0, False)], "volumes": volumes()},
                },
            },
            "workerGroupSpecs": groups,
        },
    }


def ray_up_config(
    cluster: ClusterConfig,
    instance_types: dict[str, str],
    *,
    head_instance_type: str = "m5.xlarge",
    region: str = "us-east-1",
    image: str = IMAGE,
    nfs: str | None = None,
) -> dict[str, Any]:
    """An AWS ``ray up`` config with one node type per resource type, on the EC2 instance types given
    (``instance_types[name]``). ``nfs`` (``HOST:/export``) is mounted at :data:`SHARED_MOUNT` on every node
    and into the containers."""
    missing = [t.name for t in cluster.resource_types if t.name not in instance_types]
    unknown = sorted(set(instance_types) - {t.name for t in cluster.resource_types})
    if missing or unknown:
        raise ConfigError(
            None,
            "--instance-type",
            f"NAME=EC2_TYPE for each resource type {[t.name for t in cluster.resource_types]}",
            f"missing {missing}" if missing else f"unknown {unknown}",
        )
    node_types: dict[str, Any] = {
        "head": {"node_config": {"InstanceType": head_instance_type}, "resources": {"CPU": 0},
                 "min_workers": 0, "max_workers": 0},
    }  # fmt: skip
    for rtype in cluster.resource_types:
        low, high = replica_range(cluster, rtype)
        entry: dict[str, Any] = {
            "node_config": {"InstanceType": instance_types[rtype.name]},
            "resources": node_resources(rtype),
            "min_workers": low,
            "max_workers": high,
            "labels": _labels(cluster, rtype),
        }
        if rtype.device == "cuda" and image == IMAGE:
            entry["docker"] = {"worker_image": f"{image}-gpu"}
        node_types[rtype.name] = entry
    run_options = ["--ulimit nofile=65536:65536"]
    initialization: list[str] = []
    if nfs:
        if ":" not in nfs:
            raise ConfigError(None, "--nfs", "HOST:/EXPORT", nfs)
        initialization = [
            f"sudo mkdir -p {SHARED_MOUNT}",
            f"mountpoint -q {SHARED_MOUNT} || sudo mount -t nfs4 {nfs} {SHARED_MOUNT}",
        ]
        run_options.append(f"-v {SHARED_MOUNT}:{SHARED_MOUNT}")
    return {
        "cluster_name": _dns_name(cluster.name, "cluster.name"),
        "max_workers": sum(t.max_instances for t in cluster.resource_types),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "provider": {"type": "aws", "region": region, "cache_stopped_nodes": False},
        "auth": {"ssh_user": "ubuntu"},
        "docker": {"image": image, "container_name": "ray_container", "pull_before_run": True,
                   "run_options": run_options},
        "available_node_types": node_types,
        "head_node_type": "head",
        "file_mounts": {},
        "initialization_commands": initialization,
        "setup_commands": [],
    }  # fmt: skip


def _labels(cluster: ClusterConfig, rtype: ResourceType) -> dict[str, str]:
    return {
        f"{LABEL_PREFIX}/cluster": _dns_name(cluster.name, "cluster.name"),
        f"{LABEL_PREFIX}/resource-type": rtype.name,
        f"{LABEL_PREFIX}/device": rtype.device,
        f"{LABEL_PREFIX}/price-per-hour": f"{rtype.price_per_hour:g}",
    }


def _dns_name(name: str, field: str) -> str:
    """A Kubernetes name (RFC 1123 label) for ``name``: lower case, ``_`` -> ``-``."""
    out = name.lower().replace("_", "-")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", out):
        raise ConfigError(None, field, "a name of letters, digits, '-' and '_' (at most 63)", name)
    return out


def _quoted_json(resources: dict[str, int]) -> str:
    """rayStartParams' resources, shell-quoted as KubeRay's docs write it (``'"{\\"Custom1\\": 1}"'`` in
    YAML): KubeRay pastes the value into the ``ray start --resources=`` command line."""
    return json.dumps(json.dumps(resources))
