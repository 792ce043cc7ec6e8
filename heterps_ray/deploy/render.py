"""A cluster config rendered as a KubeRay ``RayCluster`` manifest or a ``ray up`` cluster config.

One worker group (KubeRay) or node type (``ray up``) per resource type. A resource type's price and
``max_instances`` count actors, so a node of the group hosts one actor: it declares the type's custom
resource ``{name: 1}``, the actor's CPUs (rounded up to whole CPUs) and, for ``cuda`` types, its GPUs;
replicas scale from 0 (the PS type: from ``ps.min_shards``) to ``max_instances``. Prices are kept as
labels. The head runs the driver and no actor (``num-cpus: 0``).

GPU worker groups (KubeRay) land only on their own kind of node and on GPU nodes' taints: each carries
a nodeSelector (default ``heterps.io/resource-type: <type>``, a label the user puts on that node pool;
``node_selectors`` gives a type the labels its cloud already sets, e.g. GKE's
``cloud.google.com/gke-accelerator``), so an ``a100`` pod cannot land on a T4 node, and tolerates the
``nvidia.com/gpu`` NoSchedule taint GPU node pools carry. Their image is ``gpu_image``: one that holds a
CUDA build of torch and heterps_ray (deploy/Dockerfile); Ray's own ``-gpu`` image holds neither, so
it is only the default when no image is given at all.

Several nodes read the same dataset and write the same output directory (DataWorkers read their
partitions, PS shards write checkpoint snapshots), so both live on storage every node mounts at the
same path: a PersistentVolumeClaim (ReadWriteMany) in the KubeRay manifest, an NFS export in the
``ray up`` config.

Both scale idle nodes down after ``idle_timeout_s`` (KubeRay: ``autoscalerOptions.idleTimeoutSeconds``;
``ray up``: ``idle_timeout_minutes``). The KubeRay manifest turns on Ray's token authentication, as
``scripts/ray_cluster.sh`` does for the local cluster: every Ray container (head, workers, the
autoscaler sidecar) gets ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` from the key ``auth_token`` of a
Kubernetes Secret the user creates (:func:`auth_secret_help`). Plain env vars rather than KubeRay's
``authOptions`` (v1.5.1+), so any KubeRay that runs this Ray version accepts the manifest. What goes
into a shell command of the ``ray up`` config (``--nfs``, the image) is validated and quoted. Example::

    manifest = kuberay_manifest(load_cluster("configs/clusters/cloud_gpu.yaml"))
    config = ray_up_config(cluster, instance_types={"cpu": "c5.2xlarge", "t4": "g4dn.xlarge", ...})
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
from typing import Any

import ray

from heterps_ray.config import ClusterConfig, ResourceType
from heterps_ray.errors import ConfigError

SHARED_MOUNT = "/mnt/heterps"  # where every node sees the shared storage (data, output_dir)
IMAGE = f"rayproject/ray:{ray.__version__}-py311"  # + "-gpu" for cuda types; use one with heterps_ray
GPU_TAINT = "nvidia.com/gpu"  # the taint GPU node pools carry (GKE, EKS and AKS GPU pools, NVIDIA's operator)
MEMORY_GIB_PER_CPU = 4
HEAD_CPUS = 2
LABEL_PREFIX = "heterps.io"
# An idle worker node is released after 5 min, `ray up`'s own default (KubeRay's is 60 s): a node idle
# between two phases of a run (a restore, a re-plan) is kept; a forgotten one costs 5 min of its price.
IDLE_TIMEOUT_S = 300
AUTH_TOKEN_KEY = "auth_token"  # the Secret's key, as KubeRay's own token-auth samples name it
AUTH_SECRET_SUFFIX = "-ray-token"  # default Secret: <cluster>-ray-token
# HOST:/EXPORT of --nfs: a DNS name or IPv4 (or [IPv6]), then an absolute path of safe characters.
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NFS_HOST = rf"(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*|\[[0-9A-Fa-f:.]+\])"
_NFS_PATH = r"/[A-Za-z0-9._/-]*"
_IMAGE = r"[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}"  # a container image reference (registry/repo:tag@digest)


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
    auth_secret: str | None = None,
    idle_timeout_s: int = IDLE_TIMEOUT_S,
    gpu_image: str | None = None,
    node_selectors: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A ``ray.io/v1`` RayCluster with one autoscaled worker group per resource type; every pod mounts
    the claim ``pvc`` (default ``<cluster>-shared``, ReadWriteMany) at :data:`SHARED_MOUNT`, and every Ray
    container authenticates with the token in the Secret ``auth_secret`` (default ``<cluster>-ray-token``).
    GPU groups run ``gpu_image`` (default: ``image``, or Ray's -gpu image when ``image`` is Ray's own), on
    nodes matching ``node_selectors[type]`` (default :func:`gpu_node_selector`), tolerating the GPU taint."""
    name = _dns_name(cluster.name, "cluster.name")
    claim = pvc or f"{name}-shared"
    image = _image(image)
    gpu_image = _image(gpu_image, "--gpu-image") if gpu_image else (f"{image}-gpu" if image == IMAGE else image)
    selectors = _node_selectors(cluster, node_selectors or {})
    secret = _secret_name(auth_secret or default_auth_secret(cluster))
    idle = _idle_timeout(idle_timeout_s)
    auth_env = [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": AUTH_TOKEN_KEY}}},
    ]

    def volumes() -> list[dict[str, Any]]:
        return [{"name": "shared", "persistentVolumeClaim": {"claimName": claim}}]

    def container(role: str, cpus: int, gpus: int, gpu: bool) -> dict[str, Any]:
        limits: dict[str, Any] = {"cpu": str(cpus), "memory": f"{cpus * memory_gib_per_cpu}Gi"}
        if gpus:
            limits["nvidia.com/gpu"] = str(gpus)
        spec: dict[str, Any] = {
            "name": f"ray-{role}",
            "image": gpu_image if gpu else image,
            "env": copy.deepcopy(auth_env),
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
        pod: dict[str, Any] = {
            "containers": [container("worker", res["CPU"], res.get("GPU", 0), rtype.device == "cuda")],
            "volumes": volumes(),
        }
        if rtype.name in selectors:
            pod["nodeSelector"] = selectors[rtype.name]
        if "GPU" in res:
            pod["tolerations"] = [{"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"}]
        groups.append(
            {
                "groupName": _dns_name(rtype.name, f"resource_types[{rtype.name}].name"),
                "replicas": low,
                "minReplicas": low,
                "maxReplicas": high,
                "rayStartParams": params,
                "template": {"metadata": {"labels": _labels(cluster, rtype)}, "spec": pod},
            }
        )
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "labels": {f"{LABEL_PREFIX}/cluster": name}},
        "spec": {
            "rayVersion": ray.__version__,
            "enableInTreeAutoscaling": True,
            # The autoscaler sidecar talks to the GCS too, so it carries the token as well.
            "autoscalerOptions": {"idleTimeoutSeconds": idle, "env": copy.deepcopy(auth_env)},
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
    idle_timeout_s: int = IDLE_TIMEOUT_S,
    gpu_image: str | None = None,
) -> dict[str, Any]:
    """An AWS ``ray up`` config with one node type per resource type, on the EC2 instance types given
    (``instance_types[name]``: they fix each type's GPU kind). ``nfs`` (``HOST:/export``, validated by
    :func:`nfs_export`) is mounted at :data:`SHARED_MOUNT` on every node and into the containers. GPU
    node types run ``gpu_image`` (default as :func:`kuberay_manifest`)."""
    image = _image(image)
    gpu_image = _image(gpu_image, "--gpu-image") if gpu_image else (f"{image}-gpu" if image == IMAGE else None)
    idle = _idle_timeout(idle_timeout_s)
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
        if rtype.device == "cuda" and gpu_image is not None:
            entry["docker"] = {"worker_image": gpu_image}
        node_types[rtype.name] = entry
    run_options = ["--ulimit nofile=65536:65536"]
    initialization: list[str] = []
    if nfs is not None:
        export, mount = shlex.quote(nfs_export(nfs)), shlex.quote(SHARED_MOUNT)
        initialization = [
            f"sudo mkdir -p {mount}",
            f"mountpoint -q {mount} || sudo mount -t nfs4 {export} {mount}",
        ]
        run_options.append(f"-v {SHARED_MOUNT}:{SHARED_MOUNT}")
    return {
        "cluster_name": _dns_name(cluster.name, "cluster.name"),
        "max_workers": sum(t.max_instances for t in cluster.resource_types),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle // 60 if idle % 60 == 0 else idle / 60,
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


def nfs_export(value: str) -> str:
    """``value`` when it is ``HOST:/EXPORT`` (a DNS name, IPv4 or [IPv6] host; an absolute path of letters,
    digits and ``._-/``, no ``..``); else a ConfigError of ``--nfs``. It goes into a shell command."""
    match = re.fullmatch(rf"({_NFS_HOST}):({_NFS_PATH})", value)
    if match is None or len(match[1]) > 253 or ".." in match[2].split("/"):
        expected = "HOST:/EXPORT (a host name or IP, then an absolute path of letters, digits, '._-/')"
        raise ConfigError(None, "--nfs", expected, value)
    return value


def default_auth_secret(cluster: ClusterConfig) -> str:
    """The Secret the KubeRay manifest reads the Ray token from unless told otherwise."""
    return _dns_name(cluster.name, "cluster.name") + AUTH_SECRET_SUFFIX


def auth_secret_help(secret: str) -> list[str]:
    """The Secret a rendered manifest expects, and how to make it and use it (comment lines)."""
    return [
        f"Ray token authentication: every Ray container reads RAY_AUTH_TOKEN from the Secret {secret!r},",
        f"key {AUTH_TOKEN_KEY!r}. Create it before applying this manifest, in the same namespace:",
        f'  kubectl create secret generic {secret} --from-literal={AUTH_TOKEN_KEY}="$(openssl rand -hex 32)"',
        "It has this shape:",
        "  apiVersion: v1",
        "  kind: Secret",
        f"  metadata: {{name: {secret}}}",
        "  type: Opaque",
        f"  stringData: {{{AUTH_TOKEN_KEY}: <a long random string>}}",
        "Clients (ray job submit, the dashboard) need the same token:",
        f'  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$(kubectl get secret {secret} '
        f"-o jsonpath='{{.data.{AUTH_TOKEN_KEY}}}' | base64 -d)\"",
    ]


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


def _secret_name(name: str) -> str:
    """A Kubernetes Secret name (RFC 1123 subdomain): lower-case letters, digits, '-' and '.'."""
    label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
    if len(name) > 253 or not re.fullmatch(rf"{label}(\.{label})*", name):
        expected = "a Secret name of lower-case letters, digits, '-' and '.'"
        raise ConfigError(None, "--auth-secret", expected, name)
    return name


def _idle_timeout(seconds: int) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
        raise ConfigError(None, "--idle-timeout", "whole seconds >= 0", seconds)
    return seconds


def _image(image: str, field: str = "--image") -> str:
    """``image`` when it is a plain image reference: ``ray up`` pastes it into ``docker`` commands."""
    if not re.fullmatch(_IMAGE, image):
        raise ConfigError(None, field, "an image reference of letters, digits and '._/:@-'", image)
    return image


def gpu_node_selector(rtype: ResourceType) -> dict[str, str]:
    """The default nodeSelector of a GPU type's pods: the node pool labelled with the type's name."""
    return {f"{LABEL_PREFIX}/resource-type": rtype.name}


def _node_selectors(cluster: ClusterConfig, given: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Each type's nodeSelector: the one given, else the default for GPU types (CPU types: none)."""
    names = [t.name for t in cluster.resource_types]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(None, "--node-selector", f"TYPE=KEY=VALUE for a resource type of {names}", unknown)
    out = {t.name: gpu_node_selector(t) for t in cluster.resource_types if t.device == "cuda"}
    for name, labels in given.items():
        for key, value in labels.items():
            if not re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9._-]{1,63}", key) or not re.fullmatch(
                r"[A-Za-z0-9._-]{0,63}", value
            ):
                raise ConfigError(None, "--node-selector", "TYPE=KEY=VALUE with a Kubernetes label", f"{key}={value}")
        out[name] = dict(labels)
    return out


def _quoted_json(resources: dict[str, int]) -> str:
    """rayStartParams' resources, shell-quoted as KubeRay's docs write it (``'"{\\"Custom1\\": 1}"'`` in
    YAML): KubeRay pastes the value into the ``ray start --resources=`` command line."""
    return json.dumps(json.dumps(resources))
