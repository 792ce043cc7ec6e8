"""Crash-safe files: write to a temporary file in the same directory, fsync, then ``os.replace``,
so a reader never sees a half-written file under the final name; and checked .npz reading.

Big tables are written member by member in chunks (:func:`write_npz_streamed`), hashed as they are
written, so a snapshot never holds a second copy of the table in memory (a whole-file ``bytes``
would be two: the arrays and the archive).

Example::

    write_npz_atomic(path, {"keys": keys, "weights": weights})
    arrays = read_npz(path)          # DataError naming `path` if it is truncated or corrupted
    digest, size = write_npz_streamed(path, [Member("keys", np.int64, (n,), chunks_of_keys)])
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from heterps_ray.errors import DataError


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through a synced temporary file; an old `path` stays intact on failure."""
    path = Path(path)
    with _replacing(path) as f:
        f.write(data)
    return path


@contextlib.contextmanager
def _replacing(path: Path, buffering: int = -1) -> Iterator[Any]:
    """A binary file that becomes `path` when the block ends (synced, renamed over it, the directory
    synced); on an error the temporary file goes and an old `path` stays intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb", buffering=buffering) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_npz_atomic(path: str | Path, arrays: dict[str, Any]) -> Path:
    """np.savez of plain numeric arrays, written atomically (object arrays are refused: no pickle)."""
    return write_bytes_atomic(path, npz_bytes(path, arrays))


@dataclass
class Member:
    """One array of an .npz written in chunks: its name, dtype and shape, and the chunks (C order,
    along the first axis) that fill it exactly."""

    name: str
    dtype: Any
    shape: tuple[int, ...]
    chunks: Iterable[np.ndarray]

    @staticmethod
    def of(name: str, array: Any) -> Member:
        """A member holding one whole array (small ones: scalars, dense tables, counts)."""
        value = np.asarray(array, order="C")  # (ascontiguousarray would make a scalar 1-d)
        return Member(name, value.dtype, value.shape, [value])


class _HashingWriter:
    """A file as zipfile sees it: write-only and not seekable (so members carry data descriptors
    and nothing is rewritten), every byte counted and hashed on its way to disk."""

    def __init__(self, raw: Any):
        self.raw, self.size, self.digest = raw, 0, hashlib.sha256()

    def write(self, data: bytes, /) -> int:
        self.raw.write(data)
        self.digest.update(data)
        n = memoryview(data).nbytes
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        """The caller closes the file (after its fsync)."""


def write_npz_streamed(path: str | Path, members: Iterable[Member]) -> tuple[str, int]:
    """Write an .npz (readable by :func:`read_npz`) member by member from chunks, atomically (a
    synced temporary file, then a rename); returns the file's SHA-256 and size in bytes."""
    path = Path(path)
    with _replacing(path, buffering=1 << 20) as raw:
        out = _HashingWriter(raw)
        with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for member in members:
                _write_member(archive, path, member)
    return out.digest.hexdigest(), out.size


def _write_member(archive: zipfile.ZipFile, path: Path, member: Member) -> None:
    dtype = np.dtype(member.dtype)
    if dtype.hasobject:
        raise ValueError(f"{path}: array {member.name!r} holds Python objects; only numeric arrays are saved")
    expected = int(np.prod(member.shape, dtype=np.int64)) * dtype.itemsize
    info = zipfile.ZipInfo(f"{member.name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
    info.file_size = expected + 4096  # header room: decides zip64 up front (no seeking back)
    written = 0
    with archive.open(info, mode="w", force_zip64=expected > 2**31) as f:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": member.shape}
        np.lib.format.write_array_header_1_0(f, header)
        for chunk in member.chunks:
            data = np.ascontiguousarray(chunk, dtype=dtype)
            if data.size:  # an empty (n, 0) or (0, k) chunk: a memoryview cannot cast a zero in its shape
                f.write(data.data.cast("B"))
            written += data.nbytes
    if written != expected:
        raise ValueError(f"{path}: member {member.name!r} got {written} bytes of data, expected {expected}")


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


class NpzReader:
    """An .npz read member by member and in chunks (a snapshot restored without a second copy of the
    table in memory); every error is a DataError naming the file. Use it as a context manager."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except FileNotFoundError:
            raise DataError(f"{self.path}: file not found") from None
        except (OSError, zipfile.BadZipFile) as exc:
            raise DataError(f"{self.path}: not a readable .npz (truncated or corrupted: {exc})") from None
        self.names = {n[: -len(".npy")] for n in self._zip.namelist() if n.endswith(".npy")}

    def __enter__(self) -> NpzReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._zip.close()

    def array(self, name: str) -> np.ndarray:
        """A whole member (small ones), its CRC checked."""
        (whole,) = self.chunks(name, 1 << 62)
        return whole

    def shape(self, name: str) -> tuple[int, ...]:
        with self._open(name) as f:
            return self._header(f, name)[0]

    def chunks(self, name: str, rows: int) -> Iterator[np.ndarray]:
        """Member `name` along its first axis, `rows` at a time (at least one chunk, maybe empty; a
        scalar is one chunk). The member's CRC is checked once it has been read to its end."""
        with self._open(name) as f:
            shape, dtype = self._header(f, name)
            if not shape:
                yield np.frombuffer(self._read(f, dtype.itemsize, name), dtype=dtype).reshape(())
            per_row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            left = shape[0] if shape else 0
            if shape and not left:
                yield np.empty(shape, dtype=dtype)
            while left:
                n = min(rows, left)
                data = self._read(f, n * per_row, name)
                yield np.frombuffer(data, dtype=dtype).reshape(n, *shape[1:])
                left -= n
            self._read(f, 1, name, end=True)

    def _open(self, name: str) -> Any:
        try:
            return self._zip.open(f"{name}.npy")
        except KeyError:
            raise KeyError(name) from None
        except (OSError, zipfile.BadZipFile) as exc:
            raise DataError(f"{self.path}: not a readable .npz (truncated or corrupted: {exc})") from None

    def _header(self, f: Any, name: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
        try:
            version = np.lib.format.read_magic(f)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read(f)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise DataError(f"{self.path}: member {name!r} is not a readable array ({exc})") from None
        if fortran or dtype.hasobject:
            raise DataError(f"{self.path}: member {name!r} is not a plain C-order numeric array")
        return tuple(shape), dtype

    def _read(self, f: Any, size: int, name: str, end: bool = False) -> bytes:
        try:
            data = f.read(size)
        except (OSError, EOFError, zipfile.BadZipFile) as exc:
            raise DataError(f"{self.path}: not a readable .npz (truncated or corrupted: {exc})") from None
        if (len(data) != 0) if end else (len(data) != size):
            raise DataError(f"{self.path}: member {name!r} is truncated or too long")
        return data


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
