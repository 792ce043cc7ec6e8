"""Loading configs: a user's file read as text or YAML, validated into a model with every failure one
ConfigError (file, dotted field, what was expected), sub-configs and paths resolved against the file
that names them, and output paths checked before any work starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from heterps_ray.config.cluster import ClusterConfig
from heterps_ray.config.job import JobConfig, ModelConfig
from heterps_ray.errors import ConfigError


def read_text(path: str | Path, expected: str = "a readable YAML file", field: str = "<file>") -> str:
    """The text of a file a user names (a job, model, cluster, problem or plan): the one way they are read.

    A missing file, a directory, an unreadable file or one that is not UTF-8 text is a ConfigError naming
    the file, `field` (what named it: ``<file>`` for the file as a whole) and `expected`, never a traceback.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), field, expected, exc.strerror) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        got = f"byte 0x{data[exc.start]:02x} at offset {exc.start}: not UTF-8 text"
        raise ConfigError(str(path), field, f"{expected}, in UTF-8", got) from None


def writable(path: str | Path, field: str, *, directory: bool, source: str | Path | None = None) -> Path:
    """`path`, once it can be written as a directory (`directory`) or as a file: it is not an existing file
    where a directory goes (or the other way round), and no folder above it is a file.

    Called before any work starts, so a bad output path fails with nothing written or removed. The
    ConfigError names `source`, the config file whose `field` this is, or else (a command-line argument
    `field`) the path itself.
    """
    path = Path(path)
    got = None
    if path.exists() and path.is_dir() != directory:
        got = f"{path}, an existing {'file' if directory else 'directory'}"
    else:
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            got = f"{path}, under the file {parent}"
    if got is not None:
        kind = "a directory" if directory else "a file"
        raise ConfigError(str(source or path), field, f"a path where {kind} can be written", got)
    return path


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML (or JSON) mapping; a missing, binary or unparsable file is a ConfigError naming it."""
    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "<file>", f"valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "<file>", "a mapping at the top level", type(data).__name__)
    return data


def validate(model_cls: type[BaseModel], data: dict[str, Any], file: str | None) -> Any:
    """Validate `data` as `model_cls`, turning the first pydantic error into a ConfigError."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        expected = _expected(err)
        got = err.get("input") if err["type"] not in ("missing", "value_error") else None
        if isinstance(got, dict):
            got = None
        raise ConfigError(file, field, expected, got) from None
    except ConfigError as exc:  # raised by a model validator, which knows the field but not the file
        if exc.file is None and file is not None:
            raise ConfigError(file, exc.field, exc.expected, exc.got) from None
        raise


def _expected(err: Any) -> str:
    kind = err["type"]
    if kind == "missing":
        return "a value (the field is required)"
    if kind == "extra_forbidden":
        return "no such field (unknown field; check its spelling)"
    if kind == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    return str(err["msg"]).lower()


def _resolve(base: Path, value: Any, loader: Any) -> Any:
    """A sub-config given as a path (relative to `base`) is loaded; a mapping is used inline."""
    if isinstance(value, str):
        path = (base / value).resolve()
        return loader(path)
    return value


def load_cluster(path: str | Path) -> ClusterConfig:
    return validate(ClusterConfig, read_yaml(path), str(path))


def load_model(path: str | Path) -> ModelConfig:
    return validate(ModelConfig, read_yaml(path), str(path))


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Load a job file; `model` and `cluster` may be inline mappings or paths to their own files.

    `overrides` (dotted keys, e.g. {"runtime.train_steps": 10}) are applied before validation.
    """
    path = Path(path)
    raw = read_yaml(path)
    base = path.resolve().parent
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    if "model" in raw:
        raw["model"] = _resolve(base, raw["model"], lambda p: load_model(p).model_dump())
    if "cluster" in raw:
        raw["cluster"] = _resolve(base, raw["cluster"], lambda p: load_cluster(p).model_dump())
    data = raw.get("data")
    if isinstance(data, dict) and isinstance(data.get("path"), str):
        data["path"] = _anchor(base, data["path"])
    if isinstance(raw.get("output_dir"), str):
        raw["output_dir"] = _anchor(base, raw["output_dir"])
    job: JobConfig = validate(JobConfig, raw, str(path))
    writable(job.output_dir, "output_dir", directory=True, source=path)
    return job


def _anchor(base: Path, value: str) -> str:
    """Paths in a job are relative to the job file, except `$PWD/...`-style absolute ones."""
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
