"""The stage chain of a DataWorker as a Ray Compiled Graph: forward through stages 1..S-1, the loss
on the last, backward through S-2..1, with shared-memory channels between the actors instead of one
object-store call per stage and direction.

Measured on the 2-core development machine (``../shared/bench/ray_call_overhead.py``, quiet): a
0.5 MB activation A -> B and back costs 5.0–5.2 ms with plain actor calls and 0.7 ms through a
compiled graph. A graph is static, so it is used where every stage after the first has one replica
(the sync mode always): M:N routing over replicas keeps plain calls (``workers.DataWorker``).

One execution is one micro-batch; executions run in submission order on every actor, which is what
keeps the sync mode's accumulate-then-step exact. The graph is torn down and rebuilt when the
actors change (a fault's recovery re-creates them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from heterps_ray.runtime.pipeline import Wire

_GET_TIMEOUT_S = 120.0  # a micro-batch not back by then: an actor of the chain hangs
_MIN_BUFFER_BYTES = 1 << 20


def channel_bytes(boundary_bytes_per_sample: list[int], micro_batch: int) -> int:
    """Shared-memory channel size for the largest activation (or gradient) of the chain, with room
    for the serialisation header."""
    largest = max(boundary_bytes_per_sample, default=0) * micro_batch
    return max(_MIN_BUFFER_BYTES, int(largest * 1.25) + (64 << 10))


def copy_wire(arrays: Wire) -> Wire:
    """Arrays read from a channel may view its buffer, which the next execution overwrites: copy."""
    return [None if a is None else np.array(a) for a in arrays]


class CompiledChain:
    """The compiled graph over one replica of each of stages 1..S-1 (StageWorker handles)."""

    def __init__(self, stages: list[Any], buffer_bytes: int, max_in_flight: int):
        from ray.dag import InputNode

        *middle, last = stages
        with InputNode() as inp:
            mb_id, x, label, scale, step, gen = (inp[i] for i in range(6))
            for worker in middle:
                x = worker.chain_forward.bind(mb_id, x, gen)
            out = last.chain_forward_backward.bind(mb_id, x, label, scale, step, gen)
            for worker in reversed(middle):
                out = worker.chain_backward.bind(mb_id, out, step, gen)
        self._graph = out.experimental_compile(
            _buffer_size_bytes=buffer_bytes, _max_inflight_executions=max(2, max_in_flight)
        )

    def submit(self, mb_id: int, x: Wire, label: np.ndarray, scale: float, step: bool, gen: int) -> Any:
        """Start one micro-batch; returns the ref of (its input gradient, its loss)."""
        return self._graph.execute(mb_id, x, label, scale, step, gen)

    @staticmethod
    def result(ref: Any) -> tuple[Wire, float]:
        import ray

        grads, loss = ray.get(ref, timeout=_GET_TIMEOUT_S)
        return copy_wire(grads), float(loss)

    def close(self) -> None:
        try:
            self._graph.teardown()
        except Exception:  # an actor of the graph is dead: its side is gone already
            pass
