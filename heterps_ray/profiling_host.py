"""The profiling actor: :class:`LayerProfiler`, one process pinned to one resource type that times
what the profiler (profiling/profiler.py) asks of it there and returns plain numbers. Ray is imported by the calls that use it only: the timing runs in a process without
Ray too (scripts/gpu_check.py --no-ray).

It builds the model (and, at index ``num_layers``, the whole model as one stage) on the device its
type claims (heterps_ray.devices: a ``cuda`` type without a GPU is a DeviceError, never the CPU), with
the type's torch threads, and measures: every layer forward and backward (plus its Adam step) at a
batch size, as a stage call pays them (the copies to and from the device and the syncs included, the
copies also apart, and the peak GPU memory; a batch size that runs out of GPU memory is reported,
not fatal); one layer repeated for a fixed
time (the 1- vs 2-replica runs); messages of a size sent to a peer actor; a peer kept busy with
calls; pull+push through a :class:`~heterps_ray.ps.client.PSClient` and dense pushes to a real
PS shard; a dataset's read rate; its machine's cores and background load, and the raylet's CPU per
call. Which measurements to take, on which actors, and the rows they become are profiler.py's.

It sits below both the profiler and the runtime: the runtime's actors are each a ProfilingHost
(the layer timings run in the processes the run then reuses), and the profiler drives them, so neither
imports the other.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from typing import Any

import numpy as np

from heterps_ray.host_cpu import busy_cpu_s
from heterps_ray.models import build_model

_CALL_PAYLOAD_BYTES = 256 << 10  # above Ray's inline limit (100 KiB): goes through the object store
PEER_TIMEOUT_S = 300.0  # a call to a peer actor not answered by then fails the measurement (never hangs)
_MB = float(1 << 20)


class LayerProfiler:
    """Runs single layers of a model forward + backward; one per actor (the narrow actor API)."""

    def __init__(self, model: dict[str, Any], seed: int, torch_threads: int, device: str, type_name: str):
        import torch

        from heterps_ray.config import ModelConfig
        from heterps_ray.devices import claim_device, set_precision

        torch.set_num_threads(torch_threads)
        self._torch = torch
        self.device = claim_device(type_name, device)
        set_precision(self.device, "fp32")
        self.spec = build_model(ModelConfig(**model))
        self.layers = [self.spec.build(i, i + 1, seed).to(self.device) for i in range(self.spec.num_layers)]
        # index len(layers): the whole model as one stage (one autograd pass, one optimizer step), as a
        # StageWorker runs its layers; against the layers alone it shows the fixed time a stage shares
        self.layers.append(self.spec.build(0, self.spec.num_layers, seed).to(self.device))
        self.optimizers = [
            torch.optim.Adam(layer.parameters(), lr=1e-3) if any(True for _ in layer.parameters()) else None
            for layer in self.layers
        ]
        self._inputs: dict[int, list[tuple[Any, ...]]] = {}
        self._grads: dict[tuple[int, int], tuple[Any, ...]] = {}

    def describe(self) -> dict[str, Any]:
        import ray

        return {
            "pid": os.getpid(),
            "device": str(self.device),
            "torch_threads": self._torch.get_num_threads(),
            "resources": ray.get_runtime_context().get_assigned_resources(),
        }

    def time_layers(
        self, items: list[tuple[int, int]], warmup: int, seed: int
    ) -> list[tuple[float, float, float, float | None] | None]:
        """One timed (forward ms, backward + optimizer step ms, of which copies ms, peak GPU MB or None
        on the CPU) per (layer index, batch size) item (index num_layers: the whole model as one
        stage), in a shuffled order (so a burst of noise from elsewhere does not hit one item's
        repeats); None for an item that ran out of GPU memory."""
        out: list[tuple[float, float, float, float | None] | None] = [None] * len(items)
        failed = set()
        for i, (index, batch_size) in enumerate(items):
            for _ in range(warmup):
                if self._fits(index, batch_size) is None:
                    failed.add(i)
                    break
        for i in np.random.default_rng(seed).permutation(len(items)):
            if i not in failed:
                out[i] = self._fits(*items[i])
        return out

    def run_layers(self, indices: list[int], batch_size: int, budget_ms: float) -> list[tuple[int, float]]:
        """Run each layer of `indices` in turn forward + backward for about `budget_ms`; returns
        (calls, ms) per layer, for the 1- vs 2-replica comparison (two actors given the same list at
        once run the same layer at the same time: one call for every layer, not one per layer)."""
        out = []
        for index in indices:
            start = time.perf_counter()
            calls, elapsed = 0, 0.0
            while calls < 2 or elapsed < budget_ms:
                self._step(index, batch_size)
                calls += 1
                elapsed = (time.perf_counter() - start) * 1000.0
            out.append((calls, elapsed))
        return out

    def host_load(self, window_s: float) -> tuple[str, int, float, float]:
        """(node id, cores this process may use, window ms, CPU ms the rest of the machine used in
        the window) while this actor sleeps: the machine's cores and their background load."""
        import psutil
        import ray

        me = psutil.Process()
        own0, all0, t0 = sum(me.cpu_times()[:2]), busy_cpu_s(), time.perf_counter()
        time.sleep(window_s)
        own1, all1, t1 = sum(me.cpu_times()[:2]), busy_cpu_s(), time.perf_counter()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        node = ray.get_runtime_context().get_node_id()
        return node, cores, (t1 - t0) * 1000.0, max((all1 - all0) - (own1 - own0), 0.0) * 1000.0

    def call_cpu(self, peer: Any, calls: int) -> tuple[float, float]:
        """(window ms, CPU ms of this node's raylet) while making `calls` calls to `peer` one after the
        other, each with an activation-sized argument (256 KiB: through the object store, as the
        pipeline's are): Ray's own work per call, which on a shared host takes a core beside the
        actors. NaN when the raylet cannot be found (not this actor's parent)."""
        import psutil
        import ray

        raylet = psutil.Process().parent()
        if raylet is None or "raylet" not in raylet.name():
            return 0.0, math.nan
        payload = np.ones(_CALL_PAYLOAD_BYTES // 4, dtype=np.float32)
        ray.get(peer.receive.remote(payload), timeout=PEER_TIMEOUT_S)
        before, t0 = sum(raylet.cpu_times()[:2]), time.perf_counter()
        for _ in range(calls):
            ray.get(peer.receive.remote(payload), timeout=PEER_TIMEOUT_S)
        window = (time.perf_counter() - t0) * 1000.0
        return window, (sum(raylet.cpu_times()[:2]) - before) * 1000.0

    def send(self, peer: Any, nbytes: int, repeats: int) -> list[float]:
        """Send `nbytes` to actor `peer` `repeats` times (after one warm-up); ms per message,
        measured here from the call until the peer has received it."""
        import ray

        payload = np.ones(max(nbytes // 4, 1), dtype=np.float32)
        ray.get(peer.receive.remote(payload), timeout=PEER_TIMEOUT_S)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            ray.get(peer.receive.remote(payload), timeout=PEER_TIMEOUT_S)
            times.append((time.perf_counter() - start) * 1000.0)
        return times

    def receive(self, payload: np.ndarray) -> int:
        return int(payload[-1] > 0) + int(payload.nbytes)

    def call_rate(self, peer: Any, nbytes: int, calls: int, window: int = 4) -> float:
        """ms for `calls` calls of `peer.echo` carrying `nbytes` each, `window` in flight, so the peer
        is never idle: its own work per call received (Ray deserialising the argument, running the
        task, storing an as large result), as a StageWorker's calls cost it besides its layers."""
        import ray

        payload = np.ones(max(nbytes // 4, 1), dtype=np.float32)
        ray.get(peer.echo.remote(payload), timeout=PEER_TIMEOUT_S)
        pending: deque[Any] = deque()
        start = time.perf_counter()
        for _ in range(calls):
            if len(pending) >= window:
                ray.get(pending.popleft(), timeout=PEER_TIMEOUT_S)
            pending.append(peer.echo.remote(payload))
        ray.get(list(pending), timeout=PEER_TIMEOUT_S)
        return (time.perf_counter() - start) * 1000.0

    def echo(self, payload: np.ndarray) -> np.ndarray:
        return np.empty_like(payload)  # a result as large as the argument, like a stage's activations

    def ps_round_trips(
        self, shards: list[Any], batches: list[np.ndarray], dim: int
    ) -> tuple[float, float, float]:
        """(pull ms, push ms, push ms spent here) summed over one pull+push of each key batch through
        a PSClient, as a DataWorker makes them (each waited for; unseen keys create rows, as in
        training). The third part is the client's own work (de-duplicating and summing gradients)."""
        import ray

        from heterps_ray.ps.client import PSClient

        client = PSClient(shards)
        pull_ms = push_ms = client_ms = 0.0
        for keys in batches:
            grads = np.full((*keys.shape, dim), 1e-3, dtype=np.float32)
            t0 = time.perf_counter()
            client.pull("embedding", keys)
            t1 = time.perf_counter()
            refs = client.push("embedding", keys, grads)
            t2 = time.perf_counter()
            ray.get(refs, timeout=PEER_TIMEOUT_S)
            t3 = time.perf_counter()
            pull_ms += (t1 - t0) * 1000.0
            push_ms += (t3 - t1) * 1000.0
            client_ms += (t2 - t1) * 1000.0
        return pull_ms, push_ms, client_ms

    def dense_pushes(self, shard: Any, params: int, calls: int) -> float:
        """ms for `calls` async-mode dense pushes (Adam on the PS) of a table of `params` floats."""
        import ray

        grads = {"w": np.full(params, 1e-3, dtype=np.float32)}
        ray.get(
            shard.register_dense.remote("profile", {"w": np.zeros(params, dtype=np.float32)}, "adam", 1e-3),
            timeout=PEER_TIMEOUT_S,
        )
        ray.get(shard.push_dense.remote("profile", grads), timeout=PEER_TIMEOUT_S)
        start = time.perf_counter()
        for _ in range(calls):
            ray.get(shard.push_dense.remote("profile", grads), timeout=PEER_TIMEOUT_S)
        return (time.perf_counter() - start) * 1000.0

    def time_device_table(
        self, batches: list[np.ndarray], dim: int, rounds: int = 3
    ) -> tuple[float, int, float, int, int]:
        """The GPU tier of a table on this actor's device (ps/device_table.py) in front of a hosted shard,
        as a DataWorker pays it: (ms, key rows) of batches whose rows it holds (the keys made distinct on
        the device, mapped to rows, the gather and the Adagrad update, waited for), over `rounds` passes
        after a warm one; and (ms, rows) of the rows it took and gave back (fetched from the shard the
        first time each key is seen, written back by a flush); and the rows the device's free memory
        holds for such a table (ps/device_table.device_table_rows)."""
        torch = self._torch
        from heterps_ray.ps.client import PSClient
        from heterps_ray.ps.device_table import DeviceTable, device_table_rows
        from heterps_ray.ps.shard import PSShard
        from heterps_ray.ps.spec import TableSpec

        spec = TableSpec(dim=dim)
        client = PSClient([PSShard(0, 1, {"t": spec})], hosted=True)
        table = DeviceTable(spec, self.device, sum(int(k.size) for k in batches) + 1)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        deduped = [table.dedupe(keys) for keys in batches]
        sync()
        start = time.perf_counter()
        for step, batch in enumerate(deduped):  # every key new once: fetched from the shard
            table.release(table.resolve(batch, client, "t", step))
        sync()
        taken_ms = (time.perf_counter() - start) * 1000.0
        grads = [torch.full((keys.size, dim), 1e-3, device=self.device) for keys in batches]
        hit_ms, rows = 0.0, 0
        for rnd in range(rounds + 1):
            sync()
            start = time.perf_counter()
            for step, (keys, grad) in enumerate(zip(batches, grads, strict=True)):
                resolved = table.resolve(table.dedupe(keys), client, "t", step)
                table.gather(resolved)
                table.apply(resolved, grad)
            sync()
            if rnd:  # the first pass warms the kernels up
                hit_ms += (time.perf_counter() - start) * 1000.0
                rows += sum(int(k.size) for k in batches)
        start = time.perf_counter()
        table.flush(client, "t")
        moved_ms = taken_ms + (time.perf_counter() - start) * 1000.0
        moved = table.stats.fetched + table.stats.written_back
        del table
        return hit_ms, rows, moved_ms, moved, device_table_rows(self.device, spec)

    def time_disk(
        self, directory: str, dim: int, optimizer: str, reads_in_flight: int, disk_gb: float | None
    ) -> list[tuple[str, int, int, float]]:
        """This machine's disk under `directory` as a PS shard's disk tier uses it, records of a table of
        `dim` and sparse `optimizer` (ps/disk_timing.py): (what, reads in flight, rows, ms) per setting."""
        from heterps_ray.ps.disk_tier import table_record_dtype
        from heterps_ray.ps.disk_timing import time_disk

        timings = time_disk(directory, table_record_dtype(dim, optimizer), reads_in_flight, disk_gb)
        return [(t.what, t.depth, t.rows, t.ms) for t in timings]

    def read_input(self, path: str, batch_size: int, rows: int) -> tuple[int, float, float]:
        """(rows, ms, setup ms) to read and convert `rows` rows of a dataset into batches, as a
        DataWorker does (the dataset converts whole chunks, so `rows` should be a chunk or the whole
        split). Setup is opening the dataset: imports on a worker's first call, a one-time cost."""
        start = time.perf_counter()
        from heterps_ray.data.dataset import Dataset

        dataset = Dataset(path)
        dataset.num_rows("train")
        setup_ms = (time.perf_counter() - start) * 1000.0
        done = 0
        start = time.perf_counter()
        for batch in dataset.iter_batches("train", batch_size, drop_last=False):
            done += len(batch["label"])
            if done >= rows:
                break
        return done, (time.perf_counter() - start) * 1000.0, setup_ms

    # -- internals ------------------------------------------------------------------------------

    def _fits(self, index: int, batch_size: int) -> tuple[float, float, float, float | None] | None:
        """:meth:`_step`, or None when it runs out of GPU memory (the memory it took is given back)."""
        torch = self._torch
        try:
            return self._step(index, batch_size)
        except torch.cuda.OutOfMemoryError:
            self._grads.pop((index, batch_size), None)
            torch.cuda.empty_cache()
            return None

    def _step(self, index: int, batch_size: int) -> tuple[float, float, float, float | None]:
        """(forward ms, backward ms, copies ms, peak GPU MB) of one stage call of layer `index`, as a
        StageWorker pays it: forward = the inputs copied to the device, the layer, its outputs copied
        back (the wire is host memory); backward = the gradients copied in, backward and optimizer
        step, the input gradients copied back; each part ends in a device sync. On the CPU the copies
        are no-ops and the peak is None."""
        torch = self._torch
        cuda = self.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        host = self._layer_inputs(batch_size)[0 if index == self.spec.num_layers else index]
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        sync()
        t0 = time.perf_counter()
        inputs = tuple(_leaf(x.to(self.device)) for x in host)
        sync()
        t1 = time.perf_counter()
        out = self.layers[index](inputs)
        sync()
        t2 = time.perf_counter()
        for o in out:
            o.detach().to("cpu")
        t3 = time.perf_counter()
        key = (index, batch_size)
        if key not in self._grads:
            self._grads[key] = tuple(torch.randn(o.shape, dtype=o.dtype) for o in out)
        grads = tuple(g.to(self.device) for g in self._grads[key])
        sync()
        t4 = time.perf_counter()
        torch.autograd.backward(out, grads)
        optimizer = self.optimizers[index]
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync()
        t5 = time.perf_counter()
        for x in inputs:
            if x.grad is not None:
                x.grad.to("cpu")
        t6 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated(self.device) / _MB if cuda else None
        copies = (t1 - t0) + (t3 - t2) + (t4 - t3) + (t6 - t5)
        return (t3 - t0) * 1000.0, (t6 - t3) * 1000.0, copies * 1000.0, peak

    def _layer_inputs(self, batch_size: int) -> list[tuple[Any, ...]]:
        """The input of every layer at `batch_size`, in host memory (as they arrive on the wire):
        random model inputs run through the chain once."""
        if batch_size not in self._inputs:
            torch = self._torch
            gen = torch.Generator().manual_seed(batch_size)
            spec = self.spec
            x: tuple[Any, ...] = (
                torch.randn(batch_size, spec.num_dense, generator=gen),
                torch.randn(batch_size, spec.num_slots, spec.embedding_dim, generator=gen) * 0.01,
            )
            inputs = []
            with torch.no_grad():
                for layer in self.layers[: spec.num_layers]:
                    inputs.append(tuple(t.detach().to("cpu") for t in x))
                    x = layer(tuple(t.to(self.device) for t in x))
            self._inputs[batch_size] = inputs
        return self._inputs[batch_size]


def _leaf(t: Any) -> Any:
    """`t` detached (sharing its memory), collecting a gradient of its own (float tensors only)."""
    leaf = t.detach()
    if leaf.is_floating_point():
        leaf.requires_grad_(True)
    return leaf


class ProfilingHost:
    """A process the profiler measures in: the :class:`LayerProfiler` calls, answered by the one that
    :meth:`start_profiling` built. The runtime's actors (DataWorker, StageWorker) are hosts too, so
    that the layer timings run in the processes the runtime probes and the run then reuse
    (runtime/warm.py) and a torch-importing process starts once per role and type; a standalone one is
    ``ray.remote(ProfilingHost)``. The names are LayerProfiler's, so a peer's ``receive`` and ``echo``
    reach its host."""

    profiler: LayerProfiler

    def start_profiling(
        self, model: dict[str, Any], seed: int, torch_threads: int, device: str, type_name: str
    ) -> dict[str, Any]:
        """Build the layers on the type's device (a DeviceError where it has none); describe the actor."""
        self.profiler = LayerProfiler(model, seed, torch_threads, device, type_name)
        return self.profiler.describe()

    def time_layers(
        self, items: list[tuple[int, int]], warmup: int, seed: int
    ) -> list[tuple[float, float, float, float | None] | None]:
        return self.profiler.time_layers(items, warmup, seed)

    def run_layers(self, indices: list[int], batch_size: int, budget_ms: float) -> list[tuple[int, float]]:
        return self.profiler.run_layers(indices, batch_size, budget_ms)

    def host_load(self, window_s: float) -> tuple[str, int, float, float]:
        return self.profiler.host_load(window_s)

    def call_cpu(self, peer: Any, calls: int) -> tuple[float, float]:
        return self.profiler.call_cpu(peer, calls)

    def send(self, peer: Any, nbytes: int, repeats: int) -> list[float]:
        return self.profiler.send(peer, nbytes, repeats)

    def receive(self, payload: np.ndarray) -> int:
        return self.profiler.receive(payload)

    def call_rate(self, peer: Any, nbytes: int, calls: int, window: int = 4) -> float:
        return self.profiler.call_rate(peer, nbytes, calls, window)

    def echo(self, payload: np.ndarray) -> np.ndarray:
        return self.profiler.echo(payload)

    def ps_round_trips(
        self, shards: list[Any], batches: list[np.ndarray], dim: int
    ) -> tuple[float, float, float]:
        return self.profiler.ps_round_trips(shards, batches, dim)

    def dense_pushes(self, shard: Any, params: int, calls: int) -> float:
        return self.profiler.dense_pushes(shard, params, calls)

    def read_input(self, path: str, batch_size: int, rows: int) -> tuple[int, float, float]:
        return self.profiler.read_input(path, batch_size, rows)

    def time_device_table(self, batches: list[np.ndarray], dim: int) -> tuple[float, int, float, int, int]:
        return self.profiler.time_device_table(batches, dim)

    def time_disk(
        self, directory: str, dim: int, optimizer: str, reads_in_flight: int, disk_gb: float | None
    ) -> list[tuple[str, int, int, float]]:
        return self.profiler.time_disk(directory, dim, optimizer, reads_in_flight, disk_gb)
