"""A DataWorker's reader thread: reads and converts the next batches (Parquet decoding, key hashing)
and splits their keys by PS shard while the worker trains on the current one.

pyarrow and numpy release the GIL for their heavy work, so on a machine with a core to spare the
reading leaves the training loop's critical path; the bounded queue keeps at most `depth` batches
read ahead. An error in the thread is raised in the consumer, on the batch where it happened.

Without a core to spare (``thread=False``: the worker's torch threads take every core it has), the
items are read in the consumer's own thread when asked for, as the reference trainer reads: a
reader thread would then run on a core torch's threads are using, and each of their parallel
regions waits at its barrier for the thread the reader pre-empted (BENCHMARKS.md "The
Criteo-shaped epoch").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_END = object()


class Prefetcher:
    """Iterates `source()`'s items, each mapped through `prepare`, computed up to `depth` ahead."""

    def __init__(
        self,
        source: Callable[[], Iterator[Any]],
        prepare: Callable[[Any], Any],
        depth: int = 2,
        thread: bool = True,
    ):
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._inline: Iterator[Any] | None = None if thread else (prepare(item) for item in source())
        self._thread = threading.Thread(target=self._fill, args=(source, prepare), daemon=True)
        if thread:
            self._thread.start()

    def _fill(self, source: Callable[[], Iterator[Any]], prepare: Callable[[Any], Any]) -> None:
        try:
            for item in source():
                if not self._put(prepare(item)):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(exc)
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._inline is not None:
            return next(self._inline)
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (it may be blocked on a full queue) and drop what it read ahead."""
        if self._inline is not None:
            self._inline = iter(())
            return
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)
