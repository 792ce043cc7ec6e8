"""Soak benchmark (issue 41; BENCHMARKS.md "Reliability", "The soak"): long sync training on Criteo-shaped
data with delta checkpoints, a fault every few minutes in turn (a DataWorker, a PS shard, a StageWorker,
then the driver followed by ``--resume``), against the same batches trained undisturbed from the same seed.
Every minute it samples each process's RSS (the driver, Ray's daemons, each actor by class), the rate and
the checkpoint chain; it writes one JSON and one PNG (RSS, rate and chain over time, the faults marked).

    .venv/bin/heterps data synth --rows 4000000 --shape criteo-kaggle --seed 0 -o /tmp/ck4m
    ../shared/bench/quiet.sh && .venv/bin/python benchmarks/bench_soak.py --data /tmp/ck4m --minutes 60 \\
        --fault-every-min 5 --out /tmp/soak

`bench_soak.py --out /tmp/soak report` measures the faults and judges again from a finished hour's
files (soak.json and the progress records), without running it again.

The training runs in a child process of its own session (``bench_soak.py child``), as a user's driver:
the driver fault SIGKILLs its process group (its embedded Ray with it) and starts it again with
``resume``. The actor faults are armed by the child at its next chunk boundary (``train(on_chunk=...)``,
heterps_ray.chaos.FaultPoints): the actor SIGKILLs itself inside its next training call. The batch count
comes from a short undisturbed probe of the rate, so that the undisturbed run lasts ``--minutes``.

Checked (the issue's "Done when"): no batch lost or applied twice; the final model equals the
undisturbed one (dense and sparse weights within 1e-6, the same AUC within 1e-6); after the first 10
minutes each process's RSS within 10% and the rate within 10% of the undisturbed run's; the time lost
per fault (median, worst), from the progress records: from the fault until the run is back at the
batch it had reached.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PLAN = REPO / "configs" / "plans" / "small_three_stage.json"  # 3 stages (two StageWorkers), 2 PS shards
MODEL = {"name": "ctr_dnn", "embedding_dim": 8, "hidden": [64, 32]}
FAULTS = ("data_worker", "ps_shard", "stage_worker", "driver")  # in turn
SYNC_ATOL = 1e-6


def _log(*parts: Any) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


# -- the child: one training process ---------------------------------------------------------------------


class ChunkHook:
    """``train(on_chunk=...)`` of the child: each chunk boundary appends (time, step) to the progress log,
    and arms the actor that each new request file in `requests` names (it dies in its next train call)."""

    def __init__(self, progress: Path, requests: Path):
        self.progress, self.requests = progress, requests

    def __call__(self, live: Any) -> None:
        import ray

        with open(self.progress, "a") as f:
            f.write(json.dumps({"t": time.time(), "step": live.step, "pid": os.getpid()}) + "\n")
        for request in sorted(self.requests.glob("*.request")):
            kind = request.stem.split("-", 1)[1]
            victim = {
                "data_worker": lambda: live.data_workers[0],
                "ps_shard": lambda: live.shards[0],
                "stage_worker": lambda: live.stage_workers[0][0],
            }[kind]()
            ray.get(victim.arm_fault.remote("train", "sigkill"))
            request.rename(request.with_suffix(".armed"))
            with open(self.progress, "a") as f:
                f.write(json.dumps({"t": time.time(), "step": live.step, "armed": kind}) + "\n")


def child(args: argparse.Namespace) -> int:
    from heterps_ray.config import load_job
    from heterps_ray.costmodel.plan import load_plan
    from heterps_ray.runtime.driver import train

    job = load_job(args.job)
    hook = ChunkHook(args.progress, args.requests)
    train(job, load_plan(PLAN), progress=False, resume=True, start_if_none=True, on_chunk=hook)
    return 0


# -- the parent --------------------------------------------------------------------------------------------


def _write_job(folder: Path, name: str, data: Path, steps: int, args: argparse.Namespace) -> Path:
    job = {
        "name": f"soak-{name}",
        "model": MODEL,
        "cluster": str(REPO / "configs" / "clusters" / "local.yaml"),
        "data": {"path": str(data)},
        "batch_size": args.batch_size,
        "samples": 100_000_000,
        "throughput_min": 0,
        "mode": "sync",
        "seed": args.seed,
        "output_dir": str(folder / name),
        "runtime": {
            "epochs": 1000,  # the data looped; train_steps ends the run
            "train_steps": steps,
            "ps_hosting": "actors",  # shards of their own, to be killed
            "micro_batches": 2,
            "max_in_flight": 2,
            "checkpoint_every": 0,
            "checkpoint_interval_s": args.checkpoint_s,
            "max_restarts": 1000,
        },
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


class Child:
    """The training process (`bench_soak.py child`), in a session of its own; started again with resume."""

    def __init__(self, job: Path, progress: Path, requests: Path, log: Path):
        self.job, self.progress, self.requests, self.log = job, progress, requests, log
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        cmd = [sys.executable, __file__, "child", "--job", str(self.job), "--progress", str(self.progress),
               "--requests", str(self.requests)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, env=env,
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)  # fmt: skip

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


def _rss_by_process(root: int) -> dict[str, float]:
    """MiB of RSS of the process `root` and everything under it, by role: the driver, each actor class
    (its largest process), Ray's daemons."""
    out: dict[str, float] = {}
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            name = "driver" if proc.pid == root else proc.name()
            rss = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
        name = name.removeprefix("ray::").split(".")[0]  # an actor's title names its call: ray::PSShard.pull
        if name.startswith(("DataWorker", "StageWorker", "PSShard", "driver", "raylet", "gcs_server")):
            out[name] = max(out.get(name, 0.0), round(rss, 1))
    return out


def _chain(output_dir: Path) -> dict[str, int]:
    """The newest checkpoint's chain length (1: a full one) and the checkpoint directories on disk."""
    steps = sorted(output_dir.glob("checkpoints/step-*/manifest.json"))
    if not steps:
        return {"chain": 0, "on_disk": 0}
    newest = max(steps, key=lambda p: int(p.parent.name.split("-")[1]))
    manifest = json.loads(newest.read_text())
    return {"chain": len(manifest.get("chain") or []) + 1, "on_disk": len(steps)}


def _progress(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rate_per_minute(records: list[dict[str, Any]], t0: float, batch: int) -> list[tuple[float, float]]:
    """(minute, samples/s) from the progress records: the steps gained in each minute, a step counted
    once (a rollback's replayed batches are no gain)."""
    out, best = [], 0
    by_minute: dict[int, int] = {}
    for rec in records:
        if "step" in rec and "armed" not in rec and rec["step"] > best:
            minute = int((rec["t"] - t0) // 60)
            by_minute[minute] = by_minute.get(minute, 0) + rec["step"] - best
            best = rec["step"]
    for minute in range(max(by_minute, default=-1) + 1):
        out.append((minute + 0.5, by_minute.get(minute, 0) * batch / 60.0))
    return out


def _run(job: Path, out: Path, faults_every_s: float | None, args: argparse.Namespace) -> dict[str, Any]:
    """One run to its end: sampled every `args.sample_s`; with `faults_every_s`, a fault in turn (the
    time each cost priced at `args.rate`, the undisturbed samples/s)."""
    progress, requests = out / f"{job.stem}.progress.jsonl", out / f"{job.stem}.requests"
    requests.mkdir(exist_ok=True)
    t0 = time.time()
    run = Child(job, progress, requests, out / f"{job.stem}.log")
    samples, faults = [], []
    next_sample, next_fault, n = t0, (t0 + faults_every_s) if faults_every_s else None, 0
    output_dir = out / job.stem
    while True:
        code = run.proc.poll()
        now = time.time()
        if code is not None:
            if code != 0:
                raise RuntimeError(f"{job.stem}: the training process exited {code}; see {run.log}")
            break
        if now >= next_sample:
            samples.append({"t": now - t0, "rss_mib": _rss_by_process(run.proc.pid), **_chain(output_dir)})
            next_sample += args.sample_s
        if next_fault is not None and now >= next_fault:
            kind = FAULTS[n % len(FAULTS)]
            reached = max((r["step"] for r in _progress(progress) if "armed" not in r), default=0)
            fault = {"kind": kind, "t": now - t0, "step": reached}
            if kind == "driver":
                run.kill()
                _log(f"  driver SIGKILLed at step {reached}")
                time.sleep(2.0)  # its Ray processes go with its group
                run.start()
            else:
                (requests / f"{n:03d}-{kind}.request").write_text("")
                _log(f"  {kind} to die in its next call (after step {reached})")
            faults.append(fault)
            n += 1
            next_fault += faults_every_s or 0.0
        time.sleep(1.0)
    wall = time.time() - t0
    logged = _progress(progress)
    measure_faults(faults, logged, args.batch_size / args.rate if args.rate else 0.0)
    records = [r for r in logged if "armed" not in r]
    summary = json.loads((output_dir / "run_summary.json").read_text())
    extra = summary["extra"]
    return {
        "wall_s": round(wall, 1),
        "steps": summary["steps"],
        "auc": summary["auc"],
        "batches": [extra.get("batches_applied"), extra.get("batches_lost"), extra.get("batches_duplicated")],
        "recoveries": len(extra.get("faults") or []),
        "starts": run.starts,
        "faults": faults,
        "samples": samples,
        "rate_per_minute": _rate_per_minute(records, t0, args.batch_size),
    }


def measure_faults(faults: list[dict[str, Any]], progress: list[dict[str, Any]], step_s: float) -> None:
    """The seconds each fault cost, from the progress records (one per chunk boundary, with the armed
    records among them): from where the run stood when the fault struck (an actor's: the chunk boundary
    it was armed at, it dies in the next chunk; the driver's: its last record before the kill) until it
    passes that batch again, less the time (`step_s` a batch, undisturbed) the batches beyond it took.
    Where the recovery rolled back to a checkpoint at that very batch, this is the recovery and one
    chunk; a fault never armed (the run ended first) gets None. Sets lost_s, from_step, went_back_to."""
    armed = iter([i for i, r in enumerate(progress) if "armed" in r])  # actor faults are armed in order
    for fault in faults:
        if fault["kind"] == "driver":  # the last record of the killed process at the batch it reached
            first = next((i for i, r in enumerate(progress) if r.get("step") == fault["step"]), None)
            stood = first if first is None else max(
                i for i, r in enumerate(progress[first:], first)
                if r.get("pid") == progress[first].get("pid") and r.get("step") == fault["step"]
            )  # fmt: skip
        else:
            stood = next(armed, None)
        fault.update(lost_s=None, from_step=None, went_back_to=None)
        if stood is None:
            continue
        start = progress[stood]
        after = [r for r in progress[stood + 1 :] if "armed" not in r]
        passed = next((r for r in after if r["step"] > start["step"]), None)
        if passed is None:
            continue
        fault.update(
            lost_s=round(passed["t"] - start["t"] - (passed["step"] - start["step"]) * step_s, 1),
            from_step=start["step"],
            went_back_to=min([start["step"], *(r["step"] for r in after[: after.index(passed)])]),
        )


def _model_diff(a: Path, b: Path) -> float:
    """The largest absolute difference between two saved models' dense and sparse weights (inf where
    their rows differ)."""
    from heterps_ray.runtime.checkpoint import load_checkpoint

    ca, cb = load_checkpoint(a), load_checkpoint(b)
    da, db = ca.net.state_dict(), cb.net.state_dict()
    dense = max(float((da[k] - db[k]).abs().max()) for k in da)
    sa, sb = ca.table.state(), cb.table.state()
    if not np.array_equal(sa["keys"], sb["keys"]):
        return float("inf")
    return max(dense, float(np.abs(sa["weights"] - sb["weights"]).max()))


def _steady(run: dict[str, Any], settle_min: float) -> tuple[dict[str, list[float]], list[float]]:
    """After `settle_min` minutes: each process's RSS samples, and the rate of each whole minute that no
    fault touched (from a fault until a minute after the run is back where it was)."""
    rss: dict[str, list[float]] = {}
    for sample in run["samples"]:
        if sample["t"] >= settle_min * 60:
            for name, mib in sample["rss_mib"].items():
                rss.setdefault(name, []).append(mib)
    touched = [(f["t"] / 60, (f["t"] + (f.get("lost_s") or 0.0)) / 60 + 1.0) for f in run["faults"]]
    rates = [r for m, r in run["rate_per_minute"][:-1]  # the last minute is partial
             if m >= settle_min and not any(a - 0.5 <= m <= b + 0.5 for a, b in touched)]  # fmt: skip
    return rss, rates


def _growth(values: list[float]) -> float | None:
    """How far a process's RSS moved over the steady window: the median of its last 3 samples over the
    median of its first 3 (a restart's fresh process is a dip, not growth)."""
    if len(values) < 6 or min(values) <= 0:
        return None
    return round(statistics.median(values[-3:]) / statistics.median(values[:3]) - 1.0, 3)


def verdict(faulted: dict[str, Any], calm: dict[str, Any], diff: float, settle_min: float) -> dict[str, Any]:
    rss, rates = _steady(faulted, settle_min)
    _, calm_rates = _steady(calm, settle_min)
    growth = {name: g for name, v in rss.items() if (g := _growth(v)) is not None}
    lost = [f["lost_s"] for f in faulted["faults"] if f["lost_s"] is not None]
    rate_ratio = statistics.median(rates) / statistics.median(calm_rates) if rates and calm_rates else None
    return {
        "batches_ok": faulted["batches"][1:] == [0, 0] and faulted["steps"] == calm["steps"],
        "max_abs_model_diff": diff,
        "auc_diff": abs((faulted["auc"] or 0.0) - (calm["auc"] or 0.0)),
        "model_equal": diff <= SYNC_ATOL and abs((faulted["auc"] or 0.0) - (calm["auc"] or 0.0)) <= SYNC_ATOL,
        "rss_growth_after_settle": growth,
        "rss_within_10pct": all(abs(g) <= 0.10 for g in growth.values()) if growth else None,
        "steady_minutes": [len(rates), len(calm_rates)],
        "steady_rate_ratio": rate_ratio,
        "rate_within_10pct": abs(rate_ratio - 1.0) <= 0.10 if rate_ratio is not None else None,
        "lost_s_median": statistics.median(lost) if lost else None,
        "lost_s_worst": max(lost) if lost else None,
        "lost_s_by_kind": {k: [f["lost_s"] for f in faulted["faults"] if f["kind"] == k] for k in FAULTS},
    }


def plot(faulted: dict[str, Any], calm: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_rate, ax_chain) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    names = sorted({n for s in faulted["samples"] for n in s["rss_mib"]})
    for name in names:
        points = [(s["t"] / 60, s["rss_mib"][name]) for s in faulted["samples"] if name in s["rss_mib"]]
        ax_rss.plot(*zip(*points, strict=True), marker=".", label=name)
    ax_rss.set_ylabel("RSS, MiB (largest process of each role)")
    ax_rss.legend(fontsize=7, ncol=3)
    for run, label in ((faulted, "with faults"), (calm, "undisturbed")):
        if run["rate_per_minute"]:
            ax_rate.plot(*zip(*run["rate_per_minute"], strict=True), marker=".", label=label)
    ax_rate.set_ylabel("samples/s, per minute")
    ax_rate.legend(fontsize=8)
    ax_chain.step([s["t"] / 60 for s in faulted["samples"]], [s["chain"] for s in faulted["samples"]],
                  where="post", label="newest checkpoint's chain")  # fmt: skip
    ax_chain.step([s["t"] / 60 for s in faulted["samples"]], [s["on_disk"] for s in faulted["samples"]],
                  where="post", label="checkpoints on disk")  # fmt: skip
    ax_chain.set_ylabel("checkpoints")
    ax_chain.set_xlabel("minutes")
    ax_chain.legend(fontsize=8)
    for fault in faulted["faults"]:
        for ax in (ax_rss, ax_rate, ax_chain):
            ax.axvline(fault["t"] / 60, color="grey", alpha=0.3, lw=0.8)
        ax_rate.annotate(fault["kind"], (fault["t"] / 60, 0), rotation=90, fontsize=6, va="bottom")
    fig.suptitle("heterps_ray soak: sync training under a fault every few minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _probe_rate(data: Path, out: Path, args: argparse.Namespace) -> float:
    """Samples/s of the job undisturbed, from a short run (its steady chunks)."""
    job = _write_job(out, "probe", data, args.probe_steps, args)
    run = _run(job, out, None, args)
    rates = [r for _, r in run["rate_per_minute"]]
    records = _progress(out / "probe.progress.jsonl")
    steps = [r for r in records if "armed" not in r]
    if len(steps) >= 3:  # from the second chunk boundary on
        return (steps[-1]["step"] - steps[1]["step"]) * args.batch_size / (steps[-1]["t"] - steps[1]["t"])
    return max(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part")
    kid = sub.add_parser("child", help="(internal) one training process")
    kid.add_argument("--job", type=Path, required=True)
    kid.add_argument("--progress", type=Path, required=True)
    kid.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--data", type=Path, help="a dataset directory (heterps data synth), looped")
    parser.add_argument("--out", type=Path, default=Path("/tmp/soak"))
    parser.add_argument("--minutes", type=float, default=60.0, help="length of the undisturbed run")
    parser.add_argument("--fault-every-min", type=float, default=5.0)
    parser.add_argument(
        "--sample-s", type=float, default=60.0, help="RSS and checkpoint chain sampled this often"
    )
    parser.add_argument("--checkpoint-s", type=float, default=60.0, help="runtime.checkpoint_interval_s")
    parser.add_argument("--settle-min", type=float, default=10.0, help="RSS and rate judged after this")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--probe-steps", type=int, default=300, help="batches of the rate probe")
    parser.add_argument("--seed", type=int, default=0)
    sub.add_parser("report", help="measure the faults and judge again from a finished soak's --out folder")
    args = parser.parse_args(argv)
    if args.part == "child":
        return child(args)
    if args.part == "report":
        return report(args.out.resolve(), args.settle_min)
    if args.data is None:
        parser.error("--data is required")
    out = args.out.resolve()
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    args.rate = 0.0  # not known before the probe
    rate = args.rate = _probe_rate(args.data.resolve(), out, args)
    steps = int(rate * args.minutes * 60 / args.batch_size)
    _log(f"rate probe: {rate:,.0f} samples/s: {steps} batches for {args.minutes:g} minutes undisturbed")
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "probe_rate": rate,
                               "steps": steps, "load_before": os.getloadavg()}  # fmt: skip
    _log("with faults")
    faulted = _run(
        _write_job(out, "faulted", args.data.resolve(), steps, args), out, args.fault_every_min * 60, args
    )
    _log("undisturbed")
    calm = _run(_write_job(out, "calm", args.data.resolve(), steps, args), out, None, args)
    diff = _model_diff(out / "faulted" / "model", out / "calm" / "model")
    results.update(
        faulted=faulted,
        calm=calm,
        verdict=verdict(faulted, calm, diff, args.settle_min),
        load_after=os.getloadavg(),
    )
    (out / "soak.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(faulted, calm, out / "soak.png")
    print(json.dumps(results["verdict"], indent=2))
    _log(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0


def report(out: Path, settle_min: float) -> int:
    """Measure the faults and judge again from `out`'s soak.json and progress records (the hour is not
    run again); rewrites soak.json and soak.png."""
    results = json.loads((out / "soak.json").read_text())
    faulted, calm = results["faulted"], results["calm"]
    step_s = int(results["args"]["batch_size"]) / results["probe_rate"]
    measure_faults(faulted["faults"], _progress(out / "faulted.progress.jsonl"), step_s)
    results["verdict"] = verdict(faulted, calm, results["verdict"]["max_abs_model_diff"], settle_min)
    (out / "soak.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(faulted, calm, out / "soak.png")
    print(json.dumps(results["verdict"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
