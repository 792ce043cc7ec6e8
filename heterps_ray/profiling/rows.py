"""One measurement of a profile: a row of the long-format table that profiler.py and probes.py take
and :func:`heterps_ray.profiling.fit.fit_problem` fits (its columns: fit.COLUMNS, then GPU_COLUMNS)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Row:
    kind: str
    resource: str
    peer: str = ""
    layer: str = ""
    batch_size: int = 0
    nbytes: int = 0
    rows: int = 0
    replicas: int = 1
    calls: int = 1
    repeat: int = 0
    forward_ms: float = math.nan
    backward_ms: float = math.nan
    ms: float = math.nan
    client_ms: float = math.nan
    copy_ms: float = math.nan
    peak_mb: float = math.nan


# Beside the fit's COLUMNS in the raw measurements: of a layer's ms, the host<->device copies; its
# peak GPU memory (NaN on the CPU). A row of kind "oom": that (layer, batch size) ran out of GPU memory.
GPU_COLUMNS = ("copy_ms", "peak_mb")
