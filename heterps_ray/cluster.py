"""The Ray a command runs on: an existing cluster, or an embedded local one with the job's resource types.

One rule for every command (profile, train, run, plan with rl):
1. a Ray already initialised in this process is used as it is;
2. else `address` (``--address``), else ``$RAY_ADDRESS`` (set inside ``ray job submit``): connect;
3. else start an embedded local Ray that declares each resource type of the cluster config as a
   custom resource with ``max_instances`` units, so actors are admitted per type as on a real cluster
   (and the machine's GPUs; under the test flag ``HETERPS_CUDA_AS_CPU=1``, the GPUs the cuda types
   ask for: heterps_ray.devices).
   ``address="local"`` keeps it from attaching to a ``ray start`` cluster on the same machine; the
   dashboard stays off (and binds to 127.0.0.1 when asked for), token authentication stays on, and the
   object store is bounded instead of taking 30% of RAM.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from heterps_ray.config import ClusterConfig
from heterps_ray.devices import declared_gpus
from heterps_ray.errors import ConfigError

OBJECT_STORE_BYTES = 1 << 30  # embedded Ray: 1 GiB object store
DASHBOARD_HOST = "127.0.0.1"  # only this machine reaches a dashboard unless the user asks otherwise
AUTH_MODE_VAR = "RAY_AUTH_MODE"  # Ray's switch for token authentication ("token" or "disabled")

log = logging.getLogger(__name__)


def connect(
    cluster: ClusterConfig | None,
    address: str | None = None,
    *,
    dashboard: bool = False,
    dashboard_host: str = DASHBOARD_HOST,
    all_types: bool = True,
) -> bool:
    """Make sure Ray is initialised and declares every resource type of `cluster` (ConfigError if
    not; with ``all_types=False`` at least one, the others are reported: an elastic run uses them
    when they join); returns True when this call started Ray (then the caller shuts it down). A
    cluster with ``cluster.autoscale.enabled`` may declare none yet: its autoscaler
    starts the nodes that `heterps run` requests."""
    import ray

    started = not ray.is_initialized()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if started:
        if not address:
            _keep_token_auth()
        ray.init(**init_kwargs(cluster, address, dashboard=dashboard, dashboard_host=dashboard_host))
    if cluster is not None and not cluster.autoscale.enabled:
        _check_resource_types(cluster, started, all_types)
    elif cluster is not None:  # an autoscaling cluster: its types come when asked (closedloop/autoscale.py)
        log.info(
            "autoscaling cluster: nodes of %s are requested as needed",
            [t.name for t in cluster.resource_types],
        )
    return started


# Ray starts worker processes at nice 15, below its own raylet and GCS: the training actors are the work
# here, and a 2-thread torch actor that the scheduler keeps pre-empting stalls at every OpenMP barrier.
# Activations and gradients of a batch (0.5 MB for CTR-DNN at 512) travel inline in the call, core worker
# to core worker, instead of through the object store, where each costs the raylet ~2 ms of CPU.
# task_events_max_num_task_in_gcs: the GCS keeps each actor call's events for the dashboard, up to 100k
# calls by default (~250 MiB at ~2.5 KB each, reached in minutes by a pipeline's calls: the soak saw its
# RSS climb 85 MiB a minute, BENCHMARKS.md "The soak"); the newest 10k are as useful there
SYSTEM_CONFIG = {
    "worker_niceness": 0,
    "max_direct_call_object_size": 4 << 20,
    "task_events_max_num_task_in_gcs": 10_000,
}


def init_kwargs(
    cluster: ClusterConfig | None,
    address: str | None = None,
    *,
    dashboard: bool = False,
    dashboard_host: str = DASHBOARD_HOST,
) -> dict[str, Any]:
    """The `ray.init` arguments of :func:`connect`: attach to `address`, or start an embedded Ray."""
    if address:
        return {"address": address, "log_to_driver": False, "configure_logging": False}
    return {
        "address": "local",
        "resources": cluster.local_resources() if cluster else None,
        # None: Ray counts the machine's GPUs; HETERPS_CUDA_AS_CPU=1 (tests): what the cuda types ask
        "num_gpus": declared_gpus(cluster) if cluster else None,
        "object_store_memory": OBJECT_STORE_BYTES,
        "include_dashboard": dashboard,
        "dashboard_host": dashboard_host,
        "log_to_driver": False,
        "configure_logging": False,
        "_system_config": dict(SYSTEM_CONFIG),  # a copy: ray.init adds its spilling settings to the dict it is given
    }


def _keep_token_auth() -> None:
    """Token authentication is Ray's default for a local Ray; this only warns when the user's
    environment switches it off. (Setting RAY_AUTH_MODE here, after `import ray`, would leave the
    driver and the Ray it starts disagreeing about the mode: the GCS then rejects the driver.)"""
    mode = os.environ.get(AUTH_MODE_VAR)
    if mode is not None and mode.lower() != "token":
        log.warning("%s=%s: the embedded Ray runs without token authentication", AUTH_MODE_VAR, mode)


def _check_resource_types(cluster: ClusterConfig, started: bool, all_types: bool = True) -> None:
    import ray

    have = ray.cluster_resources()
    missing = [t.name for t in cluster.resource_types if have.get(t.name, 0) < 1]
    if missing and not all_types and len(missing) < len(cluster.resource_types):
        log.warning(
            "the Ray cluster lacks resource type(s) %s now: planning without them; one that joins "
            "later is profiled then and the run re-plans",
            missing,
        )
        return
    if missing:
        if started:
            ray.shutdown()
        raise ConfigError(
            None,
            "cluster.resource_types",
            f"types the Ray cluster declares as custom resources (it lacks {missing}; "
            f"start it with --resources='{json.dumps(cluster.local_resources())}'; on an autoscaling "
            "cluster whose worker groups start empty, pass --autoscale: cluster.autoscale.enabled)",
            sorted(k for k in have if k not in ("CPU", "GPU", "memory", "object_store_memory")),
        )
