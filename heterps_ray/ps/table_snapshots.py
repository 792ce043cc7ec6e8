"""A :class:`~heterps_ray.ps.table.SparseTable`'s state: what it holds, written to a checkpoint and read
back (SparseTable takes these methods from :class:`TableSnapshots`).

:meth:`TableSnapshots.state` is every row sorted by key, with the counters, the clock and the keys
waiting for admission where the table tracks keys. Snapshots stream: :meth:`~TableSnapshots.snapshot_members`
hands the checkpoint writer (ps/atomic.py) its arrays in chunks of SNAPSHOT_CHUNK_ROWS rows, read from
the row store (and the disk tier's file) as they are written, so a snapshot never holds a second copy of
a big table.

Changes (incremental checkpoints): from a table's first snapshot or restore on, the row store keeps
a dirty bit per row and a log of removed keys. :meth:`snapshot_state` takes them (a full state, or
with ``delta=True`` only the rows written and the keys removed since the last durable snapshot);
:meth:`snapshot_durable` forgets them once the checkpoint is committed, so a snapshot that is never
committed leaves its rows to the next one. :meth:`apply_snapshot_changes` replays a delta file onto a
table.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from heterps_ray.ps.atomic import Member, NpzReader
from heterps_ray.ps.disk_tier import DiskTier, read_linked, record_dtype

# Rows per chunk of a streamed snapshot or restore: 1 MiB of dim-16 weights (a few such buffers are alive).
SNAPSHOT_CHUNK_ROWS = 1 << 14


class TableSnapshots:
    """The state, snapshot and restore methods of SparseTable (over its row store, ``_rows``)."""

    # what SparseTable sets up (ps/table.py)
    dim: int
    optimizer: str
    admit_after: int
    tracked: bool
    _rows: Any
    _disk: DiskTier | None
    _acc_width: int
    _step: int
    _disk_mark: tuple[int, int]
    _disk_taken: tuple[int, int]

    def __len__(self) -> int:  # SparseTable's: the rows it holds
        raise NotImplementedError

    def state(self) -> dict[str, np.ndarray]:
        """All rows, sorted by key (so equal tables give equal states whatever the insertion order);
        with tracking also their counters, the clock and the keys waiting for admission."""
        n = len(self._rows)
        keys = np.empty(n, dtype=np.int64)
        weights = np.empty((n, self.dim), dtype=np.float32)
        accum = np.empty((n, self._acc_width), dtype=np.float32)
        meta = np.empty((n, 2), dtype=np.uint32) if self.tracked else None
        self._rows.export(0, keys, weights, accum, meta)
        if self._disk is not None:
            records = self._disk.disk.read(self._disk.disk.live_positions())
            keys, weights = np.concatenate([keys, records["key"]]), np.concatenate([weights, records["w"]])
            accum, meta = np.concatenate([accum, records["acc"]]), np.concatenate([meta, records["meta"]])
            del records
        order = np.argsort(keys, kind="stable")
        # sorted one array at a time, each unsorted one freed as soon as its copy exists
        out: dict[str, np.ndarray] = {"keys": keys[order]}
        del keys
        out["weights"] = weights[order]
        del weights
        out["accumulators"] = accum[order]
        del accum
        if meta is not None:
            out["counts"], out["last_seen"] = meta[order, 0], meta[order, 1]
            out["step"] = np.array(self._step, dtype=np.int64)
        if self.admit_after > 1:
            m = int(self._rows.info()["candidates"])
            ckeys, cmeta = np.empty(m, dtype=np.int64), np.empty((m, 2), dtype=np.uint32)
            self._rows.export(1, ckeys, None, None, cmeta)
            corder = np.argsort(ckeys, kind="stable")
            out["candidate_keys"] = ckeys[corder]
            out["candidate_counts"], out["candidate_last_seen"] = cmeta[corder, 0], cmeta[corder, 1]
        return out

    def pending_changes(self) -> tuple[int, int] | None:
        """(rows a delta snapshot now would hold at most, rows held): takes the changes as
        :meth:`snapshot_state` does (a later snapshot takes the same ones); None before the first
        snapshot or restore (no delta is possible yet)."""
        if not self._rows.info()["recording"]:
            return None
        rows = self._rows.track_changes(1)[0]
        if self._disk is not None:
            rows += len(self._disk.written_since(self._disk_mark))
        return int(rows), len(self)

    def snapshot_members(self, delta: bool = False, link_to: Path | None = None) -> list[Member]:
        """What :meth:`snapshot_state` holds, as the members of a streamed .npz: a full snapshot's
        fields are read from the row store in chunks while the file is written, so writing one needs
        no copy of the table (rows in the store's row order, not sorted by key); a delta's are
        its changes (bounded by the caller: a delta of most rows is written full). The changes are
        taken now; the table must not change until the members are written. With a disk tier and
        `link_to`, a full snapshot holds the rows in RAM, and the file of the rows on disk is hard-linked
        to `link_to` (ps/disk_tier.py: append-only, so the link is the snapshot's as it is now)."""
        if not self._rows.info()["recording"]:
            if delta:
                raise ValueError("a delta snapshot needs an earlier snapshot or restore to be relative to")
            self._rows.track_changes(0)  # from now on: what the checkpoint below holds is the base
        else:
            self._rows.track_changes(1)
        if self._disk is not None:
            self._disk_taken = self._disk.position()
        if delta:
            state = self.snapshot_state(delta=True)
            return [Member.of(k, v) for k, v in state.items()]
        if self._disk is not None and link_to is not None:
            return self.row_members(with_disk=False) + self._disk.link_members(link_to)
        return self.row_members()

    def row_members(self, with_disk: bool = True) -> list[Member]:
        """The whole :meth:`state` (unsorted) as streamed .npz members, read from the row store in
        chunks as they are written (the rows on disk too, unless not `with_disk`); change tracking is
        left as it is."""
        members = self._store_members(0, "", with_disk)
        if self.tracked:
            members.append(Member.of("step", np.array(self._step, dtype=np.int64)))
        if self.admit_after > 1:
            members += self._store_members(1, "candidate_")
        return members

    def _store_members(self, which: int, prefix: str, with_disk: bool = True) -> list[Member]:
        rows = which == 0
        n = int(self._rows.info()["rows" if rows else "candidates"])
        on_disk = len(self._disk) if self._disk is not None and rows and with_disk else 0
        total = n + on_disk
        fields: list[tuple[str, Any, tuple[int, ...]]] = [("keys", np.int64, (total,))]
        if rows:
            fields += [
                ("weights", np.float32, (total, self.dim)),
                ("accumulators", np.float32, (total, self._acc_width)),
            ]
        if self.tracked or not rows:
            fields += [("counts", np.uint32, (total,)), ("last_seen", np.uint32, (total,))]
        return [
            Member(prefix + name, dtype, shape, self._all_chunks(which, name, n, on_disk))
            for name, dtype, shape in fields
        ]

    def _all_chunks(self, which: int, field: str, n: int, on_disk: int) -> Iterator[np.ndarray]:
        """One field of the RAM tier's `n` rows, then of the `on_disk` rows of the disk tier."""
        yield from self._chunks(which, field, n)
        if on_disk and self._disk is not None:
            for part in self._disk.disk.chunks(SNAPSHOT_CHUNK_ROWS):
                records = self._disk.disk.read(part)
                column = {"keys": "key", "weights": "w", "accumulators": "acc"}.get(field, "meta")
                values = records[column]
                yield values if column != "meta" else values[:, 0 if field == "counts" else 1]

    def _chunks(self, which: int, field: str, n: int) -> Iterator[np.ndarray]:
        """One field of a store's `n` live rows, chunk by chunk, in row order (export_from)."""
        size = min(n, SNAPSHOT_CHUNK_ROWS)
        keys = np.empty(size, dtype=np.int64)
        buffers: dict[str, Any] = {"weights": None, "accumulators": None, "meta": None}
        if field == "weights":
            buffers["weights"] = np.empty((size, self.dim), dtype=np.float32)
        elif field == "accumulators":
            buffers["accumulators"] = np.empty((size, self._acc_width), dtype=np.float32)
        elif field in ("counts", "last_seen"):
            buffers["meta"] = np.empty((size, 2), dtype=np.uint32)
        cursor, done = 0, 0
        while done < n:
            got, cursor = self._rows.export_from(
                which,
                cursor,
                keys[: min(size, n - done)],
                *(None if b is None else b[: min(size, n - done)] for b in buffers.values()),
            )
            if got == 0:
                raise RuntimeError(f"the row store changed while a snapshot was written ({done} of {n} rows)")
            done += got
            if field == "keys":
                yield keys[:got]
            elif field in ("weights", "accumulators"):
                yield buffers[field][:got]
            else:
                yield buffers["meta"][:got, 0 if field == "counts" else 1]

    def snapshot_state(self, delta: bool = False) -> dict[str, np.ndarray]:
        """What a checkpoint writes of this table: :meth:`state`, or with `delta` the changes since
        the last durable snapshot or restore: the rows written (their whole :meth:`state` fields),
        ``removed_keys`` (keys gone and not back), the clock, and the same for the keys waiting for
        admission (``candidate_*``). The changes stay pending until :meth:`snapshot_durable`."""
        if not self._rows.info()["recording"]:
            if delta:
                raise ValueError("a delta snapshot needs an earlier snapshot or restore to be relative to")
            self._rows.track_changes(0)  # from now on: what the checkpoint below holds is the base
            if self._disk is not None:
                self._disk_taken = self._disk.position()
            return self.state()
        rows, removed, cand_rows, cand_removed = self._rows.track_changes(1)
        if self._disk is not None:
            self._disk_taken = self._disk.position()
        if not delta:
            return self.state()
        out = self._changes(0, rows, removed)
        if self._disk is not None:
            self._add_disk_changes(out)
        if self.tracked:
            out["step"] = np.array(self._step, dtype=np.int64)
        if self.admit_after > 1:
            cand = self._changes(1, cand_rows, cand_removed)
            out.update({f"candidate_{k}": v for k, v in cand.items()})
        return out

    def _changes(self, which: int, bound: int, removed: int) -> dict[str, np.ndarray]:
        rows = which == 0
        keys = np.empty(bound, dtype=np.int64)
        weights = np.empty((bound, self.dim), dtype=np.float32) if rows else None
        accum = np.empty((bound, self._acc_width), dtype=np.float32) if rows else None
        meta = np.empty((bound, 2), dtype=np.uint32) if self.tracked or not rows else None
        gone = np.empty(removed, dtype=np.int64)
        n = self._rows.export_changes(which, keys, weights, accum, meta, gone)
        # in row order, not sorted: a sorted copy would double what a big delta holds in memory
        out: dict[str, np.ndarray] = {"keys": keys[:n]}
        if weights is not None and accum is not None:
            out["weights"], out["accumulators"] = weights[:n], accum[:n]
        if meta is not None:
            out["counts"], out["last_seen"] = meta[:n, 0], meta[:n, 1]
        # a key removed and then back is in `keys`; removed twice, it is listed once
        out["removed_keys"] = np.setdiff1d(gone, out["keys"]) if len(gone) else gone
        return out

    def _add_disk_changes(self, out: dict[str, np.ndarray]) -> None:
        """A delta of a table with a disk tier: also the rows written to disk since the last durable
        snapshot, and not as removed the keys that only moved between RAM and disk (a spill is a
        removal to the row store)."""
        assert self._disk is not None
        records = self._disk.disk.read(self._disk.written_since(self._disk_mark))
        out["keys"] = np.concatenate([out["keys"], records["key"]])
        out["weights"] = np.concatenate([out["weights"], records["w"]])
        out["accumulators"] = np.concatenate([out["accumulators"], records["acc"]])
        out["counts"] = np.concatenate([out["counts"], records["meta"][:, 0]])
        out["last_seen"] = np.concatenate([out["last_seen"], records["meta"][:, 1]])
        gone = out["removed_keys"]
        out["removed_keys"] = gone[~self._disk.held(gone)]

    def snapshot_durable(self) -> None:
        """The last :meth:`snapshot_state` is committed: its changes are no longer pending."""
        if self._rows.info()["recording"]:
            self._rows.track_changes(2)
            self._disk_mark = self._disk_taken

    def apply_snapshot_changes(self, npz: NpzReader, prefix: str) -> None:
        """Replay a delta snapshot file's members named `prefix` + field (``snapshot_state(delta=True)``)
        onto this table, which holds the state it was relative to: the removed keys go, then the rows
        are set chunk by chunk; then what the table holds is the base of the next delta."""
        if prefix + "step" in npz.names:
            self._step = int(npz.array(prefix + "step"))
            self._rows.set_clock(self._step)
        counted = self.tracked and prefix + "counts" in npz.names
        fields = ["keys", "weights", "accumulators"] + (["counts", "last_seen"] if counted else [])
        self._load_chunks(0, npz, prefix, fields, removed=npz.array(prefix + "removed_keys"))
        if self.admit_after > 1 and prefix + "candidate_keys" in npz.names:
            names = ["candidate_keys", "candidate_counts", "candidate_last_seen"]
            self._load_chunks(1, npz, prefix, names, removed=npz.array(prefix + "candidate_removed_keys"))
        self._restored()

    def load_snapshot(self, npz: NpzReader, prefix: str) -> None:
        """:meth:`load_state` from a full snapshot file's members named `prefix` + field, read in
        chunks into the row store (a restore holds no copy of the table beside it)."""
        self._step = int(npz.array(prefix + "step")) if prefix + "step" in npz.names else 0
        self._rows.set_clock(self._step)
        acc = npz.shape(prefix + "accumulators")
        if acc[1:] != (self._acc_width,):
            raise ValueError(
                f"state accumulators have shape {acc}; optimizer {self.optimizer!r} keeps {self._acc_width} per row"
            )
        counted = self.tracked and prefix + "counts" in npz.names
        fields = ["keys", "weights", "accumulators"] + (["counts", "last_seen"] if counted else [])
        if prefix + "disk_keys" in npz.names:  # the rows on disk are a linked file beside the snapshot
            self._load_linked(npz, prefix)
            self._load_chunks(0, npz, prefix, fields, removed=np.zeros(0, dtype=np.int64))
        else:
            self._load_chunks(0, npz, prefix, fields)
        if self.admit_after > 1:
            waiting = prefix + "candidate_keys" in npz.names
            names = ["candidate_keys", "candidate_counts", "candidate_last_seen"] if waiting else []
            self._load_chunks(1, npz, prefix, names)
        self._restored()

    def _load_linked(self, npz: NpzReader, prefix: str) -> None:
        """Empty the table, then take a snapshot's linked rows on disk: as this table's disk tier, or
        (without one) read into RAM."""
        empty = np.zeros(0, dtype=np.int64)
        self._rows.load(0, empty, np.zeros((0, self.dim), np.float32), np.zeros((0, self._acc_width), np.float32), None)
        if self._disk is not None:
            self._disk.adopt_linked(npz, prefix)
            return
        dtype = record_dtype(self.dim, self._acc_width)
        for records in read_linked(npz, prefix, dtype, SNAPSHOT_CHUNK_ROWS):
            meta = np.ascontiguousarray(records["meta"]) if self.tracked else None
            self._rows.apply(
                0, np.ascontiguousarray(records["key"]), np.ascontiguousarray(records["w"]),
                np.ascontiguousarray(records["acc"]), meta, empty,
            )  # fmt: skip

    def _restored(self) -> None:
        """A restored state is the base of the next delta (RAM and disk alike)."""
        self._rows.track_changes(0)
        if self._disk is not None:
            self._disk_mark = self._disk_taken = self._disk.position()

    def _load_chunks(
        self, which: int, npz: NpzReader, prefix: str, fields: list[str], removed: np.ndarray | None = None
    ) -> None:
        """Empty store `which` (or, for a delta, drop its `removed` keys), then set the rows of
        `fields` (keys first) chunk by chunk."""
        rows = which == 0
        empty = np.zeros(0, dtype=np.int64)
        if rows and self._disk is not None:
            if removed is None:
                self._disk.disk.clear()
            else:
                self._disk.removed(removed)
        if removed is None:
            self._rows.load(
                which,
                empty,
                np.zeros((0, self.dim), np.float32) if rows else None,
                np.zeros((0, self._acc_width), np.float32) if rows else None,
                None,
            )
        else:
            self._rows.apply(which, empty, None, None, None, np.ascontiguousarray(removed, dtype=np.int64))
        if not fields:
            return
        streams = [npz.chunks(prefix + f, SNAPSHOT_CHUNK_ROWS) for f in fields]
        for parts in zip(*streams, strict=True):
            part = dict(zip([f.removeprefix("candidate_") for f in fields], parts, strict=True))
            n = len(part["keys"])
            meta = None
            if "counts" in part:
                meta = np.ascontiguousarray(
                    np.stack([part["counts"], part["last_seen"]], axis=1), dtype=np.uint32
                )
            self._rows.apply(
                which,
                np.ascontiguousarray(part["keys"], dtype=np.int64),
                np.ascontiguousarray(part["weights"], dtype=np.float32).reshape(n, self.dim)
                if rows
                else None,
                np.ascontiguousarray(part["accumulators"], dtype=np.float32).reshape(n, self._acc_width)
                if rows
                else None,
                meta,
                empty,
            )
            if rows and self._disk is not None:  # the rows set are in RAM now, their records (if any) dead
                self._disk.removed(np.ascontiguousarray(part["keys"], dtype=np.int64))
                self._disk.make_room(0, keep_now=False)

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace the contents with a :meth:`state` (keys must be distinct). Counters missing from
        it (a state of an untracked table) start at one pull, seen at the state's step."""
        keys = np.ascontiguousarray(state["keys"], dtype=np.int64)
        weights = np.ascontiguousarray(state["weights"], dtype=np.float32).reshape(len(keys), self.dim)
        accum = np.ascontiguousarray(state["accumulators"], dtype=np.float32)
        if accum.size != len(keys) * self._acc_width:
            raise ValueError(
                f"state accumulators have {accum.size} values for {len(keys)} rows; optimizer "
                f"{self.optimizer!r} keeps {self._acc_width} per row"
            )
        self._step = int(state["step"]) if "step" in state else 0
        self._rows.set_clock(self._step)
        meta = None
        if self.tracked and "counts" in state:
            meta = np.ascontiguousarray(
                np.stack([state["counts"], state["last_seen"]], axis=1), dtype=np.uint32
            )
        if self._disk is not None:
            self._disk.disk.clear()
        self._rows.load(0, keys, weights, accum.reshape(len(keys), self._acc_width), meta)
        if self._disk is not None:
            self._disk.make_room(0, keep_now=False)
        if self.admit_after > 1:
            ckeys = np.ascontiguousarray(state.get("candidate_keys", np.zeros(0)), dtype=np.int64)
            cmeta = np.zeros((len(ckeys), 2), dtype=np.uint32)
            if len(ckeys):
                cmeta = np.ascontiguousarray(
                    np.stack([state["candidate_counts"], state["candidate_last_seen"]], axis=1),
                    dtype=np.uint32,
                )
            self._rows.load(1, ckeys, None, None, cmeta)
        self._restored()
