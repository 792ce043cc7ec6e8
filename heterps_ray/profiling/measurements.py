"""Each kind of measurement a profile takes (profiler.py's `measure` runs them in order): what the
type's actors run and the rows (rows.Row) it gives: layers at each batch size, 1 vs 2 replicas, messages
between types, an actor's own work per call, the PS shard, the input read rate, the PS type's disk
and each machine's background load."""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from heterps_ray.config import JobConfig, ResourceType
from heterps_ray.data.layout import is_dataset
from heterps_ray.models import ModelSpec
from heterps_ray.profiling.placement import Waiter
from heterps_ray.profiling.rows import Row

if TYPE_CHECKING:
    from heterps_ray.profiling.profiler import ProfileSettings

_BYTES_PER_MB = 1 << 20


def layer_rounds(
    group: list[Any],
    rtype: ResourceType,
    spec: ModelSpec,
    settings: ProfileSettings,
    bar: Any,
    wait: Waiter,
    notes: list[str],
) -> list[Row]:
    """`repeats` rounds, each timing every (layer, batch size) once on the type's first actor; an item
    that ran out of GPU memory is left out of later rounds, with an "oom" row and a note."""
    items = [(i, b) for i in range(spec.num_layers + 1) for b in settings.batch_sizes]  # + the whole model
    rows = []
    for rep in range(settings.repeats):
        bar.set_postfix_str(f"{rtype.name} layers, round {rep + 1}/{settings.repeats}")
        warmup = settings.warmup if rep == 0 else 0
        timed = wait(group[0].time_layers.remote(items, warmup, settings.seed + rep), f"{rtype.name} layers")
        kept = []
        for (index, batch_size), result in zip(items, timed, strict=True):
            whole = index == spec.num_layers
            layer = "" if whole else spec.layers[index].name
            if result is None:
                rows.append(Row("oom", rtype.name, layer=layer, batch_size=batch_size, repeat=rep))
                notes.append(
                    f"{rtype.name}: {layer or 'the whole model'} at batch size {batch_size} ran out of GPU "
                    "memory: not timed"
                )
                continue
            kept.append((index, batch_size))
            fwd, bwd, copies, peak = result
            rows.append(
                Row("stage" if whole else "layer", rtype.name, layer=layer, batch_size=batch_size, repeat=rep,
                     forward_ms=fwd, backward_ms=bwd, ms=fwd + bwd, copy_ms=copies,
                     peak_mb=math.nan if peak is None else peak)
            )  # fmt: skip
        items = kept
        bar.update()
    return rows


def host_runs(
    present: list[ResourceType],
    actors: dict[str, list[Any]],
    settings: ProfileSettings,
    wait: Waiter,
    calls: bool = True,
) -> list[Row]:
    """Per type: the machine its first actor runs on (Ray node id in `peer`, cores in `rows`) and
    the CPU the rest of that machine used while everything here was idle (`client_ms` in `ms`);
    with `calls`, Ray's CPU per call there too. The fit declares a shared host where types share a node."""
    out = []
    # every type's window at once (each actor sleeps through it: the others' CPU is the background)
    loads = wait(
        [actors[t.name][0].host_load.remote(settings.host_window_s) for t in present], "host load"
    )
    for rtype, (node, cores, ms, others) in zip(present, loads, strict=True):
        group = actors[rtype.name]
        out.append(Row("host", rtype.name, peer=node, rows=cores, ms=ms, client_ms=others))
        if calls and len(group) > 1:
            ms, others = wait(group[0].call_cpu.remote(group[-1], settings.host_calls), f"{rtype.name} calls")
            out.append(
                Row("call_cpu", rtype.name, peer=node, calls=settings.host_calls, ms=ms, client_ms=others)
            )
    return out


def transfer_runs(
    present: list[ResourceType],
    actors: dict[str, list[Any]],
    settings: ProfileSettings,
    bar: Any,
    notes: list[str],
    wait: Waiter,
) -> list[Row]:
    """Messages of each size from the first actor of every type to an actor of every type (its
    second actor for the same type); a message is timed by its sender until the receiver has it."""
    rows = []
    for sender in present:
        for receiver in present:
            src = actors[sender.name][0]
            peers = actors[receiver.name]
            dst = peers[-1] if receiver.name == sender.name else peers[0]
            if dst is src:
                notes.append(
                    f"no second {sender.name} actor: {sender.name}->{sender.name} transfers not measured"
                )
                bar.update(len(settings.transfer_bytes))
                continue
            for nbytes in settings.transfer_bytes:
                bar.set_postfix_str(f"{sender.name}->{receiver.name} {nbytes / _BYTES_PER_MB:.2f} MB")
                for rep, ms in enumerate(
                    wait(
                        src.send.remote(dst, nbytes, settings.repeats),
                        f"{sender.name}->{receiver.name} messages",
                    )
                ):
                    rows.append(
                        Row("transfer", sender.name, peer=receiver.name, nbytes=nbytes, repeat=rep, ms=ms)
                    )
                bar.update()
    return rows


def call_runs(
    present: list[ResourceType],
    actors: dict[str, list[Any]],
    settings: ProfileSettings,
    notes: list[str],
    wait: Waiter,
) -> list[Row]:
    """Per type: its first actor kept busy with calls from another actor (its second, else one of
    another type), at ``settings.call_sizes`` message sizes; a row per size with `calls` in `ms`."""
    rows = []
    sizes = sorted(settings.transfer_bytes)
    picks = np.linspace(0, len(sizes) - 1, min(max(settings.call_sizes, 2), len(sizes)))
    sizes = sorted({sizes[round(i)] for i in picks})
    everyone = [a for group in actors.values() for a in group]
    for rtype in present:
        callee = actors[rtype.name][0]
        caller = next((a for a in actors[rtype.name][1:] + everyone if a is not callee), None)
        if caller is None:
            notes.append(f"a single actor: {rtype.name}'s own work per call not measured")
            continue
        for nbytes in sizes:
            ms = wait(caller.call_rate.remote(callee, nbytes, settings.call_count), f"{rtype.name} call rate")
            rows.append(Row("call", rtype.name, nbytes=nbytes, calls=settings.call_count, ms=ms))
    return rows


def pair_runs(
    group: list[Any],
    rtype: ResourceType,
    spec: ModelSpec,
    batch_size: int,
    settings: ProfileSettings,
    wait: Waiter,
) -> list[Row]:
    """Each layer for a fixed time on one actor, then on two actors at once (every layer in one call
    per actor, the two actors in step): one row per (layer, actor) with its calls and ms (the fit
    compares the summed call rates)."""
    if len(group) < 2:
        return []
    what = f"{rtype.name} layers' replicas"
    indices = list(range(spec.num_layers))
    wait([a.run_layers.remote(indices, batch_size, 0.0) for a in group], what)  # warm both
    out = []
    for rep in range(settings.pair_repeats):
        for replicas in (1, 2):
            results = wait(
                [a.run_layers.remote(indices, batch_size, settings.pair_ms) for a in group[:replicas]], what
            )
            for per_layer in results:
                for layer, (calls, ms) in zip(spec.layers, per_layer, strict=True):
                    out.append(
                        Row("layer_pair", rtype.name, layer=layer.name, batch_size=batch_size,
                             replicas=replicas, calls=calls, repeat=rep, ms=ms)
                    )  # fmt: skip
    return out


@dataclass
class PSProbe:
    """The PS measurements: one real PS shard on the PS type, and the key batches a first-stage actor
    pulls and pushes through it (both made while the profiling actors start)."""

    ps_name: str
    micro_batch: int
    shards: list[Any]
    batches: list[np.ndarray]
    started: float  # time.monotonic() when its shard was started

    @classmethod
    def start(
        cls, job: JobConfig, spec: ModelSpec, present: list[ResourceType], settings: ProfileSettings
    ) -> PSProbe:
        from heterps_ray.ps.shard import start_shards
        from heterps_ray.ps.spec import TableSpec

        names = [t.name for t in present]
        ps_name = job.cluster.ps_resource if job.cluster.ps_resource in names else names[0]
        # a shard computes nothing on a GPU: asking for none, it cannot wait for the profiling actors' GPUs
        options = {**job.cluster.type(ps_name).actor_options(), "num_gpus": 0}
        started = time.monotonic()
        shards = start_shards(1, {"embedding": TableSpec(dim=spec.embedding_dim)}, options)
        try:
            micro_batch = job.batch_size // job.runtime.micro_batches
            batches = _key_batches(
                job, micro_batch, spec.num_slots, (settings.ps_repeats + 1) * settings.ps_calls, settings.seed
            )
        except BaseException:
            for shard in shards:
                ray.kill(shard)
            raise
        return cls(ps_name, micro_batch, shards, batches, started)

    def runs(
        self,
        spec: ModelSpec,
        actors: dict[str, list[Any]],
        settings: ProfileSettings,
        wait: Waiter,
        unmeasured: list[str],
    ) -> list[Row]:
        """Rows/s of pull+push through the shard, from the PS type's first actor; dense pushes to it.
        No rows (a line in `unmeasured`) when the shard was not placed within ``settings.start_timeout_s``
        of its start (the PS type's units taken by other work): a call to it would wait forever."""
        shards, batches, ps_name, micro_batch = self.shards, self.batches, self.ps_name, self.micro_batch
        left = max(self.started + settings.start_timeout_s - time.monotonic(), 1.0)
        placed, _ = ray.wait([s.describe.remote() for s in shards], num_returns=len(shards), timeout=left)
        if len(placed) < len(shards):
            unmeasured.append(
                f"the PS shard's rates: its actor on {ps_name!r} was not placed within "
                f"{settings.start_timeout_s:.0f} s (free now: {ray.available_resources()})"
            )
            return []
        client = actors[ps_name][0]
        out = []
        dense_params = max(spec.dense_params, 1)
        warm = client.ps_round_trips.remote(shards, batches[: settings.ps_calls], spec.embedding_dim)
        wait(warm, "PS round trips (warm-up)")
        for rep in range(settings.ps_repeats):
            calls = batches[(rep + 1) * settings.ps_calls : (rep + 2) * settings.ps_calls]
            pull, push, own = wait(
                client.ps_round_trips.remote(shards, calls, spec.embedding_dim), "PS round trips"
            )
            out.append(Row("ps", ps_name, rows=micro_batch * spec.num_slots, calls=len(calls), repeat=rep,
                            forward_ms=pull, backward_ms=push, ms=pull + push, client_ms=own,
                            batch_size=micro_batch))  # fmt: skip
            ms = wait(
                client.dense_pushes.remote(shards[0], dense_params, settings.ps_calls), "PS dense pushes"
            )
            out.append(
                Row("ps_dense", ps_name, rows=dense_params, calls=settings.ps_calls, repeat=rep, ms=ms)
            )
        return out

    def stop(self) -> None:
        for shard in self.shards:
            ray.kill(shard)


def input_runs(
    job: JobConfig,
    present: list[ResourceType],
    actors: dict[str, list[Any]],
    settings: ProfileSettings,
    wait: Waiter,
) -> list[Row]:
    """Read rate of the job's dataset on each type (a small synthetic one when it has none yet)."""

    from heterps_ray.data.dataset import Dataset

    path = Path(job.data.path)
    scratch = None
    if not is_dataset(path):
        from heterps_ray.data.synth import synthesize

        scratch = tempfile.TemporaryDirectory(prefix="heterps-profile-")
        path = Path(scratch.name) / "data"
        synthesize(path, settings.input_rows, seed=settings.seed)
    try:
        rows = min(Dataset(path).num_rows("train"), settings.input_rows)
        out = []
        for rtype in present:
            for rep in range(settings.input_repeats):
                done, ms, setup = wait(
                    actors[rtype.name][0].read_input.remote(str(path), job.batch_size, rows),
                    f"{rtype.name} input read",
                )
                out.append(Row("input", rtype.name, rows=done, batch_size=job.batch_size, repeat=rep, ms=ms,
                                client_ms=setup))  # fmt: skip
        return out
    finally:
        if scratch is not None:
            scratch.cleanup()


GPU_TABLE_BATCHES = 6  # key batches of the job's data the GPU tier's timing cycles through


def device_table_runs(
    job: JobConfig,
    spec: ModelSpec,
    present: list[ResourceType],
    actors: dict[str, list[Any]],
    settings: ProfileSettings,
    wait: Waiter,
) -> list[Row]:
    """The GPU tier on each cuda type (rows in its GPU's memory): a row of kind ``gpu_table`` (ms over
    the key rows of batches whose rows it holds), one of kind ``gpu_miss`` (ms over the rows it took
    from the shards and gave back) and one of kind ``gpu_rows`` (the rows its free memory holds)."""
    cuda = [t for t in present if t.device == "cuda"]
    if not cuda:
        return []
    batches = _key_batches(job, job.batch_size, spec.num_slots, GPU_TABLE_BATCHES, settings.seed)
    out = []
    for rtype in cuda:
        hit_ms, rows, miss_ms, moved, capacity = wait(
            actors[rtype.name][0].time_device_table.remote(batches, spec.embedding_dim), f"{rtype.name} GPU table"
        )
        out.append(Row("gpu_table", rtype.name, batch_size=job.batch_size, rows=rows, ms=hit_ms))
        out.append(Row("gpu_miss", rtype.name, batch_size=job.batch_size, rows=moved, ms=miss_ms))
        out.append(Row("gpu_rows", rtype.name, rows=capacity))
    return out


def _key_batches(job: JobConfig, batch_size: int, num_slots: int, count: int, seed: int) -> list[np.ndarray]:
    """`count` consecutive key batches of the job's training data (its real key reuse and row
    creation), or Criteo-like synthetic keys when the job has no dataset yet."""
    path = Path(job.data.path)
    out: list[np.ndarray] = []
    if is_dataset(path):
        from heterps_ray.data.dataset import Dataset

        for batch in Dataset(path).iter_batches("train", batch_size):
            out.append(np.ascontiguousarray(batch["keys"]))
            if len(out) == count:
                return out
    rng = np.random.default_rng(seed)
    while len(out) < count:
        out.append(_synthetic_keys(batch_size, num_slots, rng))
    return out


def _synthetic_keys(batch_size: int, num_slots: int, rng: np.random.Generator) -> np.ndarray:
    """Criteo-like keys: per slot a Zipf-distributed id (a few hot values, a long tail), slot mixed in."""
    ids = rng.zipf(1.2, size=(batch_size, num_slots)) % 1_000_003
    slots = np.arange(num_slots, dtype=np.int64)[None, :]
    return (ids.astype(np.int64) * 1_000_003 + slots * 7_919) ^ np.int64(0x2545F4914F6CDD1D)


def disk_runs(
    job: JobConfig, spec: ModelSpec, ps_name: str, actors: dict[str, list[Any]], wait: Waiter
) -> list[Row]:
    """The local disk of the PS type `ps_name` where it declares one (``disk_dir``), timed on its first
    actor as a PS shard's disk tier uses it (ps/disk_timing.py): a row of kind ``disk`` per setting,
    `peer` what was timed ("cold", "warm", "append", "miss"), `calls` the reads in flight, `ms` over
    `rows` records."""
    from heterps_ray.ps.spec import sparse_spec

    ps = job.cluster.type(ps_name)
    if ps.disk_dir is None:
        return []
    table = sparse_spec(job, spec.embedding_dim, spec.embedding_init_scale)
    timings = wait(
        actors[ps_name][0].time_disk.remote(
            ps.disk_dir, table.dim, table.optimizer, table.disk_reads_in_flight, ps.disk_gb
        ),
        f"{ps_name} disk",
    )
    return [Row("disk", ps_name, peer=what, calls=depth, rows=rows, ms=ms) for what, depth, rows, ms in timings]
