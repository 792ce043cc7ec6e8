"""Fault points for chaos testing: an actor armed at a phase dies inside its next call in that phase
(tests/test_faults.py, benchmarks/bench_chaos.py). Below every part, so PS shards and workers alike
carry one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

FAULT_POINTS = ("train", "checkpoint", "evaluate", "save")  # the phases an armed actor can die in


class FaultPoints:
    """Named places in an actor's calls where chaos tests make it die *inside* the call: the phase
    (FAULT_POINTS) it is in when it next gets there. Armed by ``actor.arm_fault(point, how, flag)``:
    how "sigkill" kills the actor's own process there; how "wait" writes the file `flag` and blocks
    (up to a minute) so that the caller can kill it from outside (``ray.kill``) mid-call. An actor
    fires once; its replacement starts unarmed."""

    def __init__(self) -> None:
        self._armed: dict[str, tuple[str, str]] = {}

    def arm(self, point: str, how: str = "sigkill", flag: str = "") -> None:
        if point not in FAULT_POINTS or how not in ("sigkill", "wait"):
            raise ValueError(
                f"fault point {point!r} / how {how!r}: expected one of {FAULT_POINTS} / sigkill|wait"
            )
        self._armed[point] = (how, flag)

    def reached(self, point: str) -> None:
        armed = self._armed.pop(point, None)
        if armed is None:
            return
        how, flag = armed
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        Path(flag).write_text(str(os.getpid()))
        time.sleep(60.0)  # killed from outside meanwhile
