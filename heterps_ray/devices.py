"""Which torch device an actor of a resource type computes on, and the error when its type's promise fails.

A ``cuda`` type runs on a GPU or fails loudly: :func:`claim_device` never falls back to the CPU on its
own. It raises :class:`DeviceError` naming the type, the node and what the actor saw (CUDA available,
device count, ``CUDA_VISIBLE_DEVICES``, the torch build's CUDA version); the CLI exits 2 with it.

The one way to run a ``cuda`` type on the CPU is the explicit test flag ``HETERPS_CUDA_AS_CPU=1`` (tests,
``scripts/gpu_check.py --cpu-half``): it is logged wherever it applies, travels to the actors in their
runtime env (:func:`actor_env`), and makes the embedded local Ray declare the GPUs the cluster's cuda
types ask for (:func:`declared_gpus`), so they are scheduled as on a GPU machine.

Example::

    device = claim_device("gpu_t4", "cuda")   # torch.device("cuda") or DeviceError
    set_precision(device, "fp32")             # TF32 off: a sync run equals the CPU reference
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
from typing import TYPE_CHECKING, Any

from heterps_ray.errors import HeterPSError

if TYPE_CHECKING:
    import torch

    from heterps_ray.config import ClusterConfig

CUDA_AS_CPU_VAR = "HETERPS_CUDA_AS_CPU"
TRACE_DIR_VAR = "HETERPS_TRACE_DIR"  # a traced run's folder (runtime/trace.py): the actors write there too
PRECISIONS = ("fp32", "tf32", "bf16")

log = logging.getLogger(__name__)


class DeviceError(HeterPSError):
    """An actor of a ``cuda`` type found no usable GPU where its type promises one (exit 2)."""

    category = "device"

    def __init__(self, type_name: str, node: str, saw: str):
        self.type_name, self.node, self.saw = type_name, node, saw
        super().__init__(
            f"resource type {type_name!r} (device: cuda) found no GPU on node {node}: saw {saw}. "
            "Install a CUDA build of torch on that node, check that Ray gives the actor a GPU "
            "(the type's num_gpus), or declare the type with device: cpu"
        )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        # raised inside actors and pickled back to the driver: keep every argument
        return type(self), (self.type_name, self.node, self.saw)


def cuda_as_cpu() -> bool:
    """True when the explicit test flag maps ``cuda`` types to the CPU."""
    return os.environ.get(CUDA_AS_CPU_VAR) == "1"


def claim_device(type_name: str, device: str, node: str | None = None) -> torch.device:
    """The torch device of an actor of resource type `type_name` whose configured device is `device`:
    the CPU for ``cpu``; for ``cuda`` the GPU, or the CPU under the test flag (logged), else
    :class:`DeviceError`. `node` names where the actor runs (default: this Ray node)."""
    import torch

    if device != "cuda":
        return torch.device("cpu")
    if cuda_as_cpu():
        log.warning("%s=1: resource type %r (cuda) computes on the CPU", CUDA_AS_CPU_VAR, type_name)
        return torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda")
    raise DeviceError(type_name, node or this_node(), cuda_seen())


def cuda_seen() -> str:
    """What this process sees of CUDA, for an error message or a report."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"torch.cuda.is_available()={torch.cuda.is_available()}, device_count={count}, "
        f"CUDA_VISIBLE_DEVICES={visible!r}, torch {torch.__version__} built with CUDA {torch.version.cuda}"
    )


def this_node() -> str:
    """This process's Ray node as 'id (ip)', or the host name outside Ray."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
            return f"{node_id[:12]} ({ray.util.get_node_ip_address()})"
    return os.uname().nodename


def actor_env() -> dict[str, str]:
    """Environment an actor must get from the driver: the test flag and the trace folder, where the
    driver has them set."""
    env = {CUDA_AS_CPU_VAR: "1"} if cuda_as_cpu() else {}
    if os.environ.get(TRACE_DIR_VAR):
        env[TRACE_DIR_VAR] = os.environ[TRACE_DIR_VAR]
    return env


def declared_gpus(cluster: ClusterConfig) -> float | None:
    """GPUs the embedded local Ray declares: under the test flag, what the cluster's cuda types ask for
    at most (so they are scheduled on a GPU-less machine); else None (Ray counts the real ones)."""
    if not cuda_as_cpu():
        return None
    want = sum(t.num_gpus * t.max_instances for t in cluster.resource_types if t.device == "cuda")
    return float(math.ceil(want)) if want else None


def cluster_gpus() -> float:
    """GPUs the Ray cluster has in all (``ray.cluster_resources()``)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def gpu_shortfall(demand: dict[str, int], cluster: ClusterConfig, have: float) -> str | None:
    """What is wrong when `demand` (actors per type) asks for more GPUs than the cluster's `have`, else
    None: the types, what they ask and what there is."""
    asks = {
        name: count * cluster.type(name).num_gpus
        for name, count in demand.items()
        if count and cluster.type(name).num_gpus > 0
    }
    need = sum(asks.values())
    if need <= have + 1e-9:
        return None
    parts = ", ".join(f"{name}: {gpus:g}" for name, gpus in asks.items())
    return f"the plan's actors ask for {need:g} GPUs ({parts}) and the Ray cluster has {have:g}"


def set_precision(device: torch.device, precision: str) -> None:
    """On a GPU, the matmul precision of `precision` (``fp32``: TF32 off everywhere, highest precision,
    so a sync stage computes what the CPU reference does; ``tf32``/``bf16``: TF32 on, for speed)."""
    import torch

    if device.type != "cuda":
        return
    exact = precision == "fp32"
    torch.backends.cuda.matmul.allow_tf32 = not exact
    torch.backends.cudnn.allow_tf32 = not exact
    torch.set_float32_matmul_precision("highest" if exact else "high")


def autocast(device: torch.device, precision: str) -> Any:
    """The forward's autocast context: bf16 on a GPU under ``bf16``, else nothing."""
    import torch

    if device.type == "cuda" and precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# How a DeviceError reads inside the text of the ActorDiedError that Ray raises at the first call of an
# actor whose constructor raised it (Ray keeps the creation error's traceback text only, not the error).
_IN_TEXT = re.compile(
    r"DeviceError: resource type '(?P<type>[^']+)' \(device: cuda\) found no GPU on node "
    r"(?P<node>.+?): saw (?P<saw>.+?)\. Install a CUDA build"
)


def unwrap(exc: BaseException) -> BaseException:
    """The DeviceError behind a Ray error: the cause of a RayTaskError (a method raised it), or the one
    an ActorDiedError's text reports (the actor's constructor raised it); else `exc` itself."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        cause = getattr(current, "cause", None)
        if isinstance(cause, BaseException):  # a RayTaskError: also an instance of its cause's type
            current = cause
            continue
        if isinstance(current, DeviceError):
            return current
        if type(current).__name__ == "ActorDiedError":
            found = _IN_TEXT.search(str(current))
            if found:
                return DeviceError(found["type"], found["node"], found["saw"])
        current = current.__cause__
    return exc
