"""Small helpers shared by several test files (pytest puts tests/ on sys.path: `from helpers import ...`)."""

from __future__ import annotations

import socket
from pathlib import Path

from heterps_ray.config import JobConfig, load_cluster

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]}
TINY_BATCH = 64


def free_ports(count: int) -> list[int]:
    """`count` TCP ports free on 127.0.0.1 right now (for a `ray start` cluster of a test's own)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tiny_sync_job(name: str, dataset: Path, output: Path, checkpoint_every: int = 0) -> JobConfig:
    """A sync ctr_dnn job on the local two-type cluster, small enough to train in seconds."""
    return JobConfig.model_validate(
        {
            "name": name,
            "model": TINY_MODEL,
            "cluster": load_cluster(REPO / "configs" / "clusters" / "local.yaml").model_dump(),
            "data": {"path": str(dataset)},
            "batch_size": TINY_BATCH,
            "samples": 2_000,
            "throughput_min": 0,
            "mode": "sync",
            "output_dir": str(output),
            "seed": 7,
            "runtime": {"micro_batches": 2, "max_in_flight": 2, "checkpoint_every": checkpoint_every},
        }
    )
