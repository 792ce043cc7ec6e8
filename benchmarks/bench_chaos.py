"""Chaos benchmark: long ctr_dnn runs on synthetic data with many faults at seeded random times, checked
against undisturbed runs of the same job. Grows bench_faults.py (one fault per run; removed, `git show
003cffa:scripts/bench_faults.py`) into the "Chaos run" of BENCHMARKS.md "Reliability". Three parts, each
runnable alone:

    .venv/bin/python benchmarks/bench_chaos.py --part actors --mode sync  [--minutes 10 --runs 2 --seed 0]
    .venv/bin/python benchmarks/bench_chaos.py --part actors --mode async [--minutes 10 --runs 2 --seed 0]
    .venv/bin/python benchmarks/bench_chaos.py --part driver [--seed 0]
    .venv/bin/python benchmarks/bench_chaos.py --part nodes  [--seed 0]
    .venv/bin/python benchmarks/bench_chaos.py --part report       # the tables of what benchmarks/bench_chaos/chaos.json holds

actors: an embedded local Ray; ctr_dnn (embedding 8, hidden 64-32), 3 stages, 2 PS shards as actors
(ps_hosting "actors"); per mode `--runs` faulted runs of the same job, `--minutes` of training in all
(the batch count sized from a short probe of the rate), and the undisturbed run(s) of that job (sync:
one, async: two). In each faulted run, actors are armed (heterps_ray.chaos.FaultPoints, through
``train(on_chunk=...)``) at seeded random steps, one at a time, so that each dies inside its next call
of a phase: training ("train") or writing a checkpoint ("checkpoint"); and at the last chunk boundary
several at once for the phases after the last batch (evaluate: the DataWorker, then a PS shard, then a
StageWorker, as the calls reach them; save: a DataWorker or StageWorker, then a PS shard). How: the
actor SIGKILLs its own process there, or it blocks there and this script `ray.kill`s it.
Sync: the model must equal the undisturbed one (largest absolute difference over dense and sparse
weights <= 1e-6) with every batch applied exactly once; async: AUC within 0.002 of the median of the
two undisturbed runs, updates lost counted.

driver: `heterps run` (exact scheduler on a hand-priced problem, so no profiling) as a subprocess in a
session of its own, SIGKILLed with its process group at seeded random times after a checkpoint, then
`heterps run --resume`d, twice; compared with an undisturbed `heterps run` of the same job.

nodes: a real two-node local Ray (tests/helpers.py LocalRayCluster: head with cpu_small, a `ray start`
node with cpu_big, ten times cheaper, so the plan lives there); `heterps run` against it; after a
checkpoint the node is killed (a node leaving: re-plan onto cpu_small), after the re-plan a new node
with cpu_big joins (re-plan back); compared with an undisturbed run on the same cluster. One
DataWorker in every plan, as sync resume requires.

Every part merges its figures into benchmarks/bench_chaos/chaos.json (--results) and prints Markdown tables.
Times are wall seconds on whatever machine it runs on.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml

from heterps_ray.cluster import init_kwargs
from heterps_ray.config import JobConfig, load_cluster
from heterps_ray.costmodel.plan import Plan, load_plan
from heterps_ray.data.layout import is_dataset
from heterps_ray.data.synth import synthesize
from heterps_ray.runtime.checkpoint import load_checkpoint
from heterps_ray.runtime.driver import RunSummary, train

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # LocalRayCluster lives with the tests

QUIET = Path("/tmp/heterps_quiet")
KINDS = ("ps_shard", "data_worker", "stage_worker")
HOWS = ("sigkill", "ray.kill")
TRAIN_POINTS = ("train", "checkpoint")  # phases while training; evaluate and save come after the last batch
BATCH = 128
MODEL = {"name": "ctr_dnn", "embedding_dim": 8, "hidden": [64, 32]}
SYNC_ATOL = 1e-6
ASYNC_AUC_TOL = 0.002


def _wait_quiet() -> None:
    """Another engineer's measurement needs the machine: wait between runs while the file exists."""
    while QUIET.exists():
        time.sleep(10)


def _log(*parts: Any) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def _merge_results(path: Path, key: str, value: Any) -> None:
    """results[key] = value in the JSON file at `path`, under a lock (parts may run side by side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[key] = value
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)


def _against_calm(work: Path, out: Path, steps: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The faulted run in `out` against the undisturbed one in work/calm: (its summary, the calm summary,
    the outcome fields of a result: AUCs, batch counts, model difference and ok)."""
    summary = json.loads((out / "run_summary.json").read_text())
    calm_summary = json.loads((work / "calm" / "run_summary.json").read_text())
    diff = _model_diff(work / "calm" / "model", out / "model")
    extra = summary["extra"]
    batches = [extra["batches_applied"], extra["batches_lost"], extra["batches_duplicated"]]
    ok = bool(
        diff["same_keys"] and diff["max_abs"] <= SYNC_ATOL and summary["steps"] == steps and batches == [steps, 0, 0]
    )
    outcome = {"auc": summary["auc"], "auc_undisturbed": calm_summary["auc"], "batches": batches, "model_diff": diff, "ok": ok}
    return summary, calm_summary, outcome


def _model_diff(a: Path, b: Path) -> dict[str, Any]:
    """Largest absolute differences between two saved models (output_dir/model)."""
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    da, db = ca.net.state_dict(), cb.net.state_dict()
    dense = max(float(np.max(np.abs(da[k].numpy() - db[k].numpy()))) for k in da)
    sa, sb = ca.table.state(), cb.table.state()
    same_keys = bool(np.array_equal(sa["keys"], sb["keys"]))
    if same_keys:
        sparse = float(np.max(np.abs(sa["weights"] - sb["weights"])))
        accum = float(np.max(np.abs(sa["accumulators"] - sb["accumulators"])))
    else:  # compare by key
        ia = {int(k): i for i, k in enumerate(sa["keys"])}
        common = [(ia[int(k)], j) for j, k in enumerate(sb["keys"]) if int(k) in ia]
        ra, rb = np.array([c[0] for c in common]), np.array([c[1] for c in common])
        sparse = float(np.max(np.abs(sa["weights"][ra] - sb["weights"][rb]))) if common else math.inf
        accum = float(np.max(np.abs(sa["accumulators"][ra] - sb["accumulators"][rb]))) if common else math.inf
    return {
        "max_abs_dense": dense,
        "max_abs_sparse": sparse,
        "max_abs_accumulators": accum,
        "max_abs": max(dense, sparse),
        "same_keys": same_keys,
        "rows": [len(sa["keys"]), len(sb["keys"])],
    }


# -- part "actors": faults inside the actors' calls ------------------------------------------------------


@dataclass
class Injection:
    """One planned fault: `kind`'s actor (replica 0) armed at the first chunk boundary from step `at`
    (None: at the last boundary, for evaluate and save) to die inside its next call of `point`."""

    kind: str
    how: str  # sigkill | ray.kill
    point: str  # train | checkpoint | evaluate | save
    at: int | None
    index: int = 0  # which PS shard / which stage's StageWorker (stage index - 1)
    armed_at: int | None = None
    fired: bool = False
    record: dict[str, Any] | None = field(default=None, repr=False)

    def victim(self, live: Any) -> Any:
        return {
            "ps_shard": lambda: live.shards[self.index],
            "data_worker": lambda: live.data_workers[0],
            "stage_worker": lambda: live.stage_workers[self.index][0],
        }[self.kind]()

    def slot(self, live: Any) -> Any:
        return self.victim(live)


class ChaosSchedule:
    """An ``on_chunk`` hook running a list of Injections: the training ones one at a time (the next is
    armed only once the previous actor was replaced), those after the last batch (at None) together at
    the last chunk boundary. An actor armed with how "ray.kill" blocks inside the call (chaos.py "wait")
    and a thread here kills it once its flag file appears."""

    def __init__(self, injections: list[Injection], target: int, flag_dir: Path):
        self.training = sorted([i for i in injections if i.at is not None], key=lambda i: i.at or 0)
        self.after = [i for i in injections if i.at is None]
        self.target, self.flag_dir = target, flag_dir
        self.pending: tuple[Injection, Any] | None = None
        self.end_armed = False
        self.stop = threading.Event()
        self.live: Any = None
        self.armed_handles: list[tuple[Injection, Any]] = []
        self._n = 0

    def __call__(self, live: Any) -> None:
        self.live = live
        if self.pending is not None:
            inj, handle = self.pending
            if inj.slot(live) is not handle:  # replaced: it died where it was armed
                inj.fired = True
                self.pending = None
        if self.pending is None:
            nxt = next((i for i in self.training if i.armed_at is None), None)
            if nxt is not None and nxt.at is not None and live.step >= nxt.at and live.step < self.target:
                self.pending = (nxt, self._arm(nxt, live))
        if not self.end_armed and live.step >= self.target:
            self.end_armed = True
            for inj in self.after:
                self.armed_handles.append((inj, self._arm(inj, live)))

    def _arm(self, inj: Injection, live: Any) -> Any:
        victim = inj.victim(live)
        self._n += 1
        flag = self.flag_dir / f"{self._n:03d}-{inj.kind}-{inj.point}.flag"
        how = "sigkill" if inj.how == "sigkill" else "wait"
        ray.get(victim.arm_fault.remote(inj.point, how, str(flag)))
        inj.armed_at = live.step
        _log(f"  armed {inj.kind} {inj.point} {inj.how} at step {live.step}")
        if how == "wait":
            threading.Thread(target=self._kill_when_inside, args=(victim, flag), daemon=True).start()
        return victim

    def _kill_when_inside(self, victim: Any, flag: Path) -> None:
        while not self.stop.is_set():
            if flag.exists():
                ray.kill(victim, no_restart=True)
                return
            time.sleep(0.01)

    def finish(self) -> None:
        self.stop.set()
        if self.pending is not None and self.live is not None:
            inj, handle = self.pending
            inj.fired = inj.slot(self.live) is not handle
        if self.live is not None:
            for inj, handle in self.armed_handles:
                inj.fired = inj.slot(self.live) is not handle


def _actors_job(data: Path, out: Path, mode: str, every: int, epochs: int, max_restarts: int) -> JobConfig:
    runtime: dict[str, Any] = {
        "micro_batches": 2,
        "max_in_flight": 2,
        "checkpoint_every": every,
        "ps_hosting": "actors",  # PS shards as actors of their own, so that they can be killed
        "epochs": epochs,
        "max_restarts": max_restarts,
    }
    if mode == "async":
        runtime.update(micro_batches=1, max_staleness=0)  # one DataWorker, staleness 0: repeatable
    return JobConfig.model_validate(
        {
            "name": f"bench-chaos-{mode}",
            "model": MODEL,
            "cluster": load_cluster(REPO / "configs" / "clusters" / "local.yaml").model_dump(),
            "data": {"path": str(data)},
            "batch_size": BATCH,
            "samples": 100_000,
            "throughput_min": 0,
            "mode": mode,
            "output_dir": str(out),
            "seed": 0,
            "runtime": runtime,
        }
    )


def _actors_plan() -> Plan:
    raw = load_plan(REPO / "configs" / "plans" / "small_three_stage.json").to_dict()  # 3 stages, 1 each
    raw["ps_shards"] = 2
    return Plan.from_dict(raw)


def _end_injections(mode: str, run: int) -> list[Injection]:
    """The faults after the last batch of faulted run `run`. Evaluation reaches the DataWorker first,
    then the PS shards (its pulls), then the StageWorkers (predict), so all three can die there one
    after the other; saving asks the DataWorker and the StageWorkers together, then the PS shards. An
    actor that dies is replaced by an unarmed one, so the actors armed for saving are others than
    those armed for evaluation: PS shard 1, and the DataWorker or the last stage's StageWorker. Kinds
    and hows alternate over runs and modes."""
    flip = (run + (mode == "async")) % 2
    a, b = HOWS[flip], HOWS[1 - flip]
    evaluate = [
        Injection("ps_shard", b, "evaluate", None, index=0),
        Injection("stage_worker", a, "evaluate", None, index=0),
    ]
    if flip:  # the DataWorker dies while it saves
        return [*evaluate, Injection("data_worker", b, "save", None), Injection("ps_shard", a, "save", None, 1)]
    return [
        Injection("data_worker", a, "evaluate", None),
        *evaluate,
        Injection("stage_worker", b, "save", None, index=1),
        Injection("ps_shard", a, "save", None, index=1),
    ]


def _training_injections(rng: random.Random, runs: int, steps: int, every: int) -> list[list[Injection]]:
    """Every kind x training phase x how (12 faults) over the runs, each at a seeded random step between
    the first checkpoint and 85% of the run."""
    combos = [(k, p, h) for k in KINDS for p in TRAIN_POINTS for h in HOWS]
    rng.shuffle(combos)
    out: list[list[Injection]] = [[] for _ in range(runs)]
    for n, (kind, point, how) in enumerate(combos):
        out[n % runs].append(Injection(kind, how, point, 0))
    for injections in out:
        times = sorted(rng.randint(every + 1, int(0.85 * steps)) for _ in injections)
        for inj, at in zip(injections, times, strict=True):
            inj.at = at
    return out


def _same_actor(inj: Injection, actor: dict[str, Any]) -> bool:
    """A recovery's dead actor (kind, stage, replica) is the one `inj` armed."""
    if inj.kind != actor["kind"]:
        return False
    if inj.kind == "ps_shard":
        return int(actor["replica"]) == inj.index
    if inj.kind == "stage_worker":
        return int(actor["stage"]) == inj.index + 1 and int(actor["replica"]) == 0
    return int(actor["replica"]) == 0


def _label(inj: Injection) -> str:
    if inj.kind == "ps_shard":
        return f"ps_shard {inj.index}"
    if inj.kind == "stage_worker":
        return f"stage_worker s{inj.index + 1}"
    return "data_worker 0"


def _match(injections: list[Injection], faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pairs each recovery of the run summary with the injection it came from (same kind and phase, in
    order); a recovery matching none is listed as unplanned (a finding), an injection matching none as
    not fired."""
    phase_of = {"train": "train", "checkpoint": "train", "evaluate": "evaluate", "save": "save"}
    rows = []
    used: set[int] = set()
    for f in faults:
        for actor in f["actors"]:
            found = None
            for n, inj in enumerate(injections):
                if n not in used and _same_actor(inj, actor) and phase_of[inj.point] == f["phase"]:
                    found = n
                    break
            if found is not None:
                used.add(found)
                inj = injections[found]
            rows.append(
                {
                    "kind": actor["kind"],
                    "actor": f"{actor['kind']} {actor['stage']}/{actor['replica']}",
                    "how": injections[found].how if found is not None else "unplanned",
                    "point": injections[found].point if found is not None else f["phase"],
                    "armed_at": injections[found].armed_at if found is not None else None,
                    "seen_as": actor["how"],
                    "phase": f["phase"],
                    "step": f["step"],
                    "rolled_back_to": f["rolled_back_to"],
                    "recovery_s": f["recovery_s"],
                    "batches_replayed": f["batches_replayed"],
                    "updates_lost": f["updates_lost"],
                    "lower_bound": f["lower_bound"],
                    "actors_in_recovery": len(f["actors"]),
                }
            )
    for n, inj in enumerate(injections):
        if n not in used:
            rows.append(
                {"kind": inj.kind, "actor": _label(inj), "how": inj.how, "point": inj.point, "armed_at": inj.armed_at,
                 "phase": None, "not_fired": True}
            )  # fmt: skip
    return rows


def _summary_figures(run: RunSummary, wall: float) -> dict[str, Any]:
    extra = run.extra
    ck = float(sum(extra.get("checkpoint_seconds") or []))
    return {
        "steps": run.steps,
        "samples": run.samples,
        "train_s": run.seconds,
        "wall_s": wall,
        "auc": run.auc,
        "logloss": run.logloss,
        "checkpoints": len(extra.get("checkpoints") or []),
        "checkpoint_s": ck,
        "checkpoint_overhead": ck / run.seconds if run.seconds else None,
        "batches_applied": extra.get("batches_applied"),
        "batches_lost": extra.get("batches_lost"),
        "batches_duplicated": extra.get("batches_duplicated"),
        "updates": extra.get("updates"),
        "restarts": extra.get("restarts"),
        "output_dir": run.output_dir,
    }


def _start_ray(attempts: int = 4) -> None:
    """An embedded local Ray declaring the cluster's resource types, as the tests' one; on a loaded
    machine its start can time out: tried again."""
    cluster = load_cluster(REPO / "configs" / "clusters" / "local.yaml")
    for attempt in range(attempts):
        try:
            ray.init(**init_kwargs(cluster))
            return
        except Exception as exc:
            _log(f"ray start failed ({exc}); attempt {attempt + 1} of {attempts}")
            ray.shutdown()
            if attempt == attempts - 1:
                raise
            time.sleep(10)


def part_actors(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    out = args.out / f"actors-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    data = args.out / f"data-{args.rows}"
    with open(args.out / "data.lock", "w") as lock:  # both modes may start side by side
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_dataset(data):
            synthesize(data, args.rows, seed=2, rows_per_part=max(args.rows // 4, 1))
    train_rows = int(args.rows * 0.9)
    per_epoch = train_rows // BATCH
    _start_ray()
    rng = random.Random(f"{args.seed}-{mode}")
    max_restarts = 100
    try:
        steps = args.steps
        probe_rate = None
        if steps is None:  # size the runs from the steady rate of a short probe
            _wait_quiet()
            probe = train(
                _actors_job(data, out / "probe", mode, args.every, 1, max_restarts),
                _actors_plan(), steps=min(400, per_epoch), progress=False, save=False,
            )  # fmt: skip
            probe_rate = (probe.steady_throughput or probe.throughput) / BATCH
            steps = int(1.2 * probe_rate * args.minutes * 60 / args.runs)  # 20% over: the rate varies
            steps = max(steps - steps % args.every, 2 * args.every)
            _log(f"{mode}: probe {probe_rate:.1f} batches/s -> {args.runs} runs of {steps} batches")
        epochs = math.ceil(steps / per_epoch) + 1

        def job(name: str) -> JobConfig:
            return _actors_job(data, out / name, mode, args.every, epochs, max_restarts)

        calm_runs = []
        for n in range(1 if mode == "sync" else 2):
            _wait_quiet()
            _log(f"{mode}: undisturbed run {n} ({steps} batches)")
            t0 = time.perf_counter()
            calm = train(job(f"calm-{n}"), _actors_plan(), steps=steps, progress=False, overwrite=True)
            calm_runs.append(_summary_figures(calm, time.perf_counter() - t0))
            _log(f"  auc {calm.auc:.6f}, {calm.seconds:.0f} s training")
        calm_auc = statistics.median(c["auc"] for c in calm_runs)
        chaos_runs = []
        training = _training_injections(rng, args.runs, steps, args.every)
        for r in range(args.runs):
            _wait_quiet()
            injections = training[r] + _end_injections(mode, r)
            flags = out / f"flags-{r}"
            flags.mkdir(exist_ok=True)
            for f in flags.glob("*.flag"):
                f.unlink()
            schedule = ChaosSchedule(injections, steps, flags)
            _log(f"{mode}: faulted run {r}: " + ", ".join(f"{i.kind}/{i.point}/{i.how}@{i.at}" for i in injections))
            t0 = time.perf_counter()
            error = None
            try:
                run = train(
                    job(f"chaos-{r}"), _actors_plan(), steps=steps, progress=False, overwrite=True,
                    on_chunk=schedule,
                )  # fmt: skip
            except Exception as exc:  # a fault the runtime did not survive: a finding, reported
                error = f"{type(exc).__name__}: {exc}"
                _log(f"  FAILED: {error}")
                run = None
            finally:
                schedule.finish()
            wall = time.perf_counter() - t0
            entry: dict[str, Any] = {"run": r, "error": error, "planned": len(injections)}
            if run is not None:
                entry.update(_summary_figures(run, wall))
                entry["faults"] = _match(injections, run.extra["faults"])
                if mode == "sync":
                    entry["model_diff"] = _model_diff(Path(calm_runs[0]["output_dir"]) / "model", out / f"chaos-{r}" / "model")
                    entry["ok"] = bool(
                        entry["model_diff"]["same_keys"]
                        and entry["model_diff"]["max_abs"] <= SYNC_ATOL
                        and (run.extra["batches_applied"], run.extra["batches_lost"], run.extra["batches_duplicated"]) == (steps, 0, 0)
                        and run.steps == steps
                    )  # fmt: skip
                else:
                    entry["auc_diff"] = abs(run.auc - calm_auc)
                    entry["ok"] = bool(entry["auc_diff"] <= ASYNC_AUC_TOL and run.steps == steps)
                entry["updates_lost"] = sum(f.get("updates_lost", 0) for f in entry["faults"])
                _log(f"  ok={entry['ok']} {len(run.extra['faults'])} recoveries, auc {run.auc:.6f}, "
                     f"{run.seconds:.0f} s training, {wall:.0f} s wall")  # fmt: skip
            else:
                entry["ok"] = False
                entry["wall_s"] = wall
            chaos_runs.append(entry)
        result = {
            "mode": mode,
            "seed": args.seed,
            "rows": args.rows,
            "steps_per_run": steps,
            "every": args.every,
            "probe_batches_per_s": probe_rate,
            "max_restarts": max_restarts,
            "undisturbed": calm_runs,
            "undisturbed_auc_median": calm_auc,
            "faulted": chaos_runs,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        result["totals"] = _actors_totals(result)
        return result
    finally:
        ray.shutdown()


def _actors_totals(result: dict[str, Any]) -> dict[str, Any]:
    runs = result["faulted"]
    fired = [f for r in runs for f in r.get("faults", []) if not f.get("not_fired")]
    calm = result["undisturbed"][0]
    lost = [r["wall_s"] - calm["wall_s"] for r in runs if r.get("steps")]
    per_run_faults = [len([f for f in r.get("faults", []) if not f.get("not_fired")]) for r in runs]
    return {
        "planned": sum(r["planned"] for r in runs),
        "fired": len(fired),
        "not_fired": sum(1 for r in runs for f in r.get("faults", []) if f.get("not_fired")),
        "unplanned": sum(1 for f in fired if f["how"] == "unplanned"),
        "survived": sum(n for r, n in zip(runs, per_run_faults, strict=True) if r["ok"]),
        "runs_ok": sum(1 for r in runs if r["ok"]),
        "runs": len(runs),
        "faulted_train_s": sum(r.get("train_s", 0.0) for r in runs),
        "undisturbed_train_s": [c["train_s"] for c in result["undisturbed"]],
        "time_lost_per_fault_s": sum(lost) / max(sum(per_run_faults), 1),
        "recovery_s_mean": statistics.mean(f["recovery_s"] for f in fired) if fired else None,
        "batches_replayed": sum(f["batches_replayed"] for f in fired),
        "updates_lost": sum(f["updates_lost"] for f in fired),
        "checkpoint_overhead_undisturbed": [c["checkpoint_overhead"] for c in result["undisturbed"]],
        "checkpoint_overhead_faulted": [r.get("checkpoint_overhead") for r in runs],
        "by_kind": {k: sum(1 for f in fired if f["kind"] == k) for k in KINDS},
        "by_point": {p: sum(1 for f in fired if f["point"] == p) for p in ("train", "checkpoint", "evaluate", "save")},
    }


# -- part "driver": heterps run SIGKILLed and resumed ---------------------------------------------------


def _hand_problem(folder: Path, big_price: float = 0.5, small_instances: int = 1) -> Path:
    """A hand-priced problem of the job's ctr_dnn on the two local types (no profiling). `small_instances`
    of cpu_small: with more than one, cpu_small holds a plan alone beside the PS shard."""

    def layer(name: str, rows: int = 0) -> dict[str, Any]:
        return {
            "name": name,
            "out_bytes_per_sample": 64,
            "sparse_rows_per_sample": rows,
            "parallel_fraction": 0.5,
            "time_ms": {
                "cpu_small": {"fixed": 0.5, "per_sample": 0.01},
                "cpu_big": {"fixed": 0.5, "per_sample": 0.008},
            },
        }

    problem = {
        "name": "chaos ctr_dnn on two local cpu types (hand-priced)",
        "batch_size": BATCH,
        "samples": 1_000_000,
        "throughput_min": 0,
        "input_bytes_per_sample": 160,
        "resources": [
            {"name": "cpu_small", "device": "cpu", "price_per_hour": 0.2, "max_instances": small_instances, "bandwidth_gbps": 10},
            {"name": "cpu_big", "device": "cpu", "price_per_hour": big_price, "max_instances": 1, "bandwidth_gbps": 10},
        ],  # fmt: skip
        "ps": {"resource": "cpu_small", "rows_per_second_per_shard": 2.0e6, "min_shards": 1},
        "layers": [layer("embedding", 26), layer("fc1"), layer("fc2"), layer("logit")],
    }
    path = folder / "problem.yaml"
    path.write_text(yaml.safe_dump(problem))
    return path


def _run_job_file(folder: Path, name: str, data: Path, cluster: str, steps: int, every: int) -> Path:
    job = {
        "name": name,
        "model": MODEL,
        "cluster": cluster,
        "data": {"path": str(data)},
        "batch_size": BATCH,
        "samples": 1_000_000,
        "throughput_min": 0,
        "mode": "sync",
        "scheduler": "exact",
        "seed": 7,
        "output_dir": str(folder / name),
        "runtime": {
            "epochs": 20,
            "train_steps": steps,
            "checkpoint_every": every,
            "micro_batches": 2,
            "max_in_flight": 2,
        },
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*/manifest.json"))


class _HeterpsRun:
    """`heterps run ARGS` as a subprocess in a session of its own (its embedded Ray's processes in its
    process group), output appended to `log`. On a loaded machine Ray's start can time out: a run that
    exits for that reason, before it did anything, is started again (up to 3 times)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.args, self.log = args, log
        self.env = env if env is not None else {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.starts = 0
        self._start()

    def _start(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.starts += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "heterps_ray", "run", *self.args, "--no-progress"],
            cwd=REPO, start_new_session=True, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=self.env,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code not in (None, 0) and self.starts < 4:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                text = f.read().decode(errors="replace")
            if "timed out during startup" in text:
                _log(f"  heterps run: Ray's start timed out; starting it again ({self.starts})")
                time.sleep(5)
                self._start()
                return None
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.2)


def _heterps_run(args: list[str], log: Path, env: dict[str, str] | None = None) -> _HeterpsRun:
    return _HeterpsRun(args, log, env)


def part_driver(args: argparse.Namespace) -> dict[str, Any]:
    work = args.out / "driver"
    work.mkdir(parents=True, exist_ok=True)
    data = args.out / "data-driver"
    if not is_dataset(data):
        synthesize(data, 60_000, seed=4, rows_per_part=15_000)
    problem = _hand_problem(work)
    cluster = str(REPO / "configs" / "clusters" / "local.yaml")
    steps, every = args.driver_steps, args.driver_every
    rng = random.Random(f"{args.seed}-driver")
    calm_file = _run_job_file(work, "calm", data, cluster, steps, every)
    chaos_file = _run_job_file(work, "chaos", data, cluster, steps, every)
    for name in ("calm", "chaos"):
        subprocess.run(["rm", "-rf", str(work / name)], check=True)
    _wait_quiet()
    _log(f"driver: undisturbed heterps run ({steps} batches)")
    t0 = time.perf_counter()
    calm = _heterps_run([str(calm_file), "--problem", str(problem)], work / "calm.log")
    assert calm.wait() == 0, (work / "calm.log").read_text()[-3000:]
    calm_wall = time.perf_counter() - t0
    _wait_quiet()
    out = work / "chaos"
    kills = []
    t_all = time.perf_counter()
    proc = _heterps_run([str(chaos_file), "--problem", str(problem)], work / "chaos.log")
    for n in range(args.driver_kills):
        t_seg = time.perf_counter()
        done_before = _checkpoint_steps(out)
        need = (done_before[-1] if done_before else 0) + every  # a checkpoint newer than the resume point
        while not (_checkpoint_steps(out) and _checkpoint_steps(out)[-1] >= need):
            if proc.poll() is not None:
                raise RuntimeError(f"heterps run ended ({proc.returncode}) before kill {n}: " + (work / "chaos.log").read_text()[-3000:])
            time.sleep(0.05)
        delay = rng.uniform(0.5, 4.0)  # seeded: mid-interval, so batches since the checkpoint are lost
        time.sleep(delay)
        if proc.poll() is not None:
            raise RuntimeError(f"heterps run ended before kill {n}")
        newest = _checkpoint_steps(out)[-1]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.proc.wait(timeout=60)
        killed_at = time.perf_counter()
        _log(f"  driver SIGKILLed (kill {n}) {delay:.1f} s after checkpoint {newest}")
        time.sleep(2.0)  # its Ray processes go with the group
        t_resume = time.perf_counter()
        proc = _heterps_run([str(chaos_file), "--resume"], work / "chaos.log")
        # the resumed run is back once it writes a checkpoint past the one it resumed from
        while not (_checkpoint_steps(out) and _checkpoint_steps(out)[-1] > newest) and proc.poll() is None:
            time.sleep(0.05)
        kills.append(
            {
                "kill": n,
                "seconds_after_checkpoint": delay,
                "rolled_back_to": newest,
                "segment_s": killed_at - t_seg,
                "resume_to_next_checkpoint_s": time.perf_counter() - t_resume,
            }
        )
    code = proc.wait()
    chaos_wall = time.perf_counter() - t_all
    assert code == 0, (work / "chaos.log").read_text()[-3000:]
    summary, calm_summary, outcome = _against_calm(work, out, steps)
    result = {
        "steps": steps,
        "every": every,
        "kills": kills,
        "resumed_from": summary["extra"].get("resumed_from"),
        "undisturbed_wall_s": calm_wall,
        "faulted_wall_s": chaos_wall,
        "time_lost_per_kill_s": (chaos_wall - calm_wall) / max(len(kills), 1),
        **outcome,
        "checkpoint_overhead_undisturbed": sum(calm_summary["extra"].get("checkpoint_seconds") or [])
        / calm_summary["seconds"],
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    _log(f"driver: ok={result['ok']} max abs diff {outcome['model_diff']['max_abs']:.2e}")
    return result


# -- part "nodes": a node leaves, one joins ---------------------------------------------------------------


def part_nodes(args: argparse.Namespace) -> dict[str, Any]:
    from helpers import LocalRayCluster

    work = args.out / "nodes"
    work.mkdir(parents=True, exist_ok=True)
    data = args.out / "data-driver"
    if not is_dataset(data):
        synthesize(data, 60_000, seed=4, rows_per_part=15_000)
    base = yaml.safe_load((REPO / "configs" / "clusters" / "local.yaml").read_text())
    small, big = base["resource_types"]
    big.update(price_per_hour=0.01, torch_threads=1)
    (work / "job_cluster.yaml").write_text(yaml.safe_dump({**base, "name": "chaos-nodes", "resource_types": [small, big]}))
    (work / "head_cluster.yaml").write_text(yaml.safe_dump({**base, "name": "chaos-head", "resource_types": [small]}))
    # cpu_small must hold the plan alone once cpu_big's node has left (as many instances as local.yaml gives it)
    problem = _hand_problem(work, big_price=0.01, small_instances=small["max_instances"])
    steps, every = args.nodes_steps, args.driver_every
    rng = random.Random(f"{args.seed}-nodes")
    files = {n: _run_job_file(work, n, data, str(work / "job_cluster.yaml"), steps, every) for n in ("calm", "chaos")}
    for name in ("calm", "chaos"):
        subprocess.run(["rm", "-rf", str(work / name)], check=True)
    events: list[dict[str, Any]] = []
    cluster = LocalRayCluster(work / "head_cluster.yaml")
    _wait_quiet()
    try:
        cluster.start()
        node = cluster.add_node({"cpu_big": 2})
        env = cluster.env
        _log(f"nodes: undisturbed heterps run on the two-node cluster ({steps} batches)")
        t0 = time.perf_counter()
        calm = _heterps_run([str(files["calm"]), "--address", cluster.address, "--problem", str(problem)], work / "calm.log", env)
        assert calm.wait() == 0, (work / "calm.log").read_text()[-3000:]
        calm_wall = time.perf_counter() - t0
        out = work / "chaos"
        log = work / "chaos.log"
        t_all = time.perf_counter()
        proc = _heterps_run([str(files["chaos"]), "--address", cluster.address, "--problem", str(problem)], log, env)

        def wait_for(check: Any, what: str, timeout: float = 900) -> None:
            deadline = time.monotonic() + timeout
            while not check():
                if proc.poll() is not None:
                    raise RuntimeError(f"heterps run ended ({proc.returncode}) waiting for {what}: {log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out waiting for {what}")
                time.sleep(0.1)

        wait_for(lambda: bool(_checkpoint_steps(out)), "a first checkpoint")
        time.sleep(rng.uniform(0.5, 3.0))
        step = _checkpoint_steps(out)[-1]
        t_leave = time.perf_counter()
        killed = cluster.stop_node(node)
        _log(f"  node with cpu_big SIGKILLed ({killed} processes) after checkpoint {step}")
        wait_for(lambda: log.read_text(errors="replace").count("re-plan:") >= 1, "the re-plan after the leave")
        t_replanned = time.perf_counter()
        after = _checkpoint_steps(out)[-1]
        wait_for(lambda: _checkpoint_steps(out)[-1] > after, "a checkpoint after the re-plan")
        t_trained = time.perf_counter()
        events.append({"event": "node left", "after_checkpoint": step, "replan_s": t_replanned - t_leave,
                       "to_next_checkpoint_s": t_trained - t_leave})  # fmt: skip
        time.sleep(rng.uniform(0.5, 3.0))
        t_join = time.perf_counter()
        cluster.add_node({"cpu_big": 2})
        _log("  a new node with cpu_big joined")
        wait_for(lambda: log.read_text(errors="replace").count("re-plan:") >= 2, "the re-plan after the join")
        t_replanned = time.perf_counter()
        after = _checkpoint_steps(out)[-1]
        wait_for(lambda: _checkpoint_steps(out)[-1] > after, "a checkpoint after the second re-plan")
        events.append({"event": "node joined", "after_checkpoint": after, "replan_s": t_replanned - t_join,
                       "to_next_checkpoint_s": time.perf_counter() - t_join})  # fmt: skip
        code = proc.wait(timeout=1800)
        chaos_wall = time.perf_counter() - t_all
        assert code == 0, log.read_text()[-3000:]
    finally:
        cluster.close()
    summary, _, outcome = _against_calm(work, out, steps)
    report = json.loads((out / "run_report.json").read_text())
    outcome["ok"] = outcome["ok"] and len(report["replans"]) == 2
    result = {
        "steps": steps,
        "every": every,
        "events": events,
        "replans": [{k: r.get(k) for k in ("reason", "old_plan", "new_plan", "checkpoint", "types_now")} for r in report["replans"]],
        "final_stage_types": [s["type"] for s in summary["stages"]],
        "undisturbed_wall_s": calm_wall,
        "faulted_wall_s": chaos_wall,
        "time_lost_per_event_s": (chaos_wall - calm_wall) / 2,
        **outcome,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    _log(f"nodes: ok={result['ok']} max abs diff {outcome['model_diff']['max_abs']:.2e}, replans {len(report['replans'])}")
    return result


# -- tables ---------------------------------------------------------------------------------------------


def print_tables(results: dict[str, Any]) -> None:
    for mode in ("sync", "async"):
        res = results.get(f"actors-{mode}")
        if not res:
            continue
        print(f"\n### {mode}: {res['steps_per_run']} batches per run, checkpoint every {res['every']}\n")
        print("| run | actor | how | phase | armed at | step | rolled back to | recovery s | batches replayed | updates lost |")
        print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|")
        for r in res["faulted"]:
            for f in r.get("faults", []):
                if f.get("not_fired"):
                    print(f"| {r['run']} | {f.get('actor', f['kind'])} | {f['how']} | {f['point']} | {f['armed_at']} | not fired | | | | |")
                    continue
                ge = "≥" if f["lower_bound"] else ""
                print(
                    f"| {r['run']} | {f.get('actor', f['kind'])} | {f['how']} | {f['point']} | {f['armed_at']} | {f['step']} | "
                    f"{f['rolled_back_to']} | {f['recovery_s']:.1f} | {ge}{f['batches_replayed']} | {ge}{f['updates_lost']} |"
                )
        print("\n| run | ok | recoveries | batches applied / lost / dup. | max abs diff | AUC | AUC undisturbed | train s | checkpoint overhead |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|")
        for c in res["undisturbed"]:
            print(f"| undisturbed | | 0 | {c['batches_applied']} / {c['batches_lost']} / {c['batches_duplicated']} | | "
                  f"{c['auc']:.6f} | | {c['train_s']:.0f} | {c['checkpoint_overhead']:.1%} |")  # fmt: skip
        for r in res["faulted"]:
            if r.get("steps") is None:
                print(f"| {r['run']} | FAILED: {r['error']} | | | | | | | |")
                continue
            d = r.get("model_diff", {}).get("max_abs")
            n = len([f for f in r["faults"] if not f.get("not_fired")])
            print(
                f"| {r['run']} | {'yes' if r['ok'] else 'NO'} | {n} | {r['batches_applied']} / {r['batches_lost']} / "
                f"{r['batches_duplicated']} | {'' if d is None else f'{d:.1e}'} | {r['auc']:.6f} | "
                f"{res['undisturbed_auc_median']:.6f} | {r['train_s']:.0f} | {r['checkpoint_overhead']:.1%} |"
            )
        t = res["totals"]
        print(
            f"\ntotals ({mode}): {t['fired']} faults fired of {t['planned']} planned ({t['not_fired']} not fired, "
            f"{t['unplanned']} unplanned), {t['survived']} survived in runs that ended right ({t['runs_ok']}/{t['runs']}); "
            f"training {t['faulted_train_s']:.0f} s faulted; time lost per fault {t['time_lost_per_fault_s']:.1f} s; "
            f"recovery {t['recovery_s_mean'] or 0:.1f} s mean; {t['batches_replayed']} batches replayed, "
            f"{t['updates_lost']} updates lost; checkpoint overhead "
            + ", ".join(f"{x:.1%}" for x in t["checkpoint_overhead_undisturbed"]) + " undisturbed, "
            + ", ".join(f"{x:.1%}" for x in t["checkpoint_overhead_faulted"] if x is not None) + " faulted"
        )
    d = results.get("driver")
    if d:
        print(f"\n### driver: heterps run SIGKILLed and resumed ({d['steps']} batches, checkpoint every {d['every']})\n")
        print("| kill | s after checkpoint | rolled back to | resume to next checkpoint s |")
        print("|---:|---:|---:|---:|")
        for k in d["kills"]:
            print(f"| {k['kill']} | {k['seconds_after_checkpoint']:.1f} | {k['rolled_back_to']} | {k['resume_to_next_checkpoint_s']:.1f} |")
        print(f"\nok={d['ok']}: batches {d['batches']}, max abs diff {d['model_diff']['max_abs']:.1e}, AUC {d['auc']:.6f} "
              f"vs {d['auc_undisturbed']:.6f}; time lost per kill {d['time_lost_per_kill_s']:.1f} s")  # fmt: skip
    n = results.get("nodes")
    if n:
        print(f"\n### nodes: a node leaves, one joins ({n['steps']} batches)\n")
        print("| event | after checkpoint | re-planned in s | to the next checkpoint s |")
        print("|---|---:|---:|---:|")
        for e in n["events"]:
            print(f"| {e['event']} | {e['after_checkpoint']} | {e['replan_s']:.1f} | {e['to_next_checkpoint_s']:.1f} |")
        print(f"\nok={n['ok']}: batches {n['batches']}, max abs diff {n['model_diff']['max_abs']:.1e}, AUC {n['auc']:.6f} "
              f"vs {n['auc_undisturbed']:.6f}, final stages on {n['final_stage_types']}; time lost per event "
              f"{n['time_lost_per_event_s']:.1f} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("actors", "driver", "nodes", "report"), required=True)
    parser.add_argument("--mode", choices=("sync", "async", "both"), default="both", help="part actors")
    parser.add_argument("--minutes", type=float, default=10.0, help="training minutes over the faulted runs of a mode")
    parser.add_argument("--runs", type=int, default=2, help="faulted runs per mode")
    parser.add_argument("--steps", type=int, default=None, help="batches per run (default: sized from --minutes)")
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic rows (90%% train)")
    parser.add_argument("--every", type=int, default=300, help="checkpoint interval (batches)")
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    parser.add_argument("--driver-steps", type=int, default=1200)
    parser.add_argument("--driver-every", type=int, default=100)
    parser.add_argument("--driver-kills", type=int, default=2)
    parser.add_argument("--nodes-steps", type=int, default=3000)  # long enough that the join lands before the end
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_chaos")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "bench_chaos" / "chaos.json")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "actors":
        for mode in ("sync", "async") if args.mode == "both" else (args.mode,):
            _merge_results(args.results, f"actors-{mode}", part_actors(args, mode))
    elif args.part == "driver":
        _merge_results(args.results, "driver", part_driver(args))
    elif args.part == "nodes":
        _merge_results(args.results, "nodes", part_nodes(args))
    print_tables(json.loads(args.results.read_text()) if args.results.exists() else {})


if __name__ == "__main__":
    main()
