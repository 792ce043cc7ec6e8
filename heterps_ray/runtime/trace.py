"""Hashes of the tensors on the training path, to find where two runs that should be equal part.

Sync training promises the same model from the same job (with faults, shard counts or hostings
between). Where two runs differ, their losses say only that they did. With ``HETERPS_TRACE_DIR`` set
to a folder, every process of a run appends one JSON line per event to ``<folder>/<pid>.jsonl``: a
stage's forward (its inputs and weights), the gradients that arrive for its backward, its weight
gradients before a step, the rows pulled and the gradients pushed, the last stage's logits and loss,
and the driver's losses at the end. Each tensor is written as its SHA-1 prefix, shape, dtype and
address modulo 64 (a numeric library may take another code path for another alignment).
``scripts/diff_traces.py A B`` then names the first event whose tensors differ. The actors get the
folder in their runtime env (``devices.actor_env``). The callers check :func:`on` first, so an untraced
run builds nothing.

Trace one run per folder: the processes of a run are told apart by their role ("stage 1"), not by run.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from heterps_ray.devices import TRACE_DIR_VAR

_lock = threading.Lock()
_count = 0
_files: dict[Path, TextIO] = {}  # this process's trace file, opened once (flushed per line: a killed run keeps it)


def digest(value: Any) -> list[Any]:
    """[SHA-1 prefix of the bytes, shape, dtype, address mod 64] of a tensor or array (any dtype:
    a bf16 tensor, which numpy has no type for, is hashed as its raw bytes)."""
    if isinstance(value, torch.Tensor):
        address = value.data_ptr()
        tensor = value.detach().cpu().contiguous()
        shape, dtype = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    else:
        array = np.asarray(value)
        address = array.ctypes.data
        shape, dtype = list(array.shape), str(array.dtype)
        data = np.ascontiguousarray(array).tobytes()
    return [hashlib.sha1(data).hexdigest()[:16], shape, dtype, address % 64]


def on() -> bool:
    """Whether this process traces (HETERPS_TRACE_DIR set)."""
    return bool(os.environ.get(TRACE_DIR_VAR))


def event(name: str, where: str, *tensors: Sequence[Any] | Mapping[str, Any]) -> None:
    """Append one line: event `name` of the process role `where` ("stage 1", "data worker 0"), with a
    digest of each tensor of `tensors` (sequences are named by position, mappings by key; None
    entries skipped). Only where :func:`on`."""
    global _count
    record: dict[str, Any] = {"event": name, "where": where}
    for group, named in enumerate(tensors):
        items = named.items() if isinstance(named, Mapping) else enumerate(named)
        record.update({f"{group}.{key}": digest(t) for key, t in items if t is not None})
    path = Path(os.environ[TRACE_DIR_VAR]) / f"{os.getpid()}.jsonl"
    with _lock:
        record["n"] = _count
        _count += 1
        out = _files.get(path) or _files.setdefault(path, open(path, "a"))  # noqa: SIM115 (kept open)
        out.write(json.dumps(record) + "\n")
        out.flush()
