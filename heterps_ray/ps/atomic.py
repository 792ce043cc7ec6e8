"""Crash-safe files: write to a temporary file in the same directory, fsync, then ``os.replace``,
so a reader never sees a half-written file under the final name; and checked .npz reading.

Example::

    write_npz_atomic(path, {"keys": keys, "weights": weights})
    arrays = read_npz(path)          # DataError naming `path` if it is truncated or corrupted
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from heterps_ray.errors import DataError


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through a synced temporary file; an old `path` stays intact on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_npz_atomic(path: str | Path, arrays: dict[str, Any]) -> Path:
    """np.savez of plain numeric arrays, written atomically (object arrays are refused: no pickle)."""
    return write_bytes_atomic(path, npz_bytes(path, arrays))


def npz_bytes(path: str | Path, arrays: dict[str, Any]) -> bytes:
    """The bytes of an .npz of plain numeric arrays (`path` names the file in the error for objects)."""
    buffer = io.BytesIO()
    plain: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    for name, value in plain.items():
        if value.dtype.hasobject:
            raise ValueError(f"{path}: array {name!r} holds Python objects; only numeric arrays are saved")
    np.savez(buffer, **plain)
    return buffer.getvalue()


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """All arrays of an .npz (allow_pickle=False); a DataError naming the file if it is unreadable."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz (truncated or corrupted: {exc})") from None


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(directory: str | Path) -> None:
    """Persist a rename or a new entry in `directory` (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
