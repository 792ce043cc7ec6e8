"""CPU the machine spends, read with psutil: all of it, this driver's own Ray, and what is left over
(other work beside a probe, a host's background load)."""

from __future__ import annotations

import math
import time


class OtherWork:
    """CPU the driver's machine spent outside this Ray cluster's processes (the driver, and the raylet
    and workers it started) while the block ran: `cpu_ms`, and `cores` over its wall time. NaN where
    the cluster is not this driver's own (``--address``): its processes are not this one's children."""

    def __enter__(self) -> OtherWork:
        self.cpu_ms = self.cores = math.nan
        self._own = own_cpu_s()
        self._busy, self._t0 = busy_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, wall = busy_cpu_s() - self._busy, time.perf_counter() - self._t0
        own = own_cpu_s()
        if self._own is None or own is None or wall <= 0:
            return
        # per process: one that exited meanwhile takes its CPU with it, not counted as anyone's
        spent = sum(cpu - self._own.get(pid, 0.0) for pid, cpu in own.items())
        self.cpu_ms = max(busy - spent, 0.0) * 1000.0
        self.cores = self.cpu_ms / 1000.0 / wall


def own_cpu_s() -> dict[int, float] | None:
    """CPU s of this process and of each of its descendants; None without a raylet among them."""
    import psutil

    me = psutil.Process()
    out, raylet = {}, False
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            out[proc.pid] = t.user + t.system
            raylet = raylet or proc.name() == "raylet"
        except psutil.Error:  # exited meanwhile
            continue
    return out if raylet else None


def busy_cpu_s() -> float:
    """CPU s the whole machine has spent busy (every core, since boot)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
