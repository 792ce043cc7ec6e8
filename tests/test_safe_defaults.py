"""Safe defaults: Ray keeps token authentication, dashboards bind to 127.0.0.1 unless asked otherwise,
and no file a user passes in is unpickled (a scan of the package's source, and pickled payloads that
would leave a mark if they ran, refused by the readers)."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from heterps_ray.cluster import DASHBOARD_HOST, _keep_token_auth, init_kwargs
from heterps_ray.config import load_cluster
from heterps_ray.errors import DataError
from heterps_ray.ps.atomic import read_npz, write_npz_atomic
from heterps_ray.ps.shard import PSShard
from heterps_ray.ps.spec import TableSpec
from heterps_ray.runtime.checkpoint import MANIFEST, load_checkpoint, save_checkpoint, write_manifest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "heterps_ray"
SCRIPT = REPO / "scripts" / "ray_cluster.sh"
CLUSTER = load_cluster(REPO / "configs" / "clusters" / "local.yaml")

# -- no pickle ---------------------------------------------------------------------------------

_SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader"}
# RLlib checkpoints are cloudpickle inside: RLScheduler.from_checkpoint reads the user's own RLlib
# training output (no CLI path reaches it). Listed so it stays a visible, deliberate exception.
_ALLOWED = {("scheduling/rl/scheduler.py", "ray.rllib.core.rl_module.rl_module.RLModule.from_checkpoint")}


def _qualified(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`np.load` -> `numpy.load`, following the module's imports; None for calls on values."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_loads(source: str) -> list[tuple[int, str]]:
    """(line, what) for every way `source` could unpickle a file: pickle/cloudpickle/dill/joblib/
    marshal/shelve, np.load without allow_pickle=False, torch.load without weights_only=True,
    yaml.load without a safe loader (or yaml.unsafe_load/full_load), pandas.read_pickle and RLlib's
    from_checkpoint (cloudpickle)."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:  # `from ray import cloudpickle` imports the module ray.cloudpickle
                modules = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            for module in modules:
                if re.search(r"(^|\.)(pickle|cloudpickle|dill|shelve|marshal|joblib)$", module):
                    found.append((node.lineno, f"import {module}"))
        if not isinstance(node, ast.Call):
            continue
        name = _qualified(node.func, aliases)
        if name is None:
            continue
        if name in ("numpy.load",) and not _is_constant(_keyword(node, "allow_pickle"), False):
            found.append((node.lineno, f"{name} without allow_pickle=False"))
        elif name == "torch.load" and not _is_constant(_keyword(node, "weights_only"), True):
            found.append((node.lineno, f"{name} without weights_only=True"))
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            loader_name = _qualified(loader, aliases) if loader is not None else None
            if loader_name is None or loader_name.split(".")[-1] not in _SAFE_YAML_LOADERS:
                found.append((node.lineno, f"{name} without SafeLoader"))
        elif name in ("yaml.unsafe_load", "yaml.full_load", "pandas.read_pickle") or name.endswith(
            ".from_checkpoint"
        ):
            found.append((node.lineno, name))
    return found


def test_the_scan_finds_every_unpickling_pattern():
    source = """
import pickle
import numpy as np
import torch, yaml
from ray import cloudpickle
from ray.rllib.algorithms.algorithm import Algorithm
import pandas as pd
np.load(f)
np.load(f, allow_pickle=True)
np.load(f, allow_pickle=False)
torch.load(f)
torch.load(f, weights_only=False)
torch.load(f, weights_only=True)
yaml.load(text)
yaml.load(text, Loader=yaml.FullLoader)
yaml.load(text, Loader=yaml.SafeLoader)
yaml.safe_load(text)
yaml.unsafe_load(text)
pd.read_pickle(f)
Algorithm.from_checkpoint(path)
"""
    assert sorted(unsafe_loads(source)) == [
        (2, "import pickle"),
        (5, "import ray.cloudpickle"),
        (8, "numpy.load without allow_pickle=False"),
        (9, "numpy.load without allow_pickle=False"),
        (11, "torch.load without weights_only=True"),
        (12, "torch.load without weights_only=True"),
        (14, "yaml.load without SafeLoader"),
        (15, "yaml.load without SafeLoader"),
        (18, "yaml.unsafe_load"),
        (19, "pandas.read_pickle"),
        (20, "ray.rllib.algorithms.algorithm.Algorithm.from_checkpoint"),
    ]


def test_no_file_is_loaded_with_pickle_anywhere_in_the_package():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        for line, what in unsafe_loads(text):
            if (rel, what) not in _ALLOWED:
                found.append(f"heterps_ray/{rel}:{line}: {what}")
        if re.search(r"\bcloudpickle\b", "\n".join(_code_lines(text))):
            found.append(f"heterps_ray/{rel}: uses cloudpickle")
    assert not found, "\n".join(found)
    # an allowed exception that disappeared must leave the list too
    for rel, what in _ALLOWED:
        assert any(w == what for _, w in unsafe_loads((PACKAGE / rel).read_text())), (rel, what)


def _code_lines(text: str) -> list[str]:
    """Source lines without comments and docstrings (a mention in prose is no call)."""
    tree = ast.parse(text)
    prose = {
        n.value.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
    }
    return [line.split("#")[0] for i, line in enumerate(text.splitlines(), 1) if i not in prose]


class _LeavesAMark:
    """Unpickling this creates the file `path`: proof that a loader ran pickled code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _npz_with_an_object_array(path: Path, mark: Path) -> Path:
    np.savez(path, keys=np.arange(3, dtype=np.int64), payload=np.array([_LeavesAMark(mark)], dtype=object))
    return path


def test_the_mark_shows_when_pickled_code_runs(tmp_path):
    mark = tmp_path / "ran"
    path = _npz_with_an_object_array(tmp_path / "x.npz", mark)
    with np.load(path, allow_pickle=True) as data:
        data["payload"]
    assert mark.exists()  # so its absence below means the readers refused the payload


def test_npz_with_an_object_array_is_refused_by_every_reader(tmp_path):
    mark = tmp_path / "ran"
    path = _npz_with_an_object_array(tmp_path / "ps-shard-00000.npz", mark)
    with pytest.raises(DataError, match=re.escape(str(path))):
        read_npz(path)
    with pytest.raises(DataError, match=re.escape(str(path))):
        PSShard(0, 1, {"embedding": TableSpec(dim=4)}).restore(str(path))
    with pytest.raises(ValueError, match="Python objects"):
        write_npz_atomic(tmp_path / "out.npz", {"payload": np.array([_LeavesAMark(mark)], dtype=object)})
    assert not mark.exists()


def test_model_checkpoint_with_a_pickled_dense_file_is_refused(tmp_path):
    from heterps_ray.config import ModelConfig
    from heterps_ray.models import build_model

    config = ModelConfig(name="ctr_dnn", embedding_dim=4, hidden=[8])
    spec = build_model(config)
    net = spec.build(0, spec.num_layers, 0)
    dense = {
        f"{spec.layers[int(k.split('.')[1])].name}.{k.split('.', 2)[2]}": v.numpy()
        for k, v in net.state_dict().items()
    }
    empty = {"keys": np.zeros(0, np.int64), "weights": np.zeros((0, 4), np.float32)}
    empty["accumulators"] = np.zeros((0, 4), np.float32)

    def write_sparse(table, paths):
        for path in paths:
            write_npz_atomic(path, empty)
        return [0 for _ in paths]

    settings = {"lr": 0.05, "init_accumulator": 0.1, "init_scale": 0.01}
    model = save_checkpoint(
        tmp_path / "model", config, spec, 0, dense, {"embedding": 1}, write_sparse, settings
    )
    load_checkpoint(model)  # the honest file loads

    mark = tmp_path / "ran"
    _npz_with_an_object_array(model / "dense.npz", mark)
    manifest = json.loads((model / MANIFEST).read_text())
    write_manifest(model, {k: v for k, v in manifest.items() if k != "files"})  # it even verifies
    with pytest.raises(DataError, match=re.escape(str(model / "dense.npz"))):
        load_checkpoint(model)
    assert not mark.exists()


def test_policy_weights_with_a_pickled_object_are_refused(tmp_path):
    from heterps_ray.scheduling.rl.policy import PRETRAINED_DIR, load_policy

    policy = tmp_path / "policy"
    policy.mkdir()
    shutil.copy(PRETRAINED_DIR / "policy.json", policy / "policy.json")
    shutil.copy(PRETRAINED_DIR / "policy.pt", policy / "policy.pt")
    load_policy(policy)  # the shipped weights load
    mark = tmp_path / "ran"
    weights = torch.load(PRETRAINED_DIR / "policy.pt", weights_only=True)
    torch.save({**weights, "extra": _LeavesAMark(mark)}, policy / "policy.pt")
    with pytest.raises(DataError, match="policy.pt"):
        load_policy(policy)
    assert not mark.exists()


# -- Ray: token authentication and a loopback dashboard -----------------------------------------


def test_embedded_ray_keeps_the_dashboard_off_and_on_loopback():
    kwargs = init_kwargs(CLUSTER)
    assert kwargs["address"] == "local" and kwargs["include_dashboard"] is False
    assert kwargs["dashboard_host"] == DASHBOARD_HOST == "127.0.0.1"
    assert kwargs["resources"] == {"cpu_small": 4.0, "cpu_big": 2.0}
    # only scheduling, transfer and GCS memory settings, nothing that could switch authentication off
    assert set(kwargs["_system_config"]) == {
        "worker_niceness",
        "max_direct_call_object_size",
        "task_events_max_num_task_in_gcs",
    }
    asked = init_kwargs(CLUSTER, dashboard=True, dashboard_host="0.0.0.0")
    assert asked["include_dashboard"] is True and asked["dashboard_host"] == "0.0.0.0"
    assert init_kwargs(CLUSTER, "ray://head:10001") == {
        "address": "ray://head:10001",
        "log_to_driver": False,
        "configure_logging": False,
    }


def test_embedded_ray_keeps_rays_token_default_and_warns_when_the_user_disables_it(monkeypatch, caplog):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with caplog.at_level(logging.WARNING, logger="heterps_ray.cluster"):
        _keep_token_auth()  # Ray's own default (token) stays in force: nothing is set, nothing said
    assert "RAY_AUTH_MODE" not in os.environ and not caplog.text
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's explicit choice is kept, and said
    with caplog.at_level(logging.WARNING, logger="heterps_ray.cluster"):
        _keep_token_auth()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    assert "without token authentication" in caplog.text


def _dry_start(**env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k not in ("DASHBOARD_HOST", "RAY_AUTH_MODE")}
    result = subprocess.run(
        [str(SCRIPT), "start"],
        cwd=REPO,
        env={**environment, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_ray_cluster_script_binds_the_dashboard_to_loopback_with_a_token():
    line = _dry_start(RAY_AUTH_MODE="disabled")  # a caller's setting does not switch tokens off
    assert line.startswith("RAY_AUTH_MODE=token ") and " start --head " in line
    assert " --dashboard-host 127.0.0.1 " in line
    assert " --dashboard-host 0.0.0.0 " in _dry_start(DASHBOARD_HOST="0.0.0.0")  # asked for


def test_nothing_in_the_project_switches_ray_authentication_off():
    found = []
    for folder in ("heterps_ray", "scripts", "benchmarks", "configs", "notebooks", "tests"):
        # scripts/ and benchmarks/: the scripts themselves, not the result folders beside them (the results
        # quote Ray's own warning, which names the setting)
        paths = (REPO / folder).glob("*") if folder in ("scripts", "benchmarks") else (REPO / folder).rglob("*")
        for path in sorted(paths):
            if path.suffix not in (".py", ".sh", ".yaml", ".yml", ".json", ".ipynb") or path == Path(
                __file__
            ):
                continue
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(r"RAY_AUTH_MODE\W{0,4}(disabled|none|off)", line, re.IGNORECASE):
                    found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
