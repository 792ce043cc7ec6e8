"""Taking and restoring a run's training state: checkpoints of every actor (PS shard snapshots,
dense weights and optimizer state, data positions) written by :class:`CheckpointSaver` into the
folder format of checkpoint.py, and loaded back by :class:`StateStore`, also into another plan (dense
state by layer name, PS rows re-sharded, async dense weights moved between workers and PS shards).

The recovery point before the first checkpoint is the run's start, kept in memory
(:meth:`StateStore.capture`); both kinds of source restore through the same :meth:`StateStore.roll_back`.

Checkpoints are incremental (``runtime.checkpoint_full_every`` = K): every K-th is a full one, the
ones between hold, per PS shard, only the rows changed and the keys removed since the one before
(the rest of the state, dense weights and data positions, is small and whole in each). A delta's
manifest lists its chain (checkpoint.py); restoring one replays the chain's full snapshot and its
deltas in order. A delta is written only relative to :attr:`StateStore.base`, the checkpoint the
shards hold since they committed or restored it; any other restore makes the next checkpoint full, and
so does a delta that would hold more than ``runtime.checkpoint_delta_max_share`` of a shard's rows.

Each PS shard writes its own snapshot file, streamed from its table in chunks (ps/atomic.py
``write_npz_streamed``): neither the shard's process nor the driver holds a copy of the table.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from heterps_ray.errors import ConfigError, DataError
from heterps_ray.ps.atomic import NpzReader, read_npz, write_npz_atomic
from heterps_ray.ps.shard import PSShard, reshard_states
from heterps_ray.runtime.actors import READY_TIMEOUT_S, ActorSet
from heterps_ray.runtime.checkpoint import (
    MANIFEST,
    begin_training_checkpoint,
    chain_links,
    chain_of,
    commit_training_checkpoint,
    jsonable,
    latest_training_checkpoint,
)
from heterps_ray.runtime.modes import mode_of
from heterps_ray.runtime.sparse import SPARSE_TABLE
from heterps_ray.runtime.stage import dense_table_name

# A recovery source: a checkpoint directory, or the in-memory start state of StateStore.capture.
Source = Path | dict[str, Any]


def shard_file(index: int) -> str:
    return f"ps-shard-{index:05d}.npz"


class StateStore:
    """Writes every actor's state into a checkpoint directory and loads one back into the actors."""

    def __init__(self, actors: ActorSet):
        self.actors = actors
        self._remapped: set[Path] = set()  # async checkpoints of another plan (restored by layer name)
        # the checkpoint the PS shards hold since they committed or restored it: what a delta is
        # relative to (None: the next checkpoint is full)
        self.base: Path | None = None

    def write(self, tmp: Path, delta: bool = False) -> list[dict[str, Any]]:
        """Between chunks (sparse pushes settled, optimizers stepped): every actor's state into `tmp`,
        the PS shards' rows whole or, with `delta`, those changed since :attr:`base`. Returns each PS
        shard's report of its snapshot (file, SHA-256, node), for the manifest."""
        actors = self.actors
        ray.get(actors.mode.settle_dense([w for r in actors.stage_workers for w in r]))
        actors.flush_tables()
        snapshots = [s.snapshot(str(tmp / shard_file(i)), delta) for i, s in enumerate(actors.shards)]
        try:
            owners = actors.trained_actors()
            for name, state in zip(
                owners, ray.get([a.train_state.remote() for a in owners.values()]), strict=True
            ):
                write_npz_atomic(tmp / name, state)
            return list(ray.get(snapshots))
        except BaseException:
            # An actor died mid-checkpoint: let the live shards finish writing into `tmp` before the
            # caller removes it, so that none of them fails on a vanished directory.
            ray.wait(snapshots, num_returns=len(snapshots), timeout=READY_TIMEOUT_S)
            raise

    def delta_pays(self, max_share: float) -> bool:
        """Whether every PS shard's changes since :attr:`base` are at most `max_share` of its rows
        (``runtime.checkpoint_delta_max_share``); else the next checkpoint is written full. A delta's
        rows are gathered in memory before they are written (a full snapshot streams from the table),
        so the share bounds what a checkpoint adds to a table's memory (a 10% delta of a 10M-row
        table added 12.6% of the planner's estimate at its peak: inside its 15%). On Criteo-shaped
        data most rows change within 300 s, which makes a delta as big as a full snapshot, slower to
        gather, and one more link to replay."""
        return max(ray.get([s.pending_share() for s in self.actors.shards]), default=0.0) <= max_share

    def durable(self, checkpoint: Path) -> None:
        """`checkpoint` (just written by :meth:`write`) is committed: the next delta builds on it."""
        ray.get([s.snapshot_durable() for s in self.actors.shards])
        self.base = checkpoint

    def capture(self) -> dict[str, Any]:
        """The run's start state in memory (PS shards are still nearly empty): the recovery point
        until the first checkpoint."""
        self.actors.flush_tables()
        owners = self.actors.trained_actors()
        states = ray.get([a.train_state.remote() for a in owners.values()])
        return {
            "shards": ray.get([s.state() for s in self.actors.shards]),
            "actors": dict(zip(owners, states, strict=True)),
        }

    def restore(self, directory: Path, remap: bool = False) -> None:
        """Load a verified checkpoint into freshly started actors. `remap`: the checkpoint is of
        another plan. Sync mode: dense state goes by layer name, PS rows are re-sharded when the shard
        count differs. Async mode: the same, and the dense weights with their Adam moments move
        between the workers and the PS by layer name, wherever each plan keeps a stage's weights (a
        replicated stage on a PS shard, a single replica in its worker; stage/dense_home)."""
        if remap and self.actors.mode.moves_dense:
            self._remapped.add(Path(directory))  # a fault later rolls back to it the same way
        self.roll_back_shards(Path(directory))
        self.roll_back_actors(Path(directory))

    def roll_back_shards(self, source: Source) -> None:
        actors = self.actors
        self.base = None
        if isinstance(source, dict):
            ray.get([s.load_state(st) for s, st in zip(actors.shards, source["shards"], strict=True)])
            return
        if source in self._remapped:
            states = self._remapped_shard_states(source)
            ray.get([s.load_state(st) for s, st in zip(actors.shards, states, strict=True)])
            return
        links = chain_of(source)
        if len(list(source.glob("ps-shard-*.npz"))) == actors.num_shards:
            ray.get(
                [
                    s.restore_chain([str(link / shard_file(i)) for link in links])
                    for i, s in enumerate(actors.shards)
                ]
            )
            self.base = source
            return
        states = reshard_states(self._saved_shard_states(source), actors.num_shards)
        ray.get([s.load_state(st) for s, st in zip(actors.shards, states, strict=True)])

    def _saved_shard_states(self, source: Path) -> list[dict[str, np.ndarray]]:
        """The sparse state of each PS shard of a checkpoint (of any shard count), its chain replayed
        into a scratch shard here; dense tables (async) are not kept (see :func:`layer_states`)."""
        links = chain_of(source)
        count = len(list(source.glob("ps-shard-*.npz")))
        states = []
        for i in range(count):
            shard = PSShard(i, count, {SPARSE_TABLE: self.actors.table})
            shard.restore_chain([str(link / shard_file(i)) for link in links])
            states.append(shard.state())
            del shard
        return states

    def roll_back_actors(self, source: Source) -> None:
        actors = self.actors
        owners = actors.trained_actors()
        if isinstance(source, dict):
            ray.get([a.load_train_state.remote(source["actors"][name]) for name, a in owners.items()])
        elif source in self._remapped:
            layers = layer_states(source)
            ray.get(
                [a.load_train_state.remote(self._actor_state(source, n, layers)) for n, a in owners.items()]
            )
        else:
            saved = {
                p.name: read_npz(p) for p in sorted(source.glob("*.npz")) if not p.name.startswith("ps-")
            }
            dense = {k: v for st in saved.values() for k, v in st.items() if not k.startswith("data/")}
            refs = []
            for name, actor in owners.items():
                state = dict(dense)
                if name.startswith("data-"):
                    if name not in saved:
                        raise DataError(f"{source}: no {name} (the checkpoint has another DataWorker count)")
                    state.update({k: v for k, v in saved[name].items() if k.startswith("data/")})
                refs.append(actor.load_train_state.remote(state))
            ray.get(refs)
        # replicas take the restored weights from the PS
        ray.get(actors.mode.settle_dense([w for kind, _, _, w in actors.all_actors() if kind != "ps_shard"]))

    def _remapped_shard_states(self, source: Path) -> list[dict[str, np.ndarray]]:
        """States of this plan's PS shards from an async checkpoint of another plan: the sparse rows
        re-sharded, and a dense table (weights, Adam moments, version) for each stage this plan keeps
        on a PS shard, built by layer name from wherever the checkpoint kept those layers."""
        actors = self.actors
        states = reshard_states(self._saved_shard_states(source), actors.num_shards)
        dense = layer_states(source)
        for stage in actors.stages:
            if actors.dense_ps(stage) is None:
                continue
            table = f"dense/{dense_table_name(stage.index)}"
            layers = [layer.name for layer in actors.model.layers[stage.start : stage.end]]
            names = [n for n in dense if any(n.startswith(f"{layer}.") for layer in layers)]
            state = states[stage.index % actors.num_shards]
            state[f"{table}/version"] = np.array(
                max((int(dense[n].get("step", 0)) for n in names), default=0)
            )
            for n in names:
                param = np.asarray(dense[n]["param"], dtype=np.float32)
                state[f"{table}/param/{n}"] = param
                for moment in ("exp_avg", "exp_avg_sq"):
                    value = dense[n].get(moment, np.zeros_like(param))
                    state[f"{table}/{moment}/{n}"] = np.asarray(value, dtype=np.float32)
        return states

    def _actor_state(
        self, source: Path, name: str, dense: dict[str, dict[str, np.ndarray]]
    ) -> dict[str, Any]:
        """What `load_train_state` of this plan's actor `name` takes, from an async checkpoint of
        another plan: every layer's weights (and Adam state, for weights kept in the worker), plus a
        DataWorker's own position in its data."""
        state: dict[str, Any] = {}
        for n, entry in dense.items():
            state[f"param/{n}"] = entry["param"]
            if self.actors.job.optimizer.dense == "adam" and "exp_avg" in entry:
                state[f"optim/{n}/exp_avg"] = entry["exp_avg"]
                state[f"optim/{n}/exp_avg_sq"] = entry["exp_avg_sq"]
                state[f"optim/{n}/step"] = np.array(float(entry.get("step", 0)), dtype=np.float32)
        if name.startswith("data-"):
            state.update(self._data_position(source, int(name[len("data-") : -len(".npz")])))
        return state

    def _data_position(self, source: Path, index: int) -> dict[str, np.ndarray]:
        """Where this plan's DataWorker `index` resumes in its data, from an async checkpoint of
        another plan: its own position when the checkpoint has as many DataWorkers; else (async only,
        other counts are refused in sync mode) the same fraction of its own batches as all old
        DataWorkers had done of theirs: the partitions differ, so some rows are seen once more and as
        many not at all, which async training (no promise of the sync result) accepts."""
        actors = self.actors
        saved = [read_npz(p) for p in sorted(source.glob("data-*.npz"))]
        if len(saved) == actors.num_workers:
            return {k: v for k, v in saved[index].items() if k.startswith("data/")}
        if not saved:
            raise DataError(f"{source}: no data-*.npz (DataWorker positions) in the checkpoint")
        done = sum(int(st["data/batch_index"]) for st in saved)
        fraction = done / max(actors.batches_available(len(saved)), 1)
        skip = int(fraction * actors.worker_batches(index, actors.num_workers))
        updates = sum(int(st.get("data/updates", st["data/batch_index"])) for st in saved)
        return {
            "data/batch_index": np.array(skip, dtype=np.int64),
            "data/counter": np.array(max(int(st["data/counter"]) for st in saved), dtype=np.int64),
            "data/samples": np.array(skip * actors.job.batch_size, dtype=np.int64),
            "data/updates": np.array(round(updates / actors.num_workers), dtype=np.int64),
        }


def layer_states(source: Path) -> dict[str, dict[str, np.ndarray]]:
    """Whole-model parameter name -> its "param" and, where the checkpoint has them, "exp_avg",
    "exp_avg_sq" and "step" (Adam), from an async checkpoint of any plan: the workers' files for
    weights they kept, the PS shards' dense tables (authoritative: a replica's copy may be stale)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for path in sorted(source.glob("*.npz")):
        if path.name.startswith("ps-"):
            continue
        for key, value in read_npz(path).items():
            if key.startswith("param/"):
                out.setdefault(key[len("param/") :], {})["param"] = value
            elif key.startswith("optim/"):
                name, field_name = key[len("optim/") :].rsplit("/", 1)
                out.setdefault(name, {})[field_name] = value
    for path in sorted(source.glob("ps-shard-*.npz")):
        with NpzReader(path) as npz:  # the dense tables only: not the shard's rows
            state = {k: npz.array(k) for k in npz.names if k.startswith("dense/")}
        for key, value in state.items():
            parts = key.split("/", 3)
            if parts[0] != "dense" or len(parts) != 4:
                continue
            _, table, field_name, name = parts
            entry = out.setdefault(name, {})
            entry[field_name] = value
            entry["step"] = np.asarray(state[f"dense/{table}/version"])
    return out


class CheckpointSaver:
    """Writes output_dir/checkpoints/step-XXXXXXXX every `every` batches and every `interval_s`
    seconds (either 0: not by that), keeping the newest `keep`."""

    def __init__(
        self,
        output_dir: Path,
        plan: dict[str, Any],
        num_shards: int,
        every: int = 0,
        interval_s: float = 0.0,
        keep: int = 2,
        full_every: int = 1,
        delta_max_share: float = 1.0,
    ):
        self.output_dir, self.plan, self.num_shards = output_dir, plan, num_shards
        self.every, self.interval_s, self.keep, self.full_every = every, interval_s, keep, full_every
        self.delta_max_share = delta_max_share
        self.written: list[str] = []
        self.errors: list[str] = []  # checkpoints the disk refused (the run went on without them)
        self.seconds: list[float] = []  # what each checkpoint took to write
        self._last = time.monotonic()

    def next_step(self, done: int) -> int:
        """The next step-count boundary to end a chunk on (none when not checkpointing by steps)."""
        if not self.every:
            return 1 << 62
        return (done // self.every + 1) * self.every

    def due(self, done: int, before: int) -> bool:
        """A checkpoint is due after a chunk that went from `before` to `done` batches."""
        by_steps = bool(self.every) and done >= self.next_step(before)
        return by_steps or (self.interval_s > 0 and time.monotonic() - self._last >= self.interval_s)

    def save(self, store: StateStore, done: int, samples: int, losses: list[float]) -> Path:
        t0 = time.monotonic()
        chain = self._chain(store.base)
        if chain and not store.delta_pays(self.delta_max_share):
            chain = []  # most rows changed: a full checkpoint (starts a new chain)
        tmp = begin_training_checkpoint(self.output_dir, done)
        try:
            shards = store.write(tmp, delta=bool(chain))
            info = {
                "samples": samples,
                "losses": losses,
                "plan": jsonable(self.plan),
                "ps_shards": self.num_shards,
                "shards": shards,  # each snapshot as its shard wrote it: a missing one is refused
                "kind": "delta" if chain else "full",
                "chain": chain,  # the full checkpoint and the deltas this one builds on, in order
            }
            final = commit_training_checkpoint(tmp, self.output_dir, done, info, keep=self.keep)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise  # the shards keep their changes pending: the next checkpoint still carries them
        store.durable(final)
        self.written.append(str(final))
        self._last = time.monotonic()
        self.seconds.append(self._last - t0)
        return final

    def _chain(self, base: Path | None) -> list[dict[str, str]]:
        """The links a delta on `base` builds on; none (a full checkpoint is due) without a base, or
        when the chain already holds `full_every` checkpoints."""
        if base is None or self.full_every <= 1:
            return []
        try:
            links = chain_links(base)
        except (OSError, ValueError):
            return []  # the base is gone or unreadable: start a new chain
        return links if len(links) < self.full_every else []


def resume_point(output_dir: Path, plan: dict[str, Any], num_shards: int, mode: str) -> dict[str, Any]:
    """The newest valid checkpoint of `output_dir`, checked against this run's plan. Sync mode: any
    plan with as many DataWorkers (stage 0 replicas; each resumes its own partitions at its own
    position, so the result equals an uninterrupted run). Async mode: any plan (a different DataWorker
    count resumes at the same fraction of the data, see :meth:`StateStore._data_position`). Dense state
    and PS rows are plan-independent, see :meth:`StateStore.restore`."""
    directory, manifest, skipped = latest_training_checkpoint(output_dir)
    stages = json.loads(json.dumps(jsonable(plan.get("stages"))))
    saved = (manifest.get("plan") or {}).get("stages") or []
    same = saved == stages and manifest.get("ps_shards") == num_shards
    workers = stages[0]["replicas"] if stages else None
    if not same and (not saved or not mode_of(mode).resumes_with(saved[0].get("replicas"), workers)):
        raise ConfigError(
            str(directory / MANIFEST),
            "plan",
            f"in sync mode, a plan with as many DataWorkers (stage 0 replicas: "
            f"{saved[0].get('replicas') if saved else '?'}) as the checkpoint was written with",
            f"{workers} DataWorkers",
        )
    return {
        "directory": directory,
        "steps": int(manifest["step"]),
        "samples": int(manifest["samples"]),
        "losses": [float(x) for x in manifest["losses"]],
        "skipped": skipped,
        "plan_changed": not same,
    }
