#!/usr/bin/env bash
# A local Ray cluster with heterps_ray's resource types declared, and `heterps run` submitted to it
# as a Ray Job.
#
#   scripts/ray_cluster.sh start [CLUSTER.yaml]    ray start --head with the cluster's resource types
#   scripts/ray_cluster.sh submit JOB.yaml [ARGS]  ray job submit -- heterps run JOB.yaml ARGS (waits, streams logs)
#   scripts/ray_cluster.sh logs [SUBMISSION_ID]    follow a job's logs (default: the last submitted)
#   scripts/ray_cluster.sh status [SUBMISSION_ID]  a job's status
#   scripts/ray_cluster.sh stop                    ray stop
#
# Token authentication stays on: RAY_AUTH_MODE=token for every command here, whatever the caller's
# environment says; `ray start` writes the token to ~/.ray/auth_token and the job client reads it.
# The dashboard (and job server) binds to DASHBOARD_HOST, 127.0.0.1 unless you set it.
# Outputs: the job writes to the output_dir of its job file, on the head node (this machine).
# Environment: RAY_BIN (default .venv/bin/ray), HEAD_PORT (6379), DASHBOARD_PORT (8265),
# DASHBOARD_HOST (127.0.0.1), RAY_TMP (this cluster's Ray temp dir, default /tmp/heterps_ray),
# NUM_CPUS (default: all), DRY_RUN=1 (start: print the `ray start` command line instead of running it).
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_BIN=${RAY_BIN:-.venv/bin/ray}
PY=${PY:-.venv/bin/python}
HEAD_PORT=${HEAD_PORT:-6379}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
DASHBOARD_HOST=${DASHBOARD_HOST:-127.0.0.1}
RAY_TMP=${RAY_TMP:-/tmp/heterps_ray}
ADDRESS="http://127.0.0.1:${DASHBOARD_PORT}"
LAST_ID_FILE="${RAY_TMP}/heterps_last_submission"
export RAY_AUTH_MODE=token

cmd=${1:-}
shift || true
case "$cmd" in
  start)
    cluster=${1:-configs/clusters/local.yaml}
    resources=$("$PY" -c 'import json,sys; from heterps_ray.config import load_cluster; print(json.dumps(load_cluster(sys.argv[1]).local_resources()))' "$cluster")
    extra=()
    [ -n "${NUM_CPUS:-}" ] && extra+=(--num-cpus "$NUM_CPUS")
    # The agents' default ports clash with any other Ray on this machine (an embedded one, a test
    # session's): take free ones.
    read -r agent_port agent_grpc env_port metrics_port < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])')
    start_cmd=("$RAY_BIN" start --head --node-ip-address 127.0.0.1 --port "$HEAD_PORT"
      --dashboard-host "$DASHBOARD_HOST" --dashboard-port "$DASHBOARD_PORT"
      --dashboard-agent-listen-port "$agent_port" --dashboard-agent-grpc-port "$agent_grpc"
      --runtime-env-agent-port "$env_port" --metrics-export-port "$metrics_port"
      --resources "$resources" --temp-dir "$RAY_TMP" --disable-usage-stats "${extra[@]}")
    if [ -n "${DRY_RUN:-}" ]; then
      echo "RAY_AUTH_MODE=$RAY_AUTH_MODE ${start_cmd[*]}"
      exit 0
    fi
    # The cluster's processes (and so a job's entrypoint `python`) use this project's environment.
    # Workers at the raylet's priority, not Ray's default nice 15 (heterps_ray/cluster.py SYSTEM_CONFIG).
    PATH="$(cd "$(dirname "$RAY_BIN")" && pwd):$PATH" RAY_worker_niceness=0 "${start_cmd[@]}"
    echo "Ray cluster up at $ADDRESS with resource types $resources"
    ;;
  submit)
    job=${1:?usage: ray_cluster.sh submit JOB.yaml [heterps run options]}
    shift
    id="heterps-$(date +%Y%m%d-%H%M%S)-$$"
    mkdir -p "$RAY_TMP"
    echo "$id" > "$LAST_ID_FILE"
    # The working dir goes up whole but for these excludes: Ray's .gitignore rule would also drop the
    # compiled row store (heterps_ray/ps/_rows*.so, ignored by git, built by setup.py).
    RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 "$RAY_BIN" job submit --address "$ADDRESS" --submission-id "$id" --working-dir . \
      --runtime-env-json '{"excludes": [".venv", ".git", "runs", "data", "tmp", "build", "*.parquet", "__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".mypy_cache", ".ruff_cache"]}' \
      -- python -m heterps_ray run "$job" "$@"
    ;;
  logs)
    "$RAY_BIN" job logs --address "$ADDRESS" --follow "${1:-$(cat "$LAST_ID_FILE")}"
    ;;
  status)
    "$RAY_BIN" job status --address "$ADDRESS" "${1:-$(cat "$LAST_ID_FILE")}"
    ;;
  stop)
    # Not `ray stop`: it kills every Ray process on the machine (an embedded Ray, a test session's).
    # Stop only this cluster: the processes that name its temp dir or head port, and their children.
    # In `ray stop`'s order: the GCS last. The raylet, the autoscaler's monitor.py and the agents talk
    # to the GCS on SIGTERM (unregister, publish "terminated"); with the GCS gone first each of them
    # waits out its GCS client's retries (10 s) instead of exiting within a second.
    "$PY" - "$RAY_TMP" "$HEAD_PORT" <<'PY'
import sys
import time

import psutil

tmp, port = sys.argv[1].rstrip("/"), sys.argv[2]
marks = (f"{tmp}/session_", f"--temp-dir={tmp}", f":{port}")
roots = [
    p for p in psutil.process_iter(["cmdline"])
    if any(m in arg for arg in (p.info["cmdline"] or []) for m in marks) and p.pid != psutil.Process().pid
]
procs = {p.pid: p for r in roots for p in [r, *r.children(recursive=True)]}


def is_gcs(p: psutil.Process) -> bool:
    try:
        return p.name() == "gcs_server"
    except psutil.NoSuchProcess:
        return False


gcs = [p for p in procs.values() if is_gcs(p)]
for wave in ([p for p in procs.values() if p not in gcs], gcs):
    for p in wave:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    alive, deadline = wave, time.monotonic() + 10
    while alive and time.monotonic() < deadline:  # short polls: most exit well within a second
        _, alive = psutil.wait_procs(alive, timeout=0.1)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
print(f"stopped {len(procs)} Ray processes of the cluster in {tmp}")
PY
    ;;
  *)
    sed -n '2,17p' "$0"
    exit 2
    ;;
esac
