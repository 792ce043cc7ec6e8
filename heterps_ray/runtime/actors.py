"""The actor set of one run: starts a plan's PS shards, StageWorkers and DataWorkers pinned to their
resource types, waits until they are placed, replaces dead ones with the same options, rewires the
survivors to the replacements, and shuts everything down.

The set holds no training logic: the chunk loop (loop.py), recovery (recovery.py) and checkpoints
(snapshots.py) act through it. Example::

    actors = ActorSet(job, model, stages, num_shards, train_files, estimate_table(job))
    placement = actors.start()
    ...
    actors.shutdown()

Actors join the set one by one as they are started, so a start that fails part way (Ray refuses a
type's options, a warm actor's reconfiguration raises, the placement times out) leaves a set whose
every walk (:meth:`ActorSet.all_actors`, :meth:`ActorSet.shutdown`) covers the actors started so far.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from heterps_ray.config import ClusterConfig, JobConfig, ResourceType
from heterps_ray.costmodel.table_memory import TableEstimate, TablePlace, hosted_fits, table_place
from heterps_ray.errors import ConfigError, DataError
from heterps_ray.models import ModelSpec
from heterps_ray.ps.shard import PSShard
from heterps_ray.ps.spec import sparse_spec
from heterps_ray.runtime import warm
from heterps_ray.runtime.modes import mode_of
from heterps_ray.runtime.pipeline import StageSpec
from heterps_ray.runtime.shards import HostedShard, RemoteShard, ShardHandle
from heterps_ray.runtime.sparse import SPARSE_TABLE
from heterps_ray.runtime.stage import canonical_names, dense_table_name
from heterps_ray.runtime.stage_worker import StageWorker
from heterps_ray.runtime.worker_base import WorkerSettings
from heterps_ray.runtime.workers import DataSettings, DataWorker, HostedPS

READY_TIMEOUT_S = 120.0  # actors not placed by then: the cluster cannot hold the plan

log = logging.getLogger(__name__)


def actor_bundle(cluster: ClusterConfig, type_name: str) -> dict[str, float]:
    """The resources one actor of `type_name` asks Ray for (its ``actor_options()``), as a bundle."""
    opts = cluster.type(type_name).actor_options()
    bundle = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **opts["resources"]}
    return {k: float(v) for k, v in bundle.items() if v}


def readers_of(rtype: ResourceType) -> int:
    """Threads that convert a DataWorker's data on `rtype` by default: the CPUs its actors ask Ray for
    beyond their torch threads, at least 1."""
    return max(1, int(rtype.ray_resources.get("CPU", 1.0)) - rtype.torch_threads)


def hosts_shards(
    job: JobConfig, stages: Sequence[Any], num_shards: int, estimate: TableEstimate | None
) -> bool:
    """Whether a plan with these stages (each with a ``type`` and ``replicas``) hosts its PS shards in
    DataWorker 0's process: one DataWorker and no replicated stage, with ``runtime.ps_hosting: auto`` (no
    PS call crosses a process, and the shards need no actors, nor nodes, of their own), and one actor
    of stage 0's type holds the whole table of `estimate` (the run's, costmodel/table_memory.py; else
    the shards are actors)."""
    if job.runtime.ps_hosting != "auto" or any(s.replicas != 1 for s in stages):
        return False
    return hosted_fits(job, stages[0].type, num_shards, estimate)


class ActorSet:
    """The live actors of a plan: ``shard_actors`` (PS shard actors; none when the shards are hosted in
    DataWorker 0), ``stage_workers`` (stages 1..S-1, replicas each) and ``data_workers`` (stage 0);
    ``shards`` reaches every PS shard, wherever it lives (shards.py); ``place``, where the rows live
    (the shards, or stage 0's GPU memory in front of them)."""

    def __init__(
        self,
        job: JobConfig,
        model: ModelSpec,
        stages: list[StageSpec],
        num_shards: int,
        files: list[Path],
        estimate: TableEstimate | None,
        table: str | None = None,
    ):
        self.job, self.model, self.stages, self.num_shards = job, model, stages, num_shards
        self.num_workers = stages[0].replicas
        if len(files) < self.num_workers:
            raise DataError(
                f"{job.data.path}: {len(files)} train partition(s) for {self.num_workers} DataWorkers "
                "(stage 0 replicas); write more Parquet parts or use fewer replicas"
            )
        self.files = files
        self.hosted = hosts_shards(job, stages, num_shards, estimate)
        # shard actors on a PS type whose memory cannot hold the table keep the rest on its disk, as
        # planned (hosted shards hold it all in stage 0's memory: that is what hosting them needs)
        disk = estimate.disk if estimate is not None and not self.hosted else None
        self.table = sparse_spec(job, model.embedding_dim, model.embedding_init_scale, disk)
        # where the rows live: stage 0's GPU memory (in front of the shards) or the shards alone, as the
        # plan's price has them (`table`; None: the runtime's rule, which is the price's)
        placed = table_place(job, stages[0].type, self.hosted, estimate, model.embedding_dim)
        self.place: TablePlace = (
            TablePlace("ps", job.cluster.ps_resource, why="the plan keeps them there")
            if table == "ps" and placed.place != "ps"
            else placed
        )
        self.mode = mode_of(job.mode)  # the one place the run's mode is chosen (modes.py)
        self.shards: list[ShardHandle] = []
        self.shard_actors: list[Any] = []
        # what a DataWorker is given to reach the shards: their actors, or what to host itself
        self.worker_shards: list[Any] | HostedPS = self.shard_actors
        self.stage_workers: list[list[Any]] = []
        self.data_workers: list[Any] = []
        self.generation = 0  # raised at each recovery; older calls still in flight are dropped

    # -- creating actors --------------------------------------------------------------------------

    def worker_settings(self, stage: StageSpec) -> WorkerSettings:
        rtype = self.job.cluster.type(stage.type)
        return WorkerSettings(
            seed=self.job.seed,
            mode=self.mode,
            optimizer=self.job.optimizer,
            device=rtype.device,
            torch_threads=rtype.torch_threads,
            type_name=rtype.name,
            max_staleness=self.job.runtime.max_staleness,
            gpu_precision=self.job.runtime.gpu_precision,
        )

    def replace_shard(self, index: int) -> Any:
        """A new actor for PS shard `index` (after its death), reached through ``shards`` as well."""
        self.shard_actors[index] = self.new_shard(index)
        self.shards[index] = RemoteShard(self.shard_actors[index])
        return self.shard_actors[index]

    def new_shard(self, index: int) -> Any:
        cluster = self.job.cluster
        options = cluster.type(cluster.ps_resource).actor_options()
        return warm.spawn(PSShard, options, index, self.num_shards, {SPARSE_TABLE: self.table})

    def new_stage_worker(self, stage: StageSpec, replica: int) -> Any:
        options = self.job.cluster.type(stage.type).actor_options()
        return warm.spawn(
            StageWorker,
            options,
            stage,
            replica,
            self.model,
            self.worker_settings(stage),
            self.dense_ps(stage),
        )

    def new_data_worker(self, index: int) -> Any:
        stage0 = self.stages[0]
        data = DataSettings(
            path=str(self.job.data.path),
            files=tuple(str(f) for f in self.files[index :: self.num_workers]),
            batch_size=self.job.batch_size,
            micro_batches=self.job.runtime.micro_batches,
            epochs=self.job.runtime.epochs,
            max_in_flight=self.job.runtime.max_in_flight,
            batches_ahead=self.job.runtime.batches_ahead,
            workers=self.num_workers,
            readers=self.job.runtime.readers or readers_of(self.job.cluster.type(stage0.type)),
            table=self.table,
            gpu_rows=self.place.gpu_rows,
            op_profile_batches=self.job.runtime.op_profile_batches,
        )
        options = self.job.cluster.type(stage0.type).actor_options()
        return warm.spawn(
            DataWorker,
            options,
            index,
            stage0,
            self.model,
            self.worker_settings(stage0),
            data,
            self.stage_workers,
            self.worker_shards,
            self.dense_ps(stage0),
            self.generation,
        )

    def start(self) -> list[dict[str, Any]]:
        """Start shards, stage workers and data workers; wait until all are placed. Each actor joins
        the set as soon as it is started: a failure part way leaves :meth:`shutdown` the ones before."""
        if self.hosted:
            self.worker_shards = HostedPS(self.num_shards, {SPARSE_TABLE: self.table})
            self.shards = [HostedShard(self.data_worker_0, i) for i in range(self.num_shards)]
        else:
            for i in range(self.num_shards):
                self.shard_actors.append(self.new_shard(i))
            self.shards = [RemoteShard(a) for a in self.shard_actors]
        self.register_dense_tables(range(self.num_shards))
        for stage in self.stages[1:]:
            replicas: list[Any] = []
            self.stage_workers.append(replicas)
            for r in range(stage.replicas):
                replicas.append(self.new_stage_worker(stage, r))
        for i in range(self.num_workers):
            self.data_workers.append(self.new_data_worker(i))
        return self.wait_placed([a for *_, a in self.all_actors()])

    def wait_placed(self, actors: list[Any]) -> list[dict[str, Any]]:
        """Each actor's description once placed; a ConfigError naming the demand when they do not fit."""
        try:
            return ray.get([a.describe.remote() for a in actors], timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise self.not_placed() from None

    def not_placed(self) -> ConfigError:
        """The error of actors not placed within READY_TIMEOUT_S: the plan's demand and what is free."""
        return ConfigError(
            None,
            "stages",
            f"a plan whose actors fit the Ray cluster (demand: {self.demand()}; "
            f"available now: {ray.available_resources()})",
            f"actors not placed after {READY_TIMEOUT_S:.0f} s",
        )

    def dense_ps(self, stage: StageSpec) -> Any:
        """The PS shard holding a stage's dense weights (async, replicated stages), else None."""
        if self.mode.dense_home(stage.replicas) != "ps":
            return None
        return self.shard_actors[stage.index % self.num_shards]

    def register_dense_tables(self, shards: Any) -> None:
        """The initial dense weights of every stage kept on a PS shard in `shards` (none in sync mode)."""
        refs = []
        wanted = set(shards)
        for stage in self.stages:
            if stage.index % self.num_shards not in wanted or self.dense_ps(stage) is None:
                continue
            module = self.model.build(stage.start, stage.end, self.job.seed)
            names = canonical_names(module, self.model)
            params = {names[k]: v.detach().numpy() for k, v in module.named_parameters()}
            if params:
                refs.append(
                    self.dense_ps(stage).register_dense.remote(
                        dense_table_name(stage.index),
                        params,
                        self.job.optimizer.dense,
                        self.job.optimizer.dense_lr,
                    )
                )
        try:  # at the start, before the shards are known to be placed: within the placement deadline
            ray.get(refs, timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise self.not_placed() from None

    def demand(self) -> dict[str, float]:
        """The Ray resources the plan's actors ask for, summed by resource name."""
        demand: dict[str, float] = {}
        counts = [(s.type, s.replicas) for s in self.stages] + [
            (self.job.cluster.ps_resource, self.num_shards)
        ]
        for name, count in counts:
            for key, amount in actor_bundle(self.job.cluster, name).items():
                demand[key] = demand.get(key, 0.0) + amount * count
        return demand

    # -- what the set holds -----------------------------------------------------------------------

    def all_actors(self) -> list[tuple[str, int, int, Any]]:
        """(kind, stage, replica, handle) of every actor; PS shards have stage -1 (hosted shards are
        no actors: they live and die with DataWorker 0)."""
        out = [("ps_shard", -1, i, s) for i, s in enumerate(self.shard_actors)]
        for stage, replicas in self.started_stages():
            out += [("stage_worker", stage.index, r, w) for r, w in enumerate(replicas)]
        return out + [("data_worker", 0, i, w) for i, w in enumerate(self.data_workers)]

    def started_stages(self) -> list[tuple[StageSpec, list[Any]]]:
        """(stage, its StageWorkers) for stages 1..S-1, as far as they were started: all of them once
        :meth:`start` has returned, the first ones (or none) when it failed part way."""
        return list(zip(self.stages[1:], self.stage_workers, strict=False))

    def trained_actors(self) -> dict[str, Any]:
        """Checkpoint file name -> actor with dense weights and optimizer state."""
        owners = {f"data-{i:03d}.npz": w for i, w in enumerate(self.data_workers)}
        for stage, replicas in self.started_stages():
            owners.update({f"stage{stage.index}-replica{r:03d}.npz": w for r, w in enumerate(replicas)})
        return owners

    def type_of(self, kind: str, stage: int) -> str:
        """The resource type an actor of `kind` in `stage` runs on."""
        return self.job.cluster.ps_resource if kind == "ps_shard" else self.stages[stage].type

    def batches_available(self, workers: int | None = None) -> int:
        """Batches all DataWorkers train in the job's epochs (`workers` of them; default this plan's)."""
        n = workers or self.num_workers
        return sum(self.worker_batches(i, n) for i in range(n))

    def worker_batches(self, index: int, workers: int) -> int:
        """Batches DataWorker `index` of `workers` trains in the job's epochs (its files: every
        `workers`-th train partition from `index` on, as new_data_worker gives them)."""
        import pyarrow.parquet as pq

        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files[index::workers])
        return rows // self.job.batch_size * self.job.runtime.epochs

    # -- stats ------------------------------------------------------------------------------------

    def progress(self, indices: list[int] | None = None) -> dict[int, dict[str, int]]:
        """DataWorker index -> its position in its data and the updates it sent (all, or `indices`)."""
        indices = list(range(self.num_workers)) if indices is None else indices
        answers = ray.get([self.data_workers[i].progress.remote() for i in indices])
        return dict(zip(indices, answers, strict=True))

    def stage_stats(self) -> list[list[dict[str, Any]]]:
        refs = [[w.stats.remote() for w in self.data_workers]] + [
            [w.stats.remote() for w in r] for r in self.stage_workers
        ]
        return [ray.get(r) for r in refs]

    def data_wait(self) -> dict[str, Any]:
        """Seconds each DataWorker spent blocked: on gradients coming back (pipeline bubbles, "gradients")
        and on its reader thread (the input, "reader"); and where its training thread's time went, by
        phase ("phases": read, pull, compute, push, step, wait; worker_base.PhaseClock); the host CPU of
        each of its threads per batch, in ms ("threads"), and the ops of a batch where they were counted
        ("ops"; runtime/batch_profile.py)."""
        stats = ray.get([w.stats.remote() for w in self.data_workers])
        return {"gradients": [s["wait_s"] for s in stats], "reader": [s["read_wait_s"] for s in stats],
                "phases": [{k: round(v, 3) for k, v in s["phase_s"].items()} for s in stats],
                "threads": [{k: round(1000 * v / max(s["batches"], 1), 3) for k, v in s["thread_cpu_s"].items()}
                            for s in stats],
                "ops": [s["ops_per_batch"] for s in stats]}  # fmt: skip

    def flush_tables(self) -> None:
        """Rows changed in the DataWorkers' GPU memory back on the PS shards (before a snapshot of the
        shards and at the end; nothing to do where the rows live on the shards)."""
        ray.get([w.flush_table.remote() for w in self.data_workers])

    def table_stats(self, lookups: int = 0) -> dict[str, Any]:
        """Where the table's rows lived and, in GPU memory, the tier's counters summed over the
        DataWorkers (hit rate: lookups served from the GPU over all lookups); with a disk tier, its
        counters over the run's `lookups` (the batches' sparse keys, each time a key is looked up)."""
        parts = ray.get([w.table_stats.remote() for w in self.data_workers])
        out: dict[str, Any] = {"tier": parts[0]["place"] if parts else "ps"}
        for key in ("hits", "misses", "fetched", "written_back", "evicted", "rows_held", "device_bytes"):
            if all(key in p for p in parts):
                out[key] = sum(int(p[key]) for p in parts)
        if "hits" in out:
            looked = out["hits"] + out["misses"]
            out["hit_rate"] = out["hits"] / looked if looked else None
        if self.table.disk_dir:
            out.update(self._disk_stats(lookups))
        return out

    def _disk_stats(self, lookups: int) -> dict[str, Any]:
        """The shards' disk tier, summed: rows in RAM and on disk now, and the share of the run's
        `lookups` whose row was in RAM (``ram_hit_rate``, in the unit of the plan's estimate,
        costmodel/hit_rates.py). A shard counts each distinct key of a call once (its client sent it
        once): a miss is a distinct key of a call whose row was not in RAM, and a key looked up again in
        the same batch finds its row there, as in the estimate's LRU."""
        shards = self.ps_stats()
        tables = [s["disk"][SPARSE_TABLE] for s in shards if SPARSE_TABLE in s.get("disk", {})]
        rows = [s["rows"][SPARSE_TABLE] for s in shards]
        on_disk = sum(int(t["disk_rows"]) for t in tables)
        misses = sum(int(t["disk_misses"]) for t in tables)
        return {
            "ram_rows": sum(rows) - on_disk,
            "disk_rows": on_disk,
            "ram_hit_rate": 1.0 - misses / lookups if lookups else None,
        }

    def ps_stats(self) -> list[dict[str, Any]]:
        return ray.get([s.stats() for s in self.shards])

    def data_worker_0(self) -> Any:
        """The DataWorker that hosts the PS shards of a hosted plan (the current one, after recoveries)."""
        return self.data_workers[0]

    # -- replacing and ending ---------------------------------------------------------------------

    def replace(self, dead: list[dict[str, Any]], placed: Callable[[list[Any]], None]) -> None:
        """Kill the `dead` actors (kind, stage, replica, handle) for good, start replacements with the
        same options (`placed` waits for them), raise the generation and fence the shards with it."""
        for d in dead:
            ray.kill(d["handle"], no_restart=True)
        self.generation += 1
        new_shards = [d["replica"] for d in dead if d["kind"] == "ps_shard"]
        placed([self.replace_shard(i) for i in new_shards])
        self.register_dense_tables(new_shards)
        for d in dead:
            if d["kind"] == "stage_worker":
                stage = self.stages[d["stage"]]
                self.stage_workers[stage.index - 1][d["replica"]] = self.new_stage_worker(stage, d["replica"])
        for i in [d["replica"] for d in dead if d["kind"] == "data_worker"]:
            self.data_workers[i] = self.new_data_worker(i)
        placed([a for *_, a in self.all_actors()])
        ray.get([s.fence(self.generation) for s in self.shards])

    def rewire(self) -> None:
        """Every actor takes the current generation and handles (after replacements)."""
        refs = []
        for stage, replicas in self.started_stages():
            refs += [w.rewire.remote(self.generation, self.dense_ps(stage)) for w in replicas]
        refs += [
            w.rewire.remote(
                self.generation,
                self.stage_workers,
                self.worker_shards,
                self.dense_ps(self.stages[0]),
            )
            for w in self.data_workers
        ]
        ray.get(refs)

    def shutdown(self, keep_warm: bool = False) -> None:
        """End the set's actors, those started so far; `keep_warm` (the run is quiescent: no call of it
        in flight): keep them idle for the next run in this driver (warm.py) instead of killing them.
        Best effort: an actor that cannot be ended (already dead, its Ray gone) is logged and skipped,
        so that the clean-up after a failed run never hides the error that ended it."""
        classes = {"ps_shard": PSShard, "stage_worker": StageWorker, "data_worker": DataWorker}
        for kind, stage, replica, actor in self.all_actors():
            try:
                if keep_warm:
                    options = self.job.cluster.type(self.type_of(kind, stage)).actor_options()
                    warm.keep_warm(actor, classes[kind], options)
                else:
                    ray.kill(actor)
            except Exception as exc:
                log.warning("could not end %s %d/%d: %s", kind, stage, replica, exc)
        self.data_workers, self.stage_workers, self.shards = [], [], []
        self.shard_actors.clear()
