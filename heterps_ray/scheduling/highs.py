"""HiGHS (scipy.optimize.milp) for the scheduling ILPs, with nothing on the caller's stdout.

HiGHS writes some lines with C printf whatever its options say (e.g. "HighsMipSolverData::
transformNewIntegerFeasibleSolution tmpSolver.run();", ERGO-Code/HiGHS#2783), which would land in the
middle of `heterps plan`'s output. `solve_milp` points file descriptor 1 at /dev/null around the call
(flushing C's stdio buffers before it points back) and silences scipy's warning about HiGHS options it
does not list (it passes them on)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

_LIBC = ctypes.CDLL(None)


@contextlib.contextmanager
def c_stdout_silenced() -> Iterator[None]:
    """Everything written to file descriptor 1 inside the block (C printf included) is dropped."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        _LIBC.fflush(None)  # what C buffered inside the block goes to /dev/null, not after it
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def solve_milp(**kwargs: Any) -> Any:
    """scipy.optimize.milp(**kwargs), quiet (module docstring); its OptimizeResult."""
    from scipy.optimize import milp

    with c_stdout_silenced(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return milp(**kwargs)
