"""Benchmark: a Criteo-shaped epoch with the PS shard's rows mostly on local disk (issue 42).

`heterps train` of the quickstart job over a dataset's training rows, one PS shard in an actor of its
own (so its process holds the table and nothing else), once with every row in RAM and once with the
shard's RAM budget a quarter (``--over``) of that run's table (``table.ram_mb``; the rest in
``table.disk_dir`` under a temporary folder of this machine's disk), alternating, ``--rounds`` times.
The first in-RAM run sets the budget. Per run: samples/s (whole run and steady), eval AUC, the shard
process's peak RSS and its RSS at the first sample (before the table grew), and the disk tier's
counters (hit rate, rows read back, written back, file bytes). With ``--cold`` a third setting, the
disk tier with its file dropped from the page cache every ``--drop-every-s`` (``posix_fadvise
DONTNEED`` from this process): misses then read the device, as on a node whose free memory is smaller
than the file.

    heterps data synth --rows 1000000 --shape criteo-kaggle --seed 0 -o /tmp/ck1m
    ../shared/bench/quiet.sh && .venv/bin/python benchmarks/bench_disk_tier.py --data /tmp/ck1m --rounds 2 --cold
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_criteo_epoch import REPO, run, write_job  # noqa: E402

SHARD = "ray::PSShard"  # the process name of a PS shard actor (Ray names it after the class)


class CacheDropper:
    """Drop the disk tier's files under `folder` from the page cache every `every_s` seconds."""

    def __init__(self, folder: Path, every_s: float):
        self.folder, self.every_s, self.drops = folder, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drop, daemon=True)
        self._thread.start()

    def _drop(self) -> None:
        while not self._stop.wait(self.every_s):
            for path in self.folder.rglob("rows.*.dat"):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:  # compacted away meanwhile
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            self.drops += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.drops


class ShardMemory:
    """Peak and first-seen RSS of this machine's PS shard actors, sampled every `every_s`."""

    def __init__(self, every_s: float = 0.2):
        self.every_s = every_s
        self.first: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            for proc in psutil.process_iter(["name", "memory_info"]):
                try:
                    if not (proc.info["name"] or "").startswith(SHARD):
                        continue
                    rss = proc.info["memory_info"].rss
                except (psutil.Error, AttributeError):
                    continue
                self.first.setdefault(proc.pid, rss)
                self.peak[proc.pid] = max(self.peak.get(proc.pid, 0), rss)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        if not self.peak:
            return {}
        pid = max(self.peak, key=lambda p: self.peak[p])
        return {
            "shard_peak_rss_mib": round(self.peak[pid] / 2**20, 1),
            "shard_first_rss_mib": round(self.first[pid] / 2**20, 1),
        }


def one_run(
    workdir: Path, data: Path, plan: str, name: str, table: dict[str, Any], runtime: dict[str, Any],
    drop_every_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    job = write_job(workdir, data, name, table, None, runtime)
    memory = ShardMemory()
    dropper = CacheDropper(Path(table["disk_dir"]), drop_every_s) if drop_every_s else None
    row = run(f"train:{name}", job, plan)
    row.update(memory.stop())
    if dropper:
        row["page_cache_drops"] = dropper.stop()
    summary = json.loads(
        (Path(yaml.safe_load(job.read_text())["output_dir"]) / "run_summary.json").read_text()
    )
    (shard,) = summary["ps"]
    row["table_mib"] = round(shard["bytes"] / 2**20, 1)
    disk = shard.get("disk", {}).get("embedding")
    if disk:
        looked = disk["disk_hits"] + disk["disk_misses"]
        row["disk"] = {**disk, "hit_rate": round(disk["disk_hits"] / max(looked, 1), 4)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a dataset directory (heterps data synth)")
    parser.add_argument("--plan", default=str(REPO / "configs" / "plans" / "one_stage_big.json"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--over", type=float, default=4.0, help="the table's size over the shard's RAM budget"
    )
    parser.add_argument("--train-steps", type=int, help="runtime.train_steps (a shorter run)")
    parser.add_argument(
        "--cold", action="store_true", help="also the disk tier with its file out of the page cache"
    )
    parser.add_argument("--drop-every-s", type=float, default=0.5, help="with --cold: seconds between drops")
    parser.add_argument("--result", type=Path, help="JSON file for the rows")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="disk-tier-"))
    runtime: dict[str, Any] = {"ps_hosting": "actors", "ps_shards": 1, "checkpoint_interval_s": 0}
    if args.train_steps:
        runtime["train_steps"] = args.train_steps
    rows: list[dict[str, Any]] = []
    ram_mb = 0.0
    systems = ("ram", "disk", "disk-cold") if args.cold else ("ram", "disk")
    for r in range(args.rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:
            table: dict[str, Any] = {"admit_after": 1}
            if system != "ram":
                table.update(disk_dir=str(workdir / "rows"), ram_mb=ram_mb)
            drop = args.drop_every_s if system == "disk-cold" else 0.0
            row = one_run(workdir, args.data, args.plan, system, table, runtime, drop)
            if system == "ram" and not ram_mb:
                ram_mb = round(row["table_mib"] / args.over, 1)
            row.update(round=r + 1, ram_budget_mib=ram_mb if system != "ram" else None)
            print(json.dumps(row), flush=True)
            rows.append(row)
    by = {s: [x for x in rows if x["system"] == f"train:{s}"] for s in systems}
    ratios = {
        s: [round(d["samples_per_s"] / m["samples_per_s"], 3) for d, m in zip(by[s], by["ram"], strict=True)]
        for s in systems[1:]
    }
    print(json.dumps({"rate_ratio_over_ram": ratios, "ram_budget_mib": ram_mb}))
    if args.result:
        args.result.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
