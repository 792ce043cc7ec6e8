"""Parameter-server shards: Ray actors that each own a hash partition of every sparse table
(ps/spec.py says which keys), plus the dense parameter tables of async-mode stages. Workers reach them
through a :class:`~heterps_ray.ps.client.PSClient` (ps/client.py), as actors or hosted in a
DataWorker's own process.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import ray

from heterps_ray.chaos import FaultPoints
from heterps_ray.errors import DataError
from heterps_ray.ps.atomic import Member, NpzReader, write_npz_streamed
from heterps_ray.ps.spec import TableSpec, shard_of
from heterps_ray.ps.table import SparseTable
from heterps_ray.reusable import Reusable, actor_placement

# torch.optim.Adam defaults, so a dense table on the PS steps exactly like the reference's Adam.
_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8

class _DenseTable:
    """Dense parameters of one stage with their optimizer (Adam as torch.optim.Adam, or SGD)."""

    def __init__(self, params: dict[str, np.ndarray], optimizer: str, lr: float):
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"dense optimizer must be adam or sgd (got {optimizer!r})")
        self.optimizer, self.lr = optimizer, lr
        self.params = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        self.exp_avg = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.exp_avg_sq = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.version = 0  # number of updates applied

    def apply(self, grads: dict[str, np.ndarray]) -> int:
        self.version += 1
        if self.optimizer == "sgd":
            for k, g in grads.items():
                self.params[k] -= np.float32(self.lr) * g
            return self.version
        beta1, beta2 = _ADAM_BETAS
        bias1 = 1.0 - beta1**self.version
        bias2 = 1.0 - beta2**self.version
        for k, g in grads.items():
            m, v = self.exp_avg[k], self.exp_avg_sq[k]
            m *= beta1
            m += (1.0 - beta1) * g
            v *= beta2
            v += (1.0 - beta2) * g * g
            denom = np.sqrt(v) / np.sqrt(bias2) + _ADAM_EPS
            self.params[k] -= (self.lr / bias1) * m / denom
        return self.version

    def state(self, prefix: str) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {f"{prefix}/version": np.array(self.version, dtype=np.int64)}
        for k in self.params:
            out[f"{prefix}/param/{k}"] = self.params[k]
            out[f"{prefix}/exp_avg/{k}"] = self.exp_avg[k]
            out[f"{prefix}/exp_avg_sq/{k}"] = self.exp_avg_sq[k]
        return out

    def load_state(self, prefix: str, state: dict[str, np.ndarray]) -> None:
        self.version = int(state[f"{prefix}/version"])
        for k in self.params:
            self.params[k] = np.array(state[f"{prefix}/param/{k}"], dtype=np.float32)
            self.exp_avg[k] = np.array(state[f"{prefix}/exp_avg/{k}"], dtype=np.float32)
            self.exp_avg_sq[k] = np.array(state[f"{prefix}/exp_avg_sq/{k}"], dtype=np.float32)


class _ShardMetrics:
    """Ray metrics of one shard (exported by Ray's metrics agent next to the workers' ones)."""

    def __init__(self, index: int):
        from ray.util import metrics

        tags = {"role": "ps", "shard": str(index)}
        keys = tuple(tags)
        self.rows = metrics.Gauge("heterps_ps_rows", "sparse rows held", tag_keys=keys)
        self.pulled = metrics.Counter("heterps_ps_keys_pulled", "keys pulled", tag_keys=keys)
        self.pushed = metrics.Counter("heterps_ps_keys_pushed", "keys pushed", tag_keys=keys)
        for m in (self.rows, self.pulled, self.pushed):
            m.set_default_tags(tags)


class PSShard(Reusable):
    """One shard: a SparseTable per sparse table name (its hash partition) and whole dense tables.

    Run it as a Ray actor (:func:`start_shards`); methods take and return numpy arrays.
    """

    def __init__(self, index: int, num_shards: int, tables: dict[str, TableSpec]):
        self.index, self.num_shards = index, num_shards
        self._specs = dict(tables)
        self._tables = {
            name: SparseTable(**asdict(spec.for_shard(index, num_shards, name))) for name, spec in tables.items()
        }
        self._dense: dict[str, _DenseTable] = {}
        self._counts = {
            "pulls": 0,
            "pushes": 0,
            "keys_pulled": 0,
            "keys_pushed": 0,
            "dense_pushes": 0,
            "stale_dropped": 0,
        }
        self._generation = 0  # pushes tagged with an older one are dropped
        # DataWorker -> pushes applied per batch index: proves no batch is lost or applied twice
        self._applied: dict[int, np.ndarray] = {}
        self._busy_s = 0.0
        self._started = time.perf_counter()
        # in a Ray worker (an actor, or hosted in a DataWorker); a plain object elsewhere
        self._metrics = _ShardMetrics(index) if ray.is_initialized() else None
        self.faults = FaultPoints()  # chaos tests: die inside a call of a given phase (chaos.py)

    def describe(self) -> dict[str, Any]:
        """Where this shard runs: its index, pid and the Ray resources it was given."""
        return actor_placement(role="ps", index=self.index)

    def arm_fault(self, point: str, how: str = "sigkill", flag: str = "") -> None:
        """Chaos testing: die inside the next call of phase `point` (heterps_ray.chaos.FaultPoints)."""
        self.faults.arm(point, how, flag)

    # -- sparse -------------------------------------------------------------------------------

    def pull(
        self, table: str, keys: np.ndarray, create: bool = True, unique: bool = False, step: int | None = None
    ) -> np.ndarray:
        """Rows for `keys` (all of this shard's partition), float32[n, dim]; `unique`: keys distinct;
        `step`: the global batch index (the clock of admission counts and TTL)."""
        self.faults.reached("train" if create else "evaluate")
        t0 = time.perf_counter()
        rows = self._tables[table].pull(keys, create=create, unique=unique, step=step)
        self._counts["pulls"] += 1
        self._counts["keys_pulled"] += len(keys)
        self._busy_s += time.perf_counter() - t0
        if self._metrics is not None and len(keys):
            self._metrics.pulled.inc(len(keys))
            self._metrics.rows.set(len(self._tables[table]))
        return rows

    def push(
        self,
        table: str,
        keys: np.ndarray,
        grads: np.ndarray,
        tag: tuple[int, int, int] | None = None,
        unique: bool = False,
    ) -> int:
        """Adagrad step with the summed gradient of each key; returns the number of keys pushed.
        `unique`: the keys are distinct and their gradients already summed.
        `tag` (DataWorker, batch index, generation) is counted in :meth:`applied`; a push of a
        generation older than :meth:`fence`'s is dropped (sent before a recovery, arriving after)."""
        if tag is not None and tag[2] < self._generation:
            self._counts["stale_dropped"] += 1
            return 0
        t0 = time.perf_counter()
        if len(keys):
            self._tables[table].push(keys, grads, unique=unique)
        if tag is not None:
            self._count_applied(tag[0], tag[1])
        self._counts["pushes"] += 1
        self._counts["keys_pushed"] += len(keys)
        self._busy_s += time.perf_counter() - t0
        if self._metrics is not None and len(keys):
            self._metrics.pushed.inc(len(keys))
        return len(keys)

    # -- a tier above (ps/device_table.py: rows in a GPU's memory) -------------------------------

    def fetch_rows(
        self, table: str, keys: np.ndarray, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whole rows (weights, accumulators, admitted) of distinct `keys` for a tier that takes them
        over, created and counted for admission as :meth:`pull` does."""
        self.faults.reached("train")
        t0 = time.perf_counter()
        out = self._tables[table].fetch(keys, step=step)
        self._counts["pulls"] += 1
        self._counts["keys_pulled"] += len(keys)
        self._busy_s += time.perf_counter() - t0
        return out

    def put_rows(
        self,
        table: str,
        keys: np.ndarray,
        weights: np.ndarray,
        accumulators: np.ndarray,
        tags: list[tuple[int, int, int]] | None = None,
    ) -> int:
        """Rows a tier above writes back (weights and accumulators of keys it fetched from here), with
        the batches whose updates they carry, `tags` (DataWorker, batch index, generation), counted in
        :meth:`applied` as pushes are. A call of a generation older than :meth:`fence`'s is dropped
        whole. Returns the rows written."""
        tags = tags or []
        if any(tag[2] < self._generation for tag in tags):
            self._counts["stale_dropped"] += 1
            return 0
        t0 = time.perf_counter()
        absent = self._tables[table].put(keys, weights, accumulators) if len(keys) else 0
        if absent:
            raise ValueError(f"PS shard {self.index}: {absent} rows written back that it never held")
        for worker, batch, _ in tags:
            self._count_applied(worker, batch)
        self._counts["keys_pushed"] += len(keys)
        self._busy_s += time.perf_counter() - t0
        return len(keys)

    def _count_applied(self, worker: int, batch: int) -> None:
        counts = self._applied.get(worker, np.zeros(0, dtype=np.int64))
        if batch >= len(counts):
            grown = np.zeros(max(batch + 1, 2 * len(counts)), dtype=np.int64)
            grown[: len(counts)] = counts
            counts = self._applied[worker] = grown
        counts[batch] += 1

    def fence(self, generation: int) -> None:
        """From now on drop tagged pushes of older generations (the driver calls it at a recovery)."""
        self._generation = generation

    def applied(self) -> dict[int, np.ndarray]:
        """Per DataWorker: how many tagged pushes this shard applied for each batch index."""
        return {w: c.copy() for w, c in self._applied.items()}

    # -- dense (async mode) ---------------------------------------------------------------------

    def register_dense(self, name: str, params: dict[str, np.ndarray], optimizer: str, lr: float) -> int:
        """Create (or replace) a dense table with its initial values; returns its version (0)."""
        self._dense[name] = _DenseTable(params, optimizer, lr)
        return 0

    def push_dense(
        self, name: str, grads: dict[str, np.ndarray], held: int = -1, max_staleness: int = -1
    ) -> tuple[int, dict[str, np.ndarray] | None]:
        """One optimizer step on a dense table; returns (its new version, its parameters when the
        caller's weights, of version `held`, are now more than `max_staleness` versions behind)."""
        t0 = time.perf_counter()
        table = self._dense[name]
        version = table.apply(grads)
        self._counts["dense_pushes"] += 1
        self._busy_s += time.perf_counter() - t0
        stale = held >= 0 and max_staleness >= 0 and version - held > max_staleness
        return version, (table.params if stale else None)

    def pull_dense(self, name: str) -> tuple[int, dict[str, np.ndarray]]:
        """(version, parameters) of a dense table."""
        table = self._dense[name]
        return table.version, table.params

    # -- stats and state ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Rows, bytes, call counts, keys/s over busy time, and busy fraction since start."""
        rows = {name: len(t) for name, t in self._tables.items()}
        # rows, index and keys waiting for admission, as the tables hold them
        nbytes = sum(t.nbytes for t in self._tables.values())
        nbytes += sum(sum(p.nbytes * 3 for p in d.params.values()) for d in self._dense.values())
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        keys = self._counts["keys_pulled"] + self._counts["keys_pushed"]
        # the disk tier's rows, hits and misses, rows written back, file and index bytes, by table
        disk = {
            name: {k: v for k, v in t.stats().items() if k.startswith("disk_")}
            for name, t in self._tables.items()
            if t.disk is not None
        }
        return {
            "index": self.index,
            "rows": rows,
            "bytes": nbytes,
            **self._counts,
            "dense_versions": {name: d.version for name, d in self._dense.items()},
            "keys_per_s": keys / max(self._busy_s, 1e-9),
            "busy": self._busy_s / elapsed,
            **({"disk": disk} if disk else {}),
        }

    def state(self) -> dict[str, np.ndarray]:
        """Everything this shard holds as flat named numpy arrays (no pickled objects)."""
        self.faults.reached("save")
        return self._state()

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore a :meth:`state` of a shard with the same index and shard count."""
        self._check_owner(state)
        for name, table in self._tables.items():
            prefix = f"sparse/{name}/"
            table.load_state({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        self._load_rest(state)

    def _check_owner(self, state: dict[str, np.ndarray]) -> None:
        if int(state["shard/index"]) != self.index or int(state["shard/num_shards"]) != self.num_shards:
            raise ValueError(
                f"state is of shard {int(state['shard/index'])}/{int(state['shard/num_shards'])}, "
                f"not {self.index}/{self.num_shards}"
            )

    def _load_rest(self, state: dict[str, np.ndarray]) -> None:
        """Dense tables and applied counts (whole in every snapshot, delta or full)."""
        for name, dense in self._dense.items():
            dense.load_state(f"dense/{name}", state)
        self._applied = {
            int(k.split("/", 1)[1]): np.array(v, dtype=np.int64)
            for k, v in state.items()
            if k.startswith("applied/")
        }

    def _state(self) -> dict[str, np.ndarray]:
        """:meth:`state` (a checkpoint writes the same through :meth:`_snapshot_members`)."""
        out: dict[str, np.ndarray] = {
            "shard/index": np.array(self.index, dtype=np.int64),
            "shard/num_shards": np.array(self.num_shards, dtype=np.int64),
        }
        for name, table in self._tables.items():
            for k, v in table.state().items():
                out[f"sparse/{name}/{k}"] = v
        for name, dense in self._dense.items():
            out.update(dense.state(f"dense/{name}"))
        for worker, counts in self._applied.items():
            out[f"applied/{worker}"] = counts.copy()
        return out

    def snapshot(self, path: str, delta: bool = False) -> dict[str, Any]:
        """Write :meth:`state` (or with `delta` only what changed since the last durable snapshot or
        restore) to `path` as an .npz, atomically (temporary file, fsync, rename), and report what was
        written where: the file, its SHA-256 and size, and the Ray node and host that wrote it (the
        driver cannot hash a file on another node's disk; the manifest lists these). The changes stay
        pending until :meth:`snapshot_durable`."""
        self.faults.reached("checkpoint")
        digest, size = write_npz_streamed(path, self._snapshot_members(delta, Path(path)))
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        return {
            "file": Path(path).name,
            "sha256": digest,
            "bytes": size,
            "node": node,
            "host": socket.gethostname(),
            "kind": "delta" if delta else "full",
        }

    def _snapshot_members(self, delta: bool, path: Path | None = None) -> list[Member]:
        """What :meth:`snapshot` writes, as streamed .npz members: :meth:`_state`'s arrays, with each
        table's rows (all, or with `delta` only those changed since the last durable snapshot) read in
        chunks while the file is written, so no copy of the table is held in memory."""
        out = [
            Member.of("shard/index", np.array(self.index, dtype=np.int64)),
            Member.of("shard/num_shards", np.array(self.num_shards, dtype=np.int64)),
        ]
        if delta:
            out.append(Member.of("shard/delta", np.array(1, dtype=np.int64)))
        for name, table in self._tables.items():
            # a table's rows on disk: hard-linked beside the snapshot, not copied into it
            link = path.with_name(f"{path.stem}.{name}.rows") if path is not None else None
            for member in table.snapshot_members(delta, link):
                member.name = f"sparse/{name}/{member.name}"
                out.append(member)
        for name, dense in self._dense.items():
            out += [Member.of(k, v) for k, v in dense.state(f"dense/{name}").items()]
        out += [Member.of(f"applied/{worker}", counts) for worker, counts in self._applied.items()]
        return out

    def pending_share(self) -> float:
        """The largest share of a table's rows a delta snapshot now would hold (1.0 when none is
        possible yet: a full snapshot is due)."""
        share = 0.0
        for table in self._tables.values():
            pending = table.pending_changes()
            if pending is None:
                return 1.0
            share = max(share, pending[0] / max(pending[1], 1))
        return share

    def write_rows(self, path: str, table: str) -> dict[str, Any]:
        """The final model's file of this shard's rows of `table` (keys, weights, accumulators, in
        the row store's order), streamed as :meth:`snapshot` does; returns its rows and SHA-256."""
        members = [
            m for m in self._tables[table].row_members() if m.name in ("keys", "weights", "accumulators")
        ]
        digest, size = write_npz_streamed(path, members)
        return {"rows": len(self._tables[table]), "sha256": digest, "bytes": size}

    def snapshot_durable(self) -> None:
        """The checkpoint of the last :meth:`snapshot` is committed: the next delta is relative to it."""
        for table in self._tables.values():
            table.snapshot_durable()

    def restore(self, path: str) -> None:
        """Load a full :meth:`snapshot` file (a DataError naming it if it is truncated, corrupted or
        not a snapshot of this shard)."""
        self.restore_chain([path])

    def restore_chain(self, paths: list[str]) -> None:
        """Load a full :meth:`snapshot` and replay the delta snapshots after it, in order (a
        DataError naming the file that is truncated, corrupted, or not the link it should be)."""
        for i, path in enumerate(paths):
            with NpzReader(path) as npz:
                try:
                    self._restore_link(npz, first=i == 0)
                except (KeyError, ValueError) as exc:
                    raise DataError(
                        f"{path}: not a snapshot of PS shard {self.index}/{self.num_shards} ({exc!r})"
                    ) from None

    def _restore_link(self, npz: NpzReader, first: bool) -> None:
        """One link of a chain: a full snapshot's rows streamed into the tables, or a delta applied."""
        small = {k: npz.array(k) for k in npz.names if not k.startswith("sparse/")}
        if bool(int(small.get("shard/delta", 0))) != (not first):
            raise ValueError("a full snapshot first, then deltas" if not first else "a full snapshot")
        self._check_owner(small)
        for name, table in self._tables.items():
            prefix = f"sparse/{name}/"
            if first:
                table.load_snapshot(npz, prefix)
            else:
                table.apply_snapshot_changes(npz, prefix)
        self._load_rest(small)


def reshard_states(states: list[dict[str, np.ndarray]], num_shards: int) -> list[dict[str, np.ndarray]]:
    """:meth:`PSShard.state` of every old shard -> the states of `num_shards` new shards: sparse rows
    merged and redistributed with :func:`shard_of`; dense tables (async) must not be present.
    Applied-batch counts carry over where all old shards agree (the minimum otherwise). A table's
    per-row counters go with their rows, keys waiting for admission with their keys (by
    ``candidate_keys``), and its clock (``step``) is the latest of the old shards'."""
    if any(k.startswith("dense/") for st in states for k in st):
        raise ValueError("dense tables (async mode) cannot be re-sharded; keep the PS shard count")
    tables = sorted({k.split("/")[1] for st in states for k in st if k.startswith("sparse/")})
    out: list[dict[str, np.ndarray]] = [
        {"shard/index": np.array(i, dtype=np.int64), "shard/num_shards": np.array(num_shards, dtype=np.int64)}
        for i in range(num_shards)
    ]
    for table in tables:
        prefix = f"sparse/{table}/"
        fields = sorted({k[len(prefix) :] for st in states for k in st if k.startswith(prefix)})
        clocks = [int(st[prefix + "step"]) for st in states if prefix + "step" in st]
        for group in ("", "candidate_"):
            names = [f for f in fields if f.startswith(group) and (group or not f.startswith("candidate_"))]
            names = [f for f in names if f != "step"]
            if group + "keys" not in names:
                continue
            merged = {f: np.concatenate([st[prefix + f] for st in states if prefix + f in st]) for f in names}
            owner = shard_of(merged[group + "keys"], num_shards)
            for i in range(num_shards):
                mine = owner == i
                out[i].update({prefix + f: v[mine] for f, v in merged.items()})
        if clocks:
            for st in out:
                st[prefix + "step"] = np.array(max(clocks), dtype=np.int64)
    workers = sorted({k for st in states for k in st if k.startswith("applied/")})
    for name in workers:
        parts = [st.get(name, np.zeros(0, dtype=np.int64)) for st in states]
        length = max(len(p) for p in parts)
        padded = np.stack([np.pad(p, (0, length - len(p))) for p in parts])
        for st in out:
            st[name] = padded.min(axis=0)
    return out


def start_shards(num_shards: int, tables: dict[str, TableSpec], actor_options: dict[str, Any]) -> list[Any]:
    """Start `num_shards` PSShard actors with `actor_options` (e.g. a resource type's)."""
    actor = ray.remote(PSShard)
    return [
        actor.options(name=None, max_concurrency=1, **actor_options).remote(i, num_shards, tables)
        for i in range(num_shards)
    ]
