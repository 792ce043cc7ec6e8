"""Where the profiler's actors run: how many per type (:func:`actor_counts`), the processes they are
(:class:`Hosts`: its own :class:`OwnHosts`, or the runtime's warm actors, closedloop/probes.py), their
start (:func:`start_profiling`: placed and described, or a clear error) and every wait on them after
(:class:`Waiter`: a deadline, a user error raised in an actor coming out as itself).

Example::

    counts = actor_counts(present, ray.nodes(), "cpu_small")
    shard_room(cluster.type("cpu_small"), ray.nodes(), counts)  # None, or why no PS shard fits beside
    group = hosts.start(rtype, counts[rtype.name])
    described = start_profiling(group, rtype, model, seed, timeout_s=120)
    rows = Waiter(900)(group[0].time_layers.remote(items, 2, 0), "cpu_small layers")
    hosts.release(rtype, group, reuse=True)
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import ray

from heterps_ray.config import ResourceType
from heterps_ray.devices import unwrap
from heterps_ray.errors import ConfigError, HeterPSError, WaitTimeout
from heterps_ray.profiling_host import ProfilingHost


class Hosts(Protocol):
    """Where a profile's actors come from and where they go after it."""

    def start(self, rtype: ResourceType, count: int) -> list[Any]:
        """`count` actors pinned to `rtype` (each a :class:`ProfilingHost`, not yet started)."""
        ...

    def release(self, rtype: ResourceType, actors: list[Any], reuse: bool) -> None:
        """The profile is done with `actors`; `reuse`: no call of it is in flight (else kill them)."""
        ...


class OwnHosts:
    """Profiling actors of the profile's own, killed after it: a profile without the runtime."""

    def start(self, rtype: ResourceType, count: int) -> list[Any]:
        actor = ray.remote(ProfilingHost).options(**rtype.actor_options())
        return [actor.remote() for _ in range(count)]

    def release(self, rtype: ResourceType, actors: list[Any], reuse: bool) -> None:
        for handle in actors:
            ray.kill(handle)


class ProfileTimeout(WaitTimeout):
    """A profiling actor did not answer a call in time (ProfileSettings.call_timeout_s)."""


def actor_counts(
    present: list[ResourceType], nodes: list[dict[str, Any]], ps_type: str | None = None
) -> dict[str, int]:
    """Profiling actors per type: two where the alive nodes hold them, else one (the GPUs of the
    cluster decide for GPU types: one actor each first, then the seconds; a unit of `ps_type`, and one
    of its max_instances, is kept for the PS shard the profile starts). A type whose first actor fits
    nowhere (a GPU type in a cluster without GPUs for it) is a ConfigError now, not a wait."""
    free = [dict(n.get("Resources", {})) for n in nodes if n.get("Alive", True)]

    def place(rtype: ResourceType, gpus: float | None = None) -> bool:
        gpus = rtype.num_gpus if gpus is None else gpus
        for res in free:
            if res.get(rtype.name, 0) >= 1 and res.get("GPU", 0) + 1e-9 >= gpus:
                res[rtype.name] -= 1
                res["GPU"] = res.get("GPU", 0) - gpus
                return True
        return False

    counts = {}
    for rtype in present:
        if not place(rtype):
            gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in nodes if n.get("Alive", True))
            raise ConfigError(
                None,
                f"cluster.resource_types.{rtype.name}.num_gpus",
                f"GPUs in the Ray cluster for one {rtype.name!r} actor (it asks for {rtype.num_gpus:g}; the "
                f"cluster's nodes with {rtype.name!r} have not that many free, {gpus:g} GPUs in all): "
                "start the cluster with its GPUs, or profile without this type",
            )
        counts[rtype.name] = 1
    for rtype in present:
        if rtype.name == ps_type:
            place(rtype, gpus=0.0)  # the PS shard's unit (it asks for no GPU), and one of its max_instances
    for rtype in present:
        if rtype.max_instances >= 2 + (rtype.name == ps_type) and place(rtype):
            counts[rtype.name] = 2
    return counts


def shard_room(rtype: ResourceType, nodes: list[dict[str, Any]], counts: dict[str, int]) -> str | None:
    """Why the profile's PS shard cannot be placed beside the profiling actors (`counts` per type) on the
    PS type `rtype`, else None: an actor beyond the type's max_instances, or beyond the units of it
    that the cluster's alive nodes declare, would wait for placement forever."""
    held = counts.get(rtype.name, 0)
    if held + 1 > rtype.max_instances:
        return (
            f"its max_instances ({rtype.max_instances}) are all taken by the profiling actors: a PS shard "
            f"needs one more {rtype.name!r} actor"
        )
    units = sum(n.get("Resources", {}).get(rtype.name, 0.0) for n in nodes if n.get("Alive", True))
    if units < held + 1:
        return (
            f"the Ray cluster declares {units:g} unit(s) of {rtype.name!r}, all taken by the profiling "
            "actors: a PS shard needs one more"
        )
    return None


def start_profiling(
    group: list[Any], rtype: ResourceType, model: dict[str, Any], seed: int, timeout_s: float
) -> list[dict[str, Any]]:
    """Build the model's layers in each actor of `group` (ProfilingHost.start_profiling) and return
    their descriptions: a DeviceError raised in one comes out as itself, and actors not placed in
    `timeout_s` are a ConfigError naming the type and what the cluster has."""
    return start_all([(rtype, group)], model, seed, timeout_s)[rtype.name]


def start_all(
    groups: list[tuple[ResourceType, list[Any]]], model: dict[str, Any], seed: int, timeout_s: float
) -> dict[str, list[dict[str, Any]]]:
    """:func:`start_profiling` for every type's group at once (their layers built side by side, one
    deadline for all); the descriptions by type name."""
    calls = {
        rtype.name: [a.start_profiling.remote(model, seed, rtype.torch_threads, rtype.device, rtype.name)
                     for a in group]
        for rtype, group in groups
    }  # fmt: skip
    deadline = time.monotonic() + timeout_s
    out: dict[str, list[dict[str, Any]]] = {}
    for rtype, group in groups:
        try:
            out[rtype.name] = list(ray.get(calls[rtype.name], timeout=max(deadline - time.monotonic(), 0.0)))
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                None,
                "cluster.resource_types",
                f"{len(group)} profiling actor(s) of {rtype.name!r} placed within {timeout_s:.0f} s (each "
                f"asks for {rtype.actor_options()['num_cpus']:g} CPU, {rtype.num_gpus:g} GPU and 1 "
                f"{rtype.name!r}; the cluster has {ray.available_resources()} free)",
            ) from None
        except ray.exceptions.RayError as exc:
            raise _user_error(exc) from None
    return out


class Waiter:
    """``ray.get`` on the profiling actors' calls with a deadline: a call not answered in time is a
    ProfileTimeout naming it; a user error raised in an actor comes out as itself."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def __call__(self, refs: Any, what: str) -> Any:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ProfileTimeout(
                f"profiling: {what} did not answer within {self.timeout_s:.0f} s (an actor stuck or its "
                "node gone); ProfileSettings.call_timeout_s sets the limit"
            ) from None
        except ray.exceptions.RayError as exc:
            raise _user_error(exc) from None


def _user_error(exc: BaseException) -> BaseException:
    """The user error an actor raised (a DeviceError also from a failed constructor), else `exc`."""
    found = unwrap(exc)
    if found is not exc:
        return found
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, HeterPSError) else exc
