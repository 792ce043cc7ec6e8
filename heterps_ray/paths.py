"""A file named inside a directory's own description stays inside that directory.

Model directories (``model.json``, ``manifest.json``) and datasets (``_meta.json``) name or count the
files they hold; a hand-edited or hostile description must not make a reader open ``/etc/passwd``,
``../other-run/…`` or a symlink out of the directory. Example::

    part = inside(model_dir, "sparse/embedding-shard-00000-of-00001.npz",
                  source=model_dir / "model.json", field="tables.embedding.files[0]")
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from heterps_ray.errors import DataError


def inside(directory: str | Path, name: object, *, source: str | Path, field: str) -> Path:
    """``directory / name`` once ``name`` is a relative path without ``..`` that, symlinks resolved,
    stays inside ``directory``; else a DataError naming ``source`` (the file that names it) and ``field``."""
    directory = Path(directory)

    def refuse(why: str) -> DataError:
        return DataError(
            f"{source}: field '{field}': expected a file inside {directory} "
            f"(a relative path, no '..', no symlink out of it), got {name!r}: {why}"
        )

    if not isinstance(name, str) or not name:
        raise refuse("not a file name")
    if PurePosixPath(name).is_absolute():
        raise refuse("an absolute path")
    if ".." in PurePosixPath(name).parts:
        raise refuse("it climbs out with '..'")
    path = directory / name
    resolved = path.resolve()
    if not resolved.is_relative_to(directory.resolve()):
        raise refuse(f"it resolves to {resolved}, outside the directory")
    return path
