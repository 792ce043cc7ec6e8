"""Benchmark: a whole Criteo-shaped epoch (BENCHMARKS.md "The Criteo-shaped epoch", issue 27).

`heterps train` of one plan over every training row of a dataset, one run per table setting, and with
``--reference`` the one-process reference loop (`heterps reference`, torch's own threads) on the same
data, alternating, ``--rounds`` times. The job is the quickstart job's model and optimizers with the
dataset swapped in; each system is its own `heterps` process, as a user runs it. Per run: samples/s
(whole run, and after the first chunk), the rate in each fifth of the epoch (from the run's chunk
records), eval AUC against the data's achievable AUC, and the peak resident memory of each process
of the run (the driver and everything it started: Ray's processes and the actors), sampled every
second with psutil.

    heterps data synth --rows 4000000 --shape criteo-kaggle --seed 0 -o /tmp/ck4m
    ../shared/bench/quiet.sh && .venv/bin/python benchmarks/bench_criteo_epoch.py --data /tmp/ck4m \\
        --settings admit2 --reference --rounds 2
    heterps data synth --rows 45840617 --shape criteo-kaggle --seed 0 -o /tmp/ck45m
    ../shared/bench/quiet.sh && .venv/bin/python benchmarks/bench_criteo_epoch.py --data /tmp/ck45m \\
        --settings off admit2 --table-memory-gb 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "jobs" / "quickstart.yaml"
CLUSTER = REPO / "configs" / "clusters" / "local.yaml"
HETERPS = [sys.executable, "-m", "heterps_ray"]
SETTINGS = {"off": {"admit_after": 1}, "admit2": {"admit_after": 2}}  # table: sections


class PeakMemory:
    """Peak RSS of a process and all its descendants, by process, sampled every `every_s`."""

    def __init__(self, pid: int, every_s: float = 1.0):
        self.root = psutil.Process(pid)
        self.every_s = every_s
        self.peaks: dict[int, tuple[str, int]] = {}
        self.trace: list[tuple[float, str, int]] = []  # (seconds, process, RSS) of processes over 200 MiB
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for proc in procs:
                try:
                    rss = proc.memory_info().rss
                    name = " ".join(proc.cmdline()[:1]) if proc.pid == self.root.pid else proc.name()
                except psutil.Error:
                    continue
                name = "driver" if proc.pid == self.root.pid else name
                if rss > self.peaks.get(proc.pid, ("", 0))[1]:
                    self.peaks[proc.pid] = (name, rss)
                if rss > 200 * 2**20:
                    self.trace.append((round(time.perf_counter() - self._t0, 1), f"{name}:{proc.pid}", rss))

    def by_call(self) -> dict[str, float]:
        """Peak RSS (GiB) of each process name over 200 MiB: an actor's name says the call it is in
        (``ray::DataWorker.run`` training, ``.on_shard`` a checkpoint or the model's rows, ...)."""
        out: dict[str, float] = {}
        for _, name, rss in self.trace:
            key = name.rsplit(":", 1)[0]
            out[key] = max(out.get(key, 0.0), round(rss / 2**30, 2))
        return out

    def stop(self) -> list[dict[str, Any]]:
        """The processes above 200 MiB at their peak, largest first."""
        self._stop.set()
        self._thread.join()
        big = [(name, rss) for name, rss in self.peaks.values() if rss > 200 * 2**20]
        return [
            {"process": n, "peak_rss_gib": round(r / 2**30, 2)} for n, r in sorted(big, key=lambda x: -x[1])
        ]


def write_job(
    workdir: Path,
    data: Path,
    name: str,
    table: dict[str, Any],
    table_memory_gb: float | None,
    runtime: dict[str, Any] | None = None,
) -> Path:
    job = yaml.safe_load(JOB.read_text())
    cluster = yaml.safe_load(CLUSTER.read_text())
    if table_memory_gb:
        for rtype in cluster["resource_types"]:
            rtype["table_memory_gb"] = table_memory_gb
    job.update(
        name=f"epoch-{name}",
        model=str((JOB.parent / job["model"]).resolve()),
        cluster=cluster,
        data={"path": str(data)},
        output_dir=str(workdir / name),
        table=table,
    )
    job["runtime"] = {**job.get("runtime", {}), **(runtime or {})}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def fifths(chunks: list[list[float]]) -> list[float]:
    """Samples/s in each fifth of the epoch's samples (chunks are [samples, seconds])."""
    total = sum(s for s, _ in chunks)
    parts = [[0.0, 0.0] for _ in range(5)]
    done = 0.0
    for samples, seconds in chunks:
        part = parts[min(4, int(5 * done / total))]
        part[0] += samples
        part[1] += seconds
        done += samples
    return [round(s / t) if t else 0 for s, t in parts]


def run(system: str, job: Path, plan: str, trace: Path | None = None) -> dict[str, Any]:
    command = [*HETERPS, "reference", str(job), "--no-progress"]
    if system != "reference":
        command = [*HETERPS, "train", str(job), "--plan", plan, "--overwrite", "--no-progress"]
    load = Path("/proc/loadavg").read_text().split()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO)
    memory = PeakMemory(proc.pid)
    code = proc.wait()
    wall = time.perf_counter() - start
    peaks = memory.stop()
    if trace:
        trace.write_text(json.dumps(memory.trace))
    if code:
        raise SystemExit(f"{' '.join(command)} exited {code}")
    config = yaml.safe_load(job.read_text())
    out = Path(config["output_dir"])
    row: dict[str, Any] = {
        "system": system,
        "load_at_start": float(load),
        "wall_s": round(wall, 1),
        "memory": peaks,
        "memory_by_call": memory.by_call(),
    }
    meta = json.loads((Path(config["data"]["path"]) / "_meta.json").read_text())
    row["achievable_auc"] = meta["achievable_auc"]
    if system == "reference":
        summary = json.loads((out / "reference_summary.json").read_text())
        row.update(
            samples_per_s=summary["samples_per_second"], auc=summary["auc"], rows=summary["sparse_rows"]
        )
    else:
        summary = json.loads((out / "run_summary.json").read_text())
        chunks = summary["extra"]["chunks"]
        row.update(
            samples_per_s=round(summary["throughput"]),
            steady_samples_per_s=round(summary["steady_throughput"]),
            fifths=fifths(chunks),
            auc=summary["auc"],
            steps=summary["steps"],
            rows=sum(sum(shard["rows"].values()) for shard in summary["ps"]),
            table_gib=round(sum(shard["bytes"] for shard in summary["ps"]) / 2**30, 2),
            checkpoint_s=summary["extra"].get("checkpoint_seconds"),
        )
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a dataset directory (heterps data synth)")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["admit2"])
    parser.add_argument("--plan", default=str(REPO / "configs" / "plans" / "one_stage_big.json"))
    parser.add_argument("--reference", action="store_true", help="alternate with the one-process loop")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--table-memory-gb", type=float, help="each type's table memory (a bigger table)")
    parser.add_argument(
        "--checkpoint-interval-s", type=float, help="runtime.checkpoint_interval_s of the job"
    )
    parser.add_argument("--train-steps", type=int, help="runtime.train_steps of the job (a shorter run)")
    parser.add_argument(
        "--ps-hosting", choices=["auto", "actors"], help="runtime.ps_hosting (actors: the table apart)"
    )
    parser.add_argument("--trace", type=Path, help="folder for each run's RSS samples, by process (JSON)")
    parser.add_argument("--result", type=Path, help="JSON file for the rows")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="criteo-epoch-"))
    systems = [("reference", "admit2")] if args.reference else []
    systems += [(f"train:{s}", s) for s in args.settings]
    rows = []
    for r in range(args.rounds):
        for system, setting in systems if r % 2 == 0 else systems[::-1]:
            runtime: dict[str, Any] = {}
            if args.checkpoint_interval_s is not None:
                runtime["checkpoint_interval_s"] = args.checkpoint_interval_s
            if args.train_steps:
                runtime["train_steps"] = args.train_steps
            if args.ps_hosting:
                runtime["ps_hosting"] = args.ps_hosting
            job = write_job(workdir, args.data, setting, SETTINGS[setting], args.table_memory_gb, runtime)
            trace = None
            if args.trace:
                args.trace.mkdir(parents=True, exist_ok=True)
                trace = args.trace / f"{r + 1}-{system.replace(':', '-')}.json"
            rows.append({"round": r + 1, "setting": setting, **run(system, job, args.plan, trace)})
    if args.result:
        args.result.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
