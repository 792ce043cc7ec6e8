"""Small helpers shared by several test files (pytest puts tests/ on sys.path: `from helpers import ...`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from heterps_ray.config import ClusterConfig, JobConfig, load_cluster

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]}
TINY_BATCH = 64
# the head node type of the fake multi-node provider (it tags the head so); any other name makes its
# autoscaler launch a second "head"
HEAD_TYPE = "ray.head.default"


def free_ports(count: int) -> list[int]:
    """`count` TCP ports free on 127.0.0.1 right now (for a `ray start` cluster of a test's own)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cloud_problem_with_runtime_terms(folder: Path, throughput_min: float | None = None) -> Path:
    """configs/problems/ctr_dnn_cloud.yaml on its cpu and t4 types (2^6 assignments: exact enumerates
    them fast), with a runtime section (DESIGN.md §3b: async, 2 micro-batches, 1 batch ahead, Ray's
    per-call cost) under which the base model's optimum is not the optimum; written into `folder`."""
    import yaml

    from heterps_ray.costmodel import load_problem

    data = load_problem(REPO / "configs" / "problems" / "ctr_dnn_cloud.yaml").to_dict()
    keep = ("cpu", "t4")
    data["resources"] = [r for r in data["resources"] if r["name"] in keep]
    for layer in data["layers"]:
        layer["time_ms"] = {t: v for t, v in layer["time_ms"].items() if t in keep}
    if throughput_min is not None:
        data["throughput_min"] = throughput_min
    data["runtime"] = {
        "mode": "async",
        "micro_batches": 2,
        "batches_ahead": 1,
        "call_ms": {"cpu": 2.0, "t4": 1.5},
        "ps_wait_ms_per_row": 1e-4,
        "ps_hosted_ms_per_row": 5e-5,
    }
    path = folder / "ctr_dnn_runtime.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def local_job(name: str, model: dict, dataset: Path, output: Path, **fields) -> JobConfig:
    """A job on the local two-type cluster with the tests' defaults (no floor, 10,000 samples, seed 3,
    2 micro-batches, 2 batches in flight); `fields` replace top-level keys, `runtime` is merged."""
    runtime = {"micro_batches": 2, "max_in_flight": 2, **fields.pop("runtime", {})}
    raw = {
        "name": name,
        "model": model,
        "cluster": load_cluster(REPO / "configs" / "clusters" / "local.yaml").model_dump(),
        "data": {"path": str(dataset)},
        "batch_size": TINY_BATCH,
        "samples": 10_000,
        "throughput_min": 0,
        "mode": "sync",
        "output_dir": str(output),
        "seed": 3,
        **fields,
        "runtime": runtime,
    }
    return JobConfig.model_validate(raw)


def tiny_sync_job(name: str, dataset: Path, output: Path, checkpoint_every: int = 0) -> JobConfig:
    """A sync ctr_dnn job on the local two-type cluster, small enough to train in seconds."""
    return local_job(
        name,
        TINY_MODEL,
        dataset,
        output,
        samples=2_000,
        seed=7,
        runtime={"checkpoint_every": checkpoint_every},
    )


def _kill_tree(marks: tuple[str, ...]) -> int:
    """SIGKILL every process (but this one) whose command line contains one of `marks`, and their
    children; wait until they are gone. Returns how many there were."""
    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.pid != os.getpid() and any(m in cmd for m in marks):
                procs.update({c.pid: c for c in [p, *p.children(recursive=True)]})
        except psutil.NoSuchProcess:
            continue
    for p in procs.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    alive, deadline = list(procs.values()), time.monotonic() + 10
    while alive and time.monotonic() < deadline:  # short polls: psutil's own back off to seconds
        _, alive = psutil.wait_procs(alive, timeout=0.1)
    return len(procs)


class LocalRayCluster:
    """A real multi-node Ray on this machine: a `ray start --head` through scripts/ray_cluster.sh with
    the types of `head_cluster` declared, plus worker nodes, each a `ray start` with a temp dir of its
    own (Ray's socket paths live under it, so it is short) and the resources it is given. Stops only its
    own processes (never `ray stop`, which ends every Ray on the machine). Token authentication on."""

    def __init__(self, head_cluster: Path, num_cpus: int = 2):
        self.head_cluster = head_cluster
        self.head_tmp = tempfile.mkdtemp(prefix="hps_h_", dir="/tmp")
        self.head_port, dashboard_port = free_ports(2)
        self.address = f"127.0.0.1:{self.head_port}"
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(
            RAY_TMP=self.head_tmp,
            HEAD_PORT=str(self.head_port),
            DASHBOARD_PORT=str(dashboard_port),
            NUM_CPUS=str(num_cpus),
            RAY_AUTH_MODE="token",  # the head keeps token authentication on; nodes and drivers use it
        )
        self.nodes: list[str] = []  # temp dirs of the worker nodes started

    def start(self) -> LocalRayCluster:
        started = subprocess.run(
            [str(REPO / "scripts" / "ray_cluster.sh"), "start", str(self.head_cluster)],
            cwd=REPO, env=self.env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        return self

    def add_node(self, resources: dict[str, float], num_cpus: int = 1) -> str:
        """Start a worker node declaring `resources`; returns its temp dir (for :meth:`stop_node`)."""
        node_tmp = tempfile.mkdtemp(prefix="hps_w_", dir="/tmp")
        self.nodes.append(node_tmp)
        ports = [str(p) for p in free_ports(4)]
        node = subprocess.run(
            [str(REPO / ".venv" / "bin" / "ray"), "start", "--address", self.address,
             "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus), "--resources", json.dumps(resources),
             "--temp-dir", node_tmp, "--dashboard-agent-listen-port", ports[0], "--dashboard-agent-grpc-port",
             ports[1], "--runtime-env-agent-port", ports[2], "--metrics-export-port", ports[3],
             "--disable-usage-stats"],
            cwd=REPO, env=self.env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert node.returncode == 0, node.stdout + node.stderr
        return node_tmp

    def node_ids(self) -> dict[str, list[str]]:
        """Resource name -> the ids of the live nodes that declare it (asked of the cluster by a driver)."""
        script = (
            f"import json, ray; ray.init(address={self.address!r}, log_to_driver=False); "
            "print(json.dumps([[n['NodeID'], sorted(n['Resources'])] for n in ray.nodes() if n['Alive']]))"
        )
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        ids: dict[str, list[str]] = {}
        for node_id, names in json.loads(out.stdout.strip().splitlines()[-1]):
            for name in names:
                ids.setdefault(name, []).append(node_id)
        return ids

    def stop_node(self, node_tmp: str) -> int:
        """SIGKILL the processes of the node whose temp dir is `node_tmp`, and their children, as a lost
        machine would go. Returns how many there were."""
        return _kill_tree((f"{node_tmp}/session_", f"--temp-dir={node_tmp}", f"--temp-dir {node_tmp}"))

    def close(self) -> None:
        # SIGKILL, the nodes and the head at once (a test's cluster is thrown away, nothing in it needs
        # a clean shutdown): the processes naming a temp dir of the cluster or the head's port, as
        # `ray_cluster.sh stop` finds them, and their children
        marks = [f":{self.head_port}"]
        for tmp in [*self.nodes, self.head_tmp]:
            marks += [f"{tmp}/session_", f"--temp-dir={tmp}", f"--temp-dir {tmp}"]
        _kill_tree(tuple(marks))
        for folder in [self.head_tmp, *self.nodes]:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()


class LocalAutoscalingCluster(LocalRayCluster):
    """Ray's own autoscaler on this machine, with its fake multi-node provider standing in for KubeRay:
    the head starts alone (`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=FILE`, a temp dir
    of its own, no resource type declared on it) and one worker node type per resource type of
    `cluster` scales from 0 to its max_instances, each node shaped as `heterps cluster render` shapes
    it (one actor of the type: {name: 1}, its CPUs rounded up). The autoscaler starts a node as a
    raylet of the head's session (its processes name the head's temp dir), so :meth:`close` (the
    processes naming that dir or the head's port, and their children; never `ray stop`) ends them
    too. `node_types` updates a type's entry (e.g. {"cpu_big": {"max_workers": 0}}).

    The fake provider points its nodes at GCS port 6379 unless the provider config names the head's
    GCS (`provider.gcs_address`), which it does here: the head takes a free port like the others."""

    def __init__(
        self,
        cluster: Path,
        *,
        idle_timeout_minutes: float = 0.1,
        node_types: dict[str, dict] | None = None,
        head_cpus: int = 1,
    ):
        super().__init__(cluster, num_cpus=head_cpus)
        self.config_file = Path(self.head_tmp) / "autoscaling.yaml"
        self.config = fake_autoscaling_config(
            load_cluster(cluster), self.address, idle_timeout_minutes, node_types or {}, head_cpus
        )

    def start(self, attempts: int = 2) -> LocalAutoscalingCluster:
        """Start the head (`attempts` tries: on a loaded machine `ray start` can time out waiting for
        its own GCS; a head half up is stopped before the next try)."""
        import yaml

        for _ in range(attempts):
            Path(self.head_tmp).mkdir(parents=True, exist_ok=True)
            self.config_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
            started = self._start_head()
            if started.returncode == 0:
                return self
            self.close()  # its GCS and monitor may be up: they are this cluster's, stop them
        raise AssertionError(f"ray start failed {attempts} times: " + started.stdout + started.stderr)

    def _start_head(self) -> subprocess.CompletedProcess:
        agent, agent_grpc, runtime_env, metrics, dashboard, client = free_ports(6)
        env = {**self.env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"
        return subprocess.run(
            [str(REPO / ".venv" / "bin" / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1",
             "--port", str(self.head_port), "--num-cpus", str(self.config["available_node_types"][HEAD_TYPE]
             ["resources"]["CPU"]), "--autoscaling-config", str(self.config_file), "--temp-dir", self.head_tmp,
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--dashboard-agent-listen-port",
             str(agent), "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port",
             str(runtime_env), "--metrics-export-port", str(metrics), "--ray-client-server-port", str(client),
             "--disable-usage-stats"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    def nodes_by_type(self) -> dict[str, int]:
        """Resource type -> live nodes that declare it now (the head declares none)."""
        types = set(self.config["available_node_types"]) - {HEAD_TYPE}
        return {name: len(ids) for name, ids in self.node_ids().items() if name in types}


def fake_autoscaling_config(
    cluster: ClusterConfig,
    gcs_address: str,
    idle_timeout_minutes: float,
    node_types: dict[str, dict],
    head_cpus: int,
) -> dict:
    """The autoscaling config of Ray's fake multi-node provider (what `AutoscalingCluster` reads from
    fake_multi_node/example.yaml, which the Ray 2.60 wheel lacks) with a head of `head_cpus` CPUs and
    no type, and one worker node type per resource type of `cluster`, from 0 nodes."""
    from heterps_ray.deploy.render import node_resources

    head = {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}
    types: dict[str, dict] = {HEAD_TYPE: head}
    for rtype in cluster.resource_types:
        types[rtype.name] = {
            "resources": node_resources(rtype),
            "node_config": {},
            "min_workers": 0,
            "max_workers": rtype.max_instances,
            **node_types.get(rtype.name, {}),
        }
    return {
        "cluster_name": "heterps-fake",
        "max_workers": sum(t.max_instances for t in cluster.resource_types),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "launch_multiple": True,  # several nodes of a type at once, as a cloud launches them
            "gcs_address": gcs_address,
        },
        "available_node_types": types,
        "head_node_type": HEAD_TYPE,
        "docker": {},
        "auth": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }
