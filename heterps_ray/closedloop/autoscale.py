"""Nodes from the autoscaler: `heterps run` on a cluster whose worker groups (one per resource type, as
`heterps cluster render` writes them) start empty asks Ray's autoscaler for what it needs, waits for
it, and gives it back.

One :class:`NodeRequest` per phase: the profile asks for one actor's bundle of each type, a plan for
one bundle per actor it starts (each actor's ``actor_options()``: its CPUs, GPUs and its type's custom
resource; PS shards hosted in DataWorker 0 need none). ``ray.autoscaler.sdk.request_resources`` keeps
that much capacity up until the request is replaced or cleared; the request is cleared on every way
out of the ``with`` block (done, an error, Ctrl-C), after which the autoscaler releases the nodes once
they are idle for its ``idle_timeout``. A type whose nodes do not join within
``cluster.autoscale.node_timeout_s`` is reported missing: the caller plans without it (the elastic
path, closedloop/replan.py). While waiting is time every node already up is paid for idle, each wait
is recorded (seconds, node-hours and $ at each type's price) for the report.

Why capacity per type and not nodes per type: the request is for bundles, and the autoscaler decides
how many nodes of which shape hold them; a type counts as arrived once the cluster declares as many
units of its custom resource as the bundles ask for, whatever the nodes' shape. Example::

    with NodeRequest(job.cluster, plan_bundles(job, plan), "plan") as nodes:
        missing = nodes.wait()          # [] or the types that did not arrive in time
        ...train...
    nodes.record                        # {"purpose": "plan", "seconds": 7.1, "cost": 0.0002, ...}
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from heterps_ray.config import ClusterConfig, JobConfig
from heterps_ray.costmodel import Plan
from heterps_ray.costmodel.table_memory import TableEstimate
from heterps_ray.runtime.actors import actor_bundle, hosts_shards
from heterps_ray.runtime.elastic import ResourcesChanged, present_types
from heterps_ray.runtime.loop import FloorMissed

if TYPE_CHECKING:
    from heterps_ray.closedloop.replan import Decisions, Replanner

POLL_S = 1.0  # s between two looks at the cluster's nodes (one GCS call each)
PROGRESS_EVERY_S = 15.0  # s between two "still waiting" lines


def plan_bundles(job: JobConfig, plan: Plan, estimate: TableEstimate | None) -> list[dict[str, float]]:
    """One bundle per actor `plan` starts for `job`: a DataWorker per stage-0 replica, a StageWorker per
    replica of the other stages, a PS shard actor per shard unless the shards are hosted in DataWorker 0
    (runtime/actors.py hosts_shards, with the run's table `estimate`)."""
    types = [s.type for s in plan.stages for _ in range(s.replicas)]
    shards = job.runtime.ps_shards or int(plan.ps_shards)
    if not hosts_shards(job, plan.stages, shards, estimate):
        types += [job.cluster.ps_resource] * shards
    return [actor_bundle(job.cluster, t) for t in types]


def profile_bundles(cluster: ClusterConfig) -> list[dict[str, float]]:
    """One actor's bundle of each type: what the profile measures on (closedloop/probes.py: one
    profiling actor of a type at a time; its runtime probes host the PS in their DataWorker)."""
    return [actor_bundle(cluster, t.name) for t in cluster.resource_types]


@dataclass
class NodeWait:
    """One request's wait: what was asked, when each type's capacity was there, what it cost."""

    purpose: str  # "profile", "plan", or "plan again" (after a node was lost)
    requested: dict[str, float]  # type -> units of its custom resource the bundles ask for
    bundles: int
    arrived_s: dict[str, float] = field(default_factory=dict)  # type -> s from the request to its units
    missing: list[str] = field(default_factory=list)  # types not there within the timeout
    joined: list[dict[str, Any]] = field(default_factory=list)  # nodes that joined: id, types, after s
    seconds: float = 0.0  # s from the request until every type arrived (or the timeout)
    node_hours: dict[str, float] = field(default_factory=dict)  # type -> unit-hours up while waiting
    cost: float = 0.0  # $: node_hours at each type's price_per_hour (the nodes sat idle)

    def to_dict(self) -> dict[str, Any]:
        return {
            "purpose": self.purpose,
            "requested": self.requested,
            "bundles": self.bundles,
            "arrived_s": {k: round(v, 2) for k, v in self.arrived_s.items()},
            "missing": self.missing,
            "joined": self.joined,
            "seconds": round(self.seconds, 2),
            "node_hours": {k: round(v, 6) for k, v in self.node_hours.items()},
            "cost": round(self.cost, 6),
        }


class NodeRequest:
    """``with NodeRequest(cluster, bundles, purpose) as nodes: nodes.wait()``: ask the autoscaler for
    `bundles`, wait for them with progress lines, and clear the request on the way out."""

    def __init__(
        self,
        cluster: ClusterConfig,
        bundles: list[dict[str, float]],
        purpose: str,
        *,
        timeout_s: float | None = None,
        progress: bool = True,
        poll_s: float = POLL_S,
    ):
        self.cluster, self.bundles, self.poll_s, self.progress = cluster, bundles, poll_s, progress
        self.timeout_s = cluster.autoscale.node_timeout_s if timeout_s is None else timeout_s
        wanted: dict[str, float] = {}
        for bundle in bundles:
            for t in cluster.resource_types:
                if bundle.get(t.name):
                    wanted[t.name] = wanted.get(t.name, 0.0) + bundle[t.name]
        self.record = NodeWait(purpose, wanted, len(bundles))
        self._t0 = 0.0

    def __enter__(self) -> NodeRequest:
        return self.request()

    def __exit__(self, *exc: object) -> None:
        release()

    def request(self) -> NodeRequest:
        """Ask the autoscaler for the bundles (replacing any request made before); not cleared here."""
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=self.bundles)
        self._t0 = time.monotonic()
        asked = ", ".join(f"{units:g} {name}" for name, units in self.record.requested.items())
        self._say(
            f"nodes: asked the autoscaler for {self.record.bundles} actor bundle(s) ({asked}) for the "
            f"{self.record.purpose}; waiting up to {self.timeout_s:.0f} s"
        )
        return self

    def wait(self) -> list[str]:
        """Wait until the cluster declares the units of every requested type, or the timeout; returns
        the types still short (also in ``record.missing``)."""
        rec, prices = self.record, {t.name: t.price_per_hour for t in self.cluster.resource_types}
        seen: dict[str, float] = {}  # node id -> s after the request it was first seen (0: up before)
        last_say, last, first = 0.0, 0.0, True
        while True:
            now = time.monotonic() - self._t0
            nodes = _typed_nodes(self.cluster)
            for node_id, units in nodes.items():
                if node_id not in seen:
                    seen[node_id] = 0.0 if first else now
                    if not first:
                        rec.joined.append({"node": node_id, "types": units, "after_s": round(now, 2)})
                        self._say(f"nodes: + {_describe(units)} node {node_id[-8:]} joined after {now:.1f} s")
            # node-hours since the last look, each node up counted at its types' prices (idle: waiting)
            for node_id, units in nodes.items():
                for name, amount in units.items():
                    hours = amount * (now - max(last, seen[node_id])) / 3600.0
                    rec.node_hours[name] = rec.node_hours.get(name, 0.0) + hours
            have = {name: 0.0 for name in rec.requested}
            for units in nodes.values():
                for name, amount in units.items():
                    have[name] = have.get(name, 0.0) + amount
            for name, asked in rec.requested.items():
                if name not in rec.arrived_s and have.get(name, 0.0) >= asked:
                    rec.arrived_s[name] = now
            short = [name for name in rec.requested if name not in rec.arrived_s]
            last, first = now, False
            if not short or now >= self.timeout_s:
                break
            if now - last_say >= PROGRESS_EVERY_S:
                last_say = now
                waiting = ", ".join(
                    f"{name} ({have.get(name, 0):g}/{rec.requested[name]:g})" for name in short
                )
                self._say(f"nodes: waiting for {waiting}, {now:.0f} s of {self.timeout_s:.0f} s")
            time.sleep(self.poll_s)
        rec.seconds, rec.missing = last, short
        rec.cost = sum(hours * prices[name] for name, hours in rec.node_hours.items())
        if short:
            self._say(
                f"nodes: {short} did not arrive within {self.timeout_s:.0f} s "
                f"(have {', '.join(f'{have.get(n, 0):g}/{rec.requested[n]:g} {n}' for n in short)})"
            )
        else:
            self._say(
                f"nodes: all requested nodes up after {rec.seconds:.1f} s "
                f"({len(rec.joined)} joined; idle while waiting: {rec.cost:.6f} $)"
            )
        return short

    def _say(self, line: str) -> None:
        if self.progress:
            print(line, flush=True)


def release() -> None:
    """Clear this cluster's resource request: the autoscaler may release idle nodes again."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[])


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (`ray job stop`, a pod's eviction) raises KeyboardInterrupt inside the block, as Ctrl-C
    does, so the request is cleared on the way out; Python's default would exit without unwinding."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _typed_nodes(cluster: ClusterConfig) -> dict[str, dict[str, float]]:
    """Live node id -> the units of the cluster's resource types it declares (nodes without any left out)."""
    import ray

    names = {t.name for t in cluster.resource_types}
    out = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        units = {k: float(v) for k, v in node.get("Resources", {}).items() if k in names}
        if units:
            out[node["NodeID"]] = units
    return out


def _describe(units: dict[str, float]) -> str:
    return "+".join(name if amount == 1 else f"{amount:g} {name}" for name, amount in units.items())


@contextlib.contextmanager
def profile_nodes(
    job: JobConfig, waits: list[NodeWait], progress: bool = True, wanted: bool = True
) -> Iterator[None]:
    """``with profile_nodes(job, waits): profile...``: on an autoscaling cluster, one node of each type
    for the profile (the profile measures the types that came), released after it; nothing when not
    `wanted` (a problem file instead of a profile) or on any other cluster."""
    if not (wanted and job.cluster.autoscale.enabled):
        yield
        return
    bundles = profile_bundles(job.cluster)
    with _sigterm_as_interrupt(), NodeRequest(job.cluster, bundles, "profile", progress=progress) as nodes:
        nodes.wait()
        waits.append(nodes.record)
        yield


class PlanNodes:
    """The nodes of the plan being trained, on an autoscaling cluster (a no-op on any other): before
    each plan trains, its bundles are requested (replacing the request of the plan before) and awaited;
    a type that does not come in time is re-planned around, as a type that left would be. A node lost
    mid-run is asked for again (the request stands while training) before the run re-plans without
    it. The request is cleared when the ``with`` block ends, however it ends."""

    def __init__(
        self, job: JobConfig, estimate: TableEstimate | None, waits: list[NodeWait], progress: bool = True
    ):
        self.job, self.estimate, self.waits, self.progress = job, estimate, waits, progress
        self.enabled = job.cluster.autoscale.enabled

    def __enter__(self) -> PlanNodes:
        self._stack = contextlib.ExitStack()
        if self.enabled:
            self._stack.enter_context(_sigterm_as_interrupt())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.enabled:
                release()
        finally:
            self._stack.close()

    def get(self, decisions: Decisions, replanner: Replanner, resume: Path | None) -> Path | None:
        """Request and await the nodes of ``decisions.plan``; while a type does not arrive, re-plan on
        the types present (ResourcesChanged through `replanner`: InfeasibleError, exit 3, when no plan
        is left). Returns the checkpoint to resume from (`resume`, or the re-plan's)."""
        while self.enabled:
            plan_types = sorted({s.type for s in decisions.plan.stages} | {decisions.plan.ps_type})
            missing = self._wait(decisions.plan, "plan")
            if not missing:
                break
            timeout = self.job.cluster.autoscale.node_timeout_s
            reason = f"resource type(s) {missing} of the plan did not arrive within {timeout:.0f} s"
            now = present_types(self.job.cluster)
            resume = replanner.after(ResourcesChanged(reason, plan_types, now, 0, resume))
        return resume

    def after(
        self, stop: FloorMissed | ResourcesChanged, plan: Plan
    ) -> FloorMissed | ResourcesChanged | None:
        """What to re-plan on after `stop`: a plan type that left is requested again first; None when
        its nodes came back (resume `plan` from the stop's checkpoint), else the stop, with the types
        present after the wait."""
        if not self.enabled or not isinstance(stop, ResourcesChanged) or "disappeared" not in stop.reason:
            return stop
        if not self._wait(plan, "plan again"):
            return None
        return ResourcesChanged(
            stop.reason, stop.before, present_types(self.job.cluster), stop.step, stop.checkpoint
        )

    def _wait(self, plan: Plan, purpose: str) -> list[str]:
        nodes = NodeRequest(
            self.job.cluster, plan_bundles(self.job, plan, self.estimate), purpose, progress=self.progress
        )
        missing = nodes.request().wait()
        self.waits.append(nodes.record)
        return missing
