"""runtime/batch_profile.py: what a DataWorker's batches dispatch and wait for, and each thread's CPU."""

from __future__ import annotations

import threading

import torch

from heterps_ray.runtime.batch_profile import OpCounter, ThreadCPU


def _batch(x: torch.Tensor) -> None:
    """Three ops called from Python, two of which a GPU would wait on (boolean indexing, int())."""
    kept = x[x > 0]  # gt, then index: a nonzero inside
    int(kept.sum())  # sum, then item


def test_ops_are_counted_per_batch_over_the_profiled_batches_only():
    x = torch.randn(1000)
    counter = OpCounter(batches=3, skip=2)
    for _ in range(7):
        counter.before_batch()
        _batch(x)
        counter.after_batch()
    ops = counter.per_batch
    assert ops is not None
    assert ops["aten_ops"] == 4.0  # gt, index, sum, _local_scalar_dense (item), a batch
    assert ops["data_dependent_ops"] == 2.0  # nonzero (in index), _local_scalar_dense
    assert ops["gpu_kernels"] == 0.0 and ops["host_syncs"] == 0.0
    assert 0 < ops["aten_ms"] <= ops["wall_ms"] and ops["host_ms"] == ops["wall_ms"] - ops["aten_ms"]


def test_data_that_ends_mid_profile_is_counted_over_the_batches_seen():
    x = torch.randn(1000)
    counter = OpCounter(batches=10, skip=1)
    for _ in range(3):
        counter.before_batch()
        _batch(x)
        counter.after_batch()
    counter.before_batch()  # the read that finds no batch
    counter.after_batch(last=True)
    assert counter.per_batch is not None and counter.per_batch["aten_ops"] == 4.0


def test_each_threads_cpu_goes_to_its_role_and_an_off_clock_reads_nothing():
    clock = ThreadCPU()
    clock.name("training")
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:  # a reader: alive while the clock reads, as a DataWorker's is
        clock.name("reader")
        sum(i * i for i in range(300_000))
        spun.set()
        done.wait()

    reader = threading.Thread(target=spin)
    with clock.running():
        reader.start()
        sum(i * i for i in range(300_000))
        spun.wait()
    done.set()
    reader.join()
    assert clock.seconds["training"] > 0 and clock.seconds["reader"] > 0
    off = ThreadCPU(on=False)
    with off.running():
        sum(i * i for i in range(100_000))
    assert off.seconds == {}
