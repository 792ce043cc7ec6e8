"""A DataWorker's reader (runtime/reader.py): on a thread of its own with a core to spare, in the
worker's own thread without one; the same batches in the same order either way, errors raised on
the batch where they happened."""

from __future__ import annotations

import os

import pytest

from heterps_ray.runtime.reader import Prefetcher
from heterps_ray.runtime.workers import spare_core


@pytest.mark.parametrize("thread", [True, False])
def test_items_come_in_order_and_an_error_on_the_item_where_it_happened(thread):
    read: list[int] = []

    def source():
        for i in range(5):
            read.append(i)
            if i == 3:
                raise ValueError("bad part 3")
            yield i

    items = Prefetcher(source, lambda i: i * 10, depth=2, thread=thread)
    assert [next(items), next(items), next(items)] == [0, 10, 20]
    if not thread:
        assert read == [0, 1, 2]  # nothing read ahead: the worker's own thread reads when asked
    with pytest.raises(ValueError, match="bad part 3"):
        next(items)
    items.close()


@pytest.mark.parametrize("thread", [True, False])
def test_an_exhausted_reader_stays_exhausted_and_close_stops_an_endless_one(thread):
    items = Prefetcher(lambda: iter(range(3)), lambda i: i, thread=thread)
    assert list(items) == [0, 1, 2]
    assert list(items) == []
    endless = Prefetcher(lambda: iter(range(10**9)), lambda i: i, thread=thread)
    assert next(endless) == 0
    endless.close()  # returns: the thread (if any) is stopped, even blocked on a full queue
    assert endless._thread.is_alive() is False


def test_a_spare_core_is_one_beyond_the_torch_threads():
    cores = len(os.sched_getaffinity(0))
    assert spare_core(cores - 1) and not spare_core(cores)
