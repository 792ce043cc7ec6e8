"""Where a batch's time goes in the real runtime: CPU seconds per process role and busy/wait per actor.

Runs the validation plans of scripts/validate_costmodel.py with the runtime's own actors (through
heterps_ray.runtime.driver's run object, so the loop's start and end are known exactly) and reads
every process's CPU time (psutil) before and after the training loop: DataWorkers, StageWorkers,
PS shards, the driver and Ray's own daemons (raylet, gcs). Nothing in the runtime is changed.

    .venv/bin/python scripts/costmodel_validation_breakdown.py --data runs/validate_costmodel/data

Writes benchmarks/costmodel_validation_breakdown.json (per plan: ms per batch of wall time and of
CPU time per role, actor busy/wait) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]


def _validation_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "validate_costmodel", REPO / "scripts/validate_costmodel.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["validate_costmodel"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _role(proc: psutil.Process) -> str | None:
    try:
        cmd = " ".join(proc.cmdline())
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    for role in ("DataWorker", "StageWorker", "PSShard"):
        if cmd.startswith("ray::") and role in cmd.split()[0] or name.startswith("ray::") and role in name:
            return role
    if proc.pid == os.getpid():
        return "driver"
    if "raylet" in cmd:
        return "raylet"
    if "gcs_server" in cmd:
        return "gcs"
    if "ray" in cmd:
        return "ray_other"  # any other Ray process on the machine (other sessions' too)
    return None


def _cpu_by_pid() -> dict[int, tuple[str, float]]:
    out = {}
    for proc in psutil.process_iter():
        role = _role(proc)
        if role is None:
            continue
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[proc.pid] = (role, t.user + t.system)
    return out


def _timed_data_worker_class() -> Any:
    """The runtime's DataWorker with timers around its parts (a subclass: the runtime is unchanged)."""
    from heterps_ray.ps.shard import PSClient
    from heterps_ray.runtime.workers import DataWorker

    class TimedPS(PSClient):
        def __init__(self, shards: list[Any], timers: dict[str, float]):
            super().__init__(shards)
            self.timers = timers

        def pull(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().pull(*args, **kwargs)
            finally:
                self.timers["pull"] += time.perf_counter() - t0

        def push(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().push(*args, **kwargs)
            finally:
                self.timers["push_client"] += time.perf_counter() - t0

    class TimedDataWorker(DataWorker):
        def __init__(self, *args: Any, **kwargs: Any):
            self.timers = dict.fromkeys(
                ("read", "pull", "push_client", "forward", "finish", "settle", "run"), 0.0
            )
            super().__init__(*args, **kwargs)
            self.ps = TimedPS(self.ps.shards, self.timers)

        def _read_batches(self) -> Any:
            inner = super()._read_batches()
            while True:
                t0 = time.perf_counter()
                batch = next(inner, None)
                self.timers["read"] += time.perf_counter() - t0
                if batch is None:
                    return
                yield batch

        def run(self, steps: int) -> dict[str, Any]:
            t0 = time.perf_counter()
            try:
                return super().run(steps)
            finally:
                self.timers["run"] += time.perf_counter() - t0

        def _forward(self, item: Any) -> None:
            t0 = time.perf_counter()
            super()._forward(item)
            self.timers["forward"] += time.perf_counter() - t0

        def _finish(self, item: Any) -> None:
            t0 = time.perf_counter()
            super()._finish(item)
            self.timers["finish"] += time.perf_counter() - t0

        def _settle_pushes(self, keep: int) -> None:
            t0 = time.perf_counter()
            super()._settle_pushes(keep)
            self.timers["settle"] += time.perf_counter() - t0

        def timings(self) -> dict[str, float]:
            return {**self.timers, "wait": self._wait_s}

    return TimedDataWorker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "validate_costmodel" / "data")
    parser.add_argument(
        "--problem",
        type=Path,
        default=REPO / "runs" / "validate_costmodel" / "problem.yaml",
        help="a profiled problem of the local cluster (only to build the plans)",
    )
    parser.add_argument("--cases", nargs="*", type=int, default=None)
    parser.add_argument("--batches-per-worker", type=int, default=128)
    parser.add_argument(
        "--output", type=Path, default=REPO / "benchmarks/costmodel_validation_breakdown.json"
    )
    args = parser.parse_args()

    import ray

    from heterps_ray.config import load_job
    from heterps_ray.costmodel import CostModel, Plan, load_problem
    from heterps_ray.models import build_model
    from heterps_ray.runtime.actors import ActorSet
    from heterps_ray.runtime.driver import _dataset_files
    from heterps_ray.runtime.pipeline import resolve_stages

    validation = _validation_module()
    from heterps_ray.data.layout import is_dataset

    if not is_dataset(args.data):
        from heterps_ray.data.synth import synthesize

        synthesize(args.data, 200_000, seed=0)
    job_file = Path(tempfile.mkdtemp(prefix="heterps-breakdown-")) / "job.yaml"
    job_file.write_text(
        f"name: costmodel-breakdown\nmodel: {REPO / 'configs/models/ctr_dnn.yaml'}\n"
        f"cluster: {REPO / 'configs/clusters/local.yaml'}\ndata: {{path: {args.data}}}\nbatch_size: 512\n"
        f"samples: 100000000\nthroughput_min: 0\noutput_dir: /tmp/heterps-breakdown\n"
    )
    base = load_job(job_file)
    ray.init(
        num_cpus=2,
        resources=base.cluster.local_resources(),
        object_store_memory=1 << 30,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    problem = load_problem(args.problem)
    cases = [validation.CASES[i] for i in args.cases] if args.cases is not None else list(validation.CASES)
    results = []
    for case in cases:
        job = load_job(job_file, {"mode": case.mode, "runtime.micro_batches": case.micro_batches})
        evaluation = CostModel(problem).evaluate(list(case.assignment), list(case.replicas), case.ps_shards)
        plan = Plan.from_evaluation(problem, evaluation, "breakdown")
        model = build_model(job.model)
        stages = resolve_stages(plan, model, job)
        train_files, _ = _dataset_files(job)
        run = ActorSet(job, model, stages, case.ps_shards, train_files)
        run.start()
        workers = len(run.data_workers)
        # Replace the DataWorkers by timed ones built the same way (ActorSet.new_data_worker)
        from heterps_ray.runtime.workers import DataSettings

        timed_cls = ray.remote(_timed_data_worker_class())
        for i, old in enumerate(run.data_workers):
            ray.kill(old)
            data = DataSettings(
                path=str(job.data.path),
                files=tuple(str(f) for f in run.files[i::workers]),
                batch_size=job.batch_size,
                micro_batches=job.runtime.micro_batches,
                epochs=job.runtime.epochs,
                max_in_flight=job.runtime.max_in_flight,
            )
            run.data_workers[i] = timed_cls.options(**job.cluster.type(stages[0].type).actor_options()).remote(
                i, stages[0], model, run.worker_settings(stages[0]), data, run.stage_workers, run.shards,
                run.dense_ps(stages[0]),
            )  # fmt: skip
        ray.get([w.describe.remote() for w in run.data_workers])
        try:
            before_stats = run.stage_stats()
            before_ps = run.ps_stats()
            cpu0 = _cpu_by_pid()
            wall0 = time.perf_counter()
            done = 0
            while done < args.batches_per_worker:
                per = min(validation.DRIVER_CHUNK, args.batches_per_worker - done)
                ray.get([w.run.remote(per) for w in run.data_workers])
                done += per
            wall = time.perf_counter() - wall0
            cpu1 = _cpu_by_pid()
            timings = ray.get([w.timings.remote() for w in run.data_workers])
            after_stats = run.stage_stats()
            after_ps = run.ps_stats()
        finally:
            run.shutdown()
        batches = args.batches_per_worker * workers
        cpu: dict[str, float] = {}
        for pid, (role, t1) in cpu1.items():
            t0 = cpu0.get(pid, (role, t1 if role in ("DataWorker", "StageWorker", "PSShard") else 0.0))[1]
            cpu[role] = cpu.get(role, 0.0) + (t1 - t0)
        per_batch = {role: s * 1000.0 / batches for role, s in sorted(cpu.items())}
        busy = [
            sum(a["busy_s"] for a in after) - sum(b["busy_s"] for b in before)
            for after, before in zip(after_stats, before_stats, strict=True)
        ]
        wait = sum(a.get("wait_s", 0.0) for a in after_stats[0]) - sum(
            b.get("wait_s", 0.0) for b in before_stats[0]
        )
        row = {
            "case": case.name,
            "batches": batches,
            "wall_ms_per_batch": wall * 1000.0 / batches,
            "throughput": batches * job.batch_size / wall,
            "cpu_ms_per_batch": per_batch,
            "cpu_total_ms_per_batch": sum(per_batch.values()),
            "host_utilisation": sum(cpu.values()) / (wall * 2),
            "busy_ms_per_batch": [b * 1000.0 / batches for b in busy],
            "data_wait_ms_per_batch": wait * 1000.0 / batches,
            "ps_keys": [
                a["keys_pulled"] - b["keys_pulled"] for a, b in zip(after_ps, before_ps, strict=True)
            ],
            "data_worker_ms_per_batch": {
                k: sum(t[k] for t in timings) * 1000.0 / batches for k in timings[0]
            },
            "load_average": os.getloadavg()[0],
        }
        results.append(row)
        print(
            f"{case.name:<34} {row['throughput']:8,.0f}/s  wall {row['wall_ms_per_batch']:5.1f} ms/batch  "
            f"cpu {row['cpu_total_ms_per_batch']:5.1f} ms ({row['host_utilisation']:.0%} of 2 cores)  "
            + " ".join(f"{k} {v:.1f}" for k, v in per_batch.items())
            + "  busy "
            + "/".join(f"{b:.1f}" for b in row["busy_ms_per_batch"])
            + f"  wait {row['data_wait_ms_per_batch']:.1f}\n    DataWorker: "
            + " ".join(f"{k} {v:.1f}" for k, v in row["data_worker_ms_per_batch"].items()),
            flush=True,
        )
    ray.shutdown()
    args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
