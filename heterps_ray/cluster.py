"""The Ray a command runs on: an existing cluster, or an embedded local one with the job's resource types.

One rule for every command (profile, train, run, plan with rl):
1. a Ray already initialised in this process is used as it is;
2. else `address` (``--address``), else ``$RAY_ADDRESS`` (set inside ``ray job submit``): connect;
3. else start an embedded local Ray that declares each resource type of the cluster config as a
   custom resource with ``max_instances`` units, so actors are admitted per type as on a real cluster.
   ``address="local"`` keeps it from attaching to a ``ray start`` cluster on the same machine; the
   dashboard stays off, and the object store is bounded instead of taking 30% of RAM.
"""

from __future__ import annotations

import os

from heterps_ray.config import ClusterConfig

OBJECT_STORE_BYTES = 1 << 30  # embedded Ray: 1 GiB object store


def connect(cluster: ClusterConfig | None, address: str | None = None) -> bool:
    """Make sure Ray is initialised; returns True when this call started it (the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        return True
    ray.init(
        address="local",
        resources=cluster.local_resources() if cluster else None,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    return True
