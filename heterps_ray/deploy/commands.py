"""Sub-commands of deployment: `heterps cluster render` (KubeRay manifest or `ray up` config)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from heterps_ray.deploy.render import IDLE_TIMEOUT_S


def register(subparsers: Any) -> None:
    cluster = subparsers.add_parser(
        "cluster",
        help="a cluster config as a KubeRay RayCluster manifest or a `ray up` config",
        description="Cluster configs for the clusters users run: one worker group / node type per "
        "resource type, each declaring its custom resource (and GPUs for cuda types), 0..max_instances "
        "nodes (the PS type from ps.min_shards), idle nodes released after --idle-timeout, prices as labels, "
        "shared storage for data and outputs; KubeRay: Ray token authentication from a Secret.",
    )
    sub = cluster.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    cluster.set_defaults(func=lambda args: _help(cluster))
    render = sub.add_parser("render", help="write the KubeRay manifest (--kuberay) or `ray up` config (--ray-up)")
    render.add_argument("cluster", type=Path, metavar="CLUSTER.yaml", help="cluster config")
    kind = render.add_mutually_exclusive_group(required=True)
    kind.add_argument("--kuberay", action="store_true", help="a ray.io/v1 RayCluster manifest")
    kind.add_argument("--ray-up", action="store_true", help="a `ray up` cluster config (AWS)")
    render.add_argument("--output", "-o", type=Path, default=None, help="file to write (default: stdout)")
    render.add_argument("--image", default=None, help="container image with heterps_ray installed "
                        "(default: rayproject/ray of this Ray version; -gpu for cuda types)")  # fmt: skip
    render.add_argument("--gpu-image", default=None, help="image of the cuda types' nodes: one with a CUDA "
                        "build of torch and heterps_ray (deploy/Dockerfile builds it; default: --image)")  # fmt: skip
    render.add_argument("--node-selector", action="append", default=[], metavar="TYPE=KEY=VALUE",
                        help="KubeRay: a label the nodes of a type's pods must carry (repeatable; default "
                        "for cuda types: heterps.io/resource-type=TYPE, so put that label on each GPU "
                        "node pool, or name the cloud's own, e.g. "
                        "t4=cloud.google.com/gke-accelerator=nvidia-tesla-t4)")  # fmt: skip
    render.add_argument("--pvc", default=None, help="KubeRay: ReadWriteMany claim mounted at /mnt/heterps "
                        "(default: <cluster>-shared)")  # fmt: skip
    render.add_argument(
        "--instance-type", action="append", default=[], metavar="NAME=EC2_TYPE",
        help="ray up: the EC2 instance type of a resource type (one per type, e.g. t4=g4dn.xlarge)",
    )  # fmt: skip
    render.add_argument("--head-instance-type", default="m5.xlarge", help="ray up: the head's EC2 type")
    render.add_argument("--region", default="us-east-1", help="ray up: AWS region")
    render.add_argument("--nfs", default=None, metavar="HOST:/EXPORT",
                        help="ray up: NFS export (e.g. EFS) mounted at /mnt/heterps on every node "
                        "(a host name or IP, then an absolute path of letters, digits, '._-/')")  # fmt: skip
    render.add_argument("--auth-secret", default=None, metavar="NAME",
                        help="KubeRay: the Secret whose key auth_token holds the Ray token "
                        "(default: <cluster>-ray-token; the manifest's header says how to create it)")  # fmt: skip
    render.add_argument("--idle-timeout", type=int, default=IDLE_TIMEOUT_S, metavar="SECONDS",
                        help=f"seconds an idle worker node is kept before the autoscaler releases it "
                        f"(default {IDLE_TIMEOUT_S})")  # fmt: skip
    render.set_defaults(func=_render)


def _render(args: argparse.Namespace) -> int:
    import yaml

    from heterps_ray.config import load_cluster, writable
    from heterps_ray.deploy.render import (
        IMAGE,
        auth_secret_help,
        default_auth_secret,
        kuberay_manifest,
        ray_up_config,
    )
    from heterps_ray.errors import ConfigError

    if args.output is not None:
        writable(args.output, "--output", directory=False)
    cluster = load_cluster(args.cluster)
    image = args.image or IMAGE
    notes: list[str] = []
    if args.kuberay:
        secret = args.auth_secret or default_auth_secret(cluster)
        selectors: dict[str, dict[str, str]] = {}
        for item in args.node_selector:
            name, _, label = item.partition("=")
            key, sep, value = label.partition("=")
            if not sep or not name or not key:
                raise ConfigError(None, "--node-selector", "TYPE=KEY=VALUE", item)
            selectors.setdefault(name, {})[key] = value
        rendered = kuberay_manifest(cluster, image=image, pvc=args.pvc, auth_secret=secret,
                                    idle_timeout_s=args.idle_timeout, gpu_image=args.gpu_image,
                                    node_selectors=selectors)  # fmt: skip
        what = f"KubeRay RayCluster {rendered['metadata']['name']}"
        notes = auth_secret_help(secret)
    else:
        types: dict[str, str] = {}
        for item in args.instance_type:
            name, sep, instance = item.partition("=")
            if not sep or not name or not instance:
                raise ConfigError(None, "--instance-type", "NAME=EC2_TYPE", item)
            types[name] = instance
        rendered = ray_up_config(cluster, types, head_instance_type=args.head_instance_type, region=args.region,
                                 image=image, nfs=args.nfs, idle_timeout_s=args.idle_timeout,
                                 gpu_image=args.gpu_image)  # fmt: skip
        what = f"ray up config {rendered['cluster_name']}"
    header = [f"{what}, rendered by `heterps cluster render` from {args.cluster}", *notes]
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(rendered, sort_keys=False)
    if args.output is None:
        print(text, end="")
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"wrote {args.output}: {what}, {len(cluster.resource_types)} resource types")
    return 0


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0
