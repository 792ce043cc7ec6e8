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


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """2,000 synthetic rows, seed 11 (1,800 train rows: 28 batches of 64): the data of the tiny sync
    jobs (helpers.tiny_sync_job) that several files train and resume on. Read only: shared."""
    from heterps_ray.data.synth import synthesize

    path = tmp_path_factory.mktemp("tiny") / "data"
    synthesize(path, 2_000, seed=11, rows_per_part=1_000)
    return path


UNDISTURBED_STEPS = 12  # batches of the undisturbed run the resume tests compare with


@pytest.fixture(scope="session")
def undisturbed_tiny_run(ray_local, tiny_dataset, tmp_path_factory):
    """The undisturbed run a resumed one must equal, trained once for the session: a tiny sync job on
    tiny_dataset under configs/plans/small_three_stage.json (3 stages, 2 PS shards), UNDISTURBED_STEPS
    batches; (its RunSummary, its output_dir). Its output_dir is only read."""
    from helpers import tiny_sync_job

    from heterps_ray.costmodel.plan import load_plan
    from heterps_ray.runtime.driver import train

    out = tmp_path_factory.mktemp("undisturbed") / "whole"
    plan = load_plan(REPO / "configs" / "plans" / "small_three_stage.json")
    summary = train(
        tiny_sync_job("undisturbed", tiny_dataset, out), plan, steps=UNDISTURBED_STEPS, progress=False
    )
    return summary, out
