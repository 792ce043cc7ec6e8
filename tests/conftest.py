"""One real local Ray for the whole test session (start-up costs seconds): the product's embedded Ray
(cluster.init_kwargs) with the custom resources of configs/clusters/local.yaml declared, so actors
are admitted per resource type as in a user's run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# 200 real Criteo rows (header CSV form), copied from ../shared/data/criteo_sample.txt.
CRITEO_SAMPLE = REPO / "tests" / "data" / "criteo_sample.txt"

os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance shared by every test that needs one."""
    import ray

    from heterps_ray.cluster import init_kwargs
    from heterps_ray.config import load_cluster

    cluster = load_cluster(REPO / "configs" / "clusters" / "local.yaml")
    if not ray.is_initialized():
        # the Ray a user's embedded run gets (heterps_ray.cluster.init_kwargs: its object store, its
        # _system_config), on the machine's CPU count; address="local": always a fresh embedded
        # instance, even when a `ray start` cluster (e.g. the job-submission test's) runs here.
        kwargs = init_kwargs(cluster)
        # Two GPUs and a cuda type's resource that no CUDA device backs (tests/test_devices.py): Ray
        # admits a `gpu_t4` actor, which must then fail loudly instead of computing on the CPU.
        kwargs.update(num_gpus=2, resources={**kwargs["resources"], "gpu_t4": 2.0})
        ray.init(**kwargs)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def criteo_sample() -> Path:
    if not CRITEO_SAMPLE.exists():
        pytest.fail(f"missing {CRITEO_SAMPLE}")
    return CRITEO_SAMPLE
