"""Benchmark: samples/s of the heterps_ray pipeline against (a) the one-process reference trainer and
(b) Ray Train's TorchTrainer with DDP (2 CPU workers, gloo), on the same model and data, side by
side in one run on the same machine, alternating systems over `--rounds` rounds (medians reported).

Model: CTR-DNN (26 slots, embedding dim 9, FC 512-256-128-32, batch 512). Data: synthetic
Criteo-like rows whose 26 slots each draw from 1M distinct values. The DDP baseline holds the 26
tables of 1M rows as one `nn.Embedding(26M, 9, sparse=True)` (slot offsets, keys mod 1M) with
sparse Adagrad, dense Adam; the reference and the pipeline create rows lazily on first pull.

    ../shared/bench/quiet.sh && .venv/bin/python benchmarks/bench_runtime.py --rows 200000 --steps 200 --rounds 2

Windows of a few hundred batches last 1-2 s, and on this host such a window moves by more than 10%; for
the plain-loop ratio take 1,200-batch windows (BENCHMARKS.md, issue 41):

    .venv/bin/python benchmarks/bench_runtime.py --rows 1000000 --steps 1200 --warmup 150 --rounds 3 \
        --only reference sync:one_stage_big --data /tmp/br1m/data

Pipeline systems are named `<mode>:<plan file in configs/plans>`, e.g. `sync:one_stage_big`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

# Ray Train V1 code path: V2's controller looks Ray up by address and failed here when other Ray
# instances ran on the same machine ("Found multiple active Ray instances").
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "0")
REPO = Path(__file__).resolve().parents[1]
ROWS_PER_TABLE = 1_000_000
NUM_SLOTS = 26


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic rows (train + eval)")
    parser.add_argument("--steps", type=int, default=120, help="measured batches per system")
    parser.add_argument("--warmup", type=int, default=20, help="batches run before measuring")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "bench_runtime" / "data")
    parser.add_argument("--output", type=Path, default=REPO / "runs" / "bench_runtime" / "results.json")
    parser.add_argument("--only", nargs="*", default=DEFAULT_SYSTEMS, help="systems, in round order")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all systems (alternating)")
    parser.add_argument("--logs", action="store_true", help="show the actors' and Ray Train workers' logs")
    parser.add_argument("--cluster", type=Path, default=REPO / "configs" / "clusters" / "local.yaml")
    args = parser.parse_args()
    args.data, args.output = args.data.resolve(), args.output.resolve()  # Ray Train wants absolute paths

    _make_data(args.data, args.rows)
    import ray

    from heterps_ray.cluster import SYSTEM_CONFIG
    from heterps_ray.config import load_cluster

    cluster = load_cluster(args.cluster)
    ray.init(
        num_cpus=2,
        resources=cluster.local_resources(),
        object_store_memory=1 << 30,
        include_dashboard=False,
        log_to_driver=args.logs,
        configure_logging=False,
        _system_config=SYSTEM_CONFIG,  # as heterps' own embedded Ray
    )
    results: dict[str, Any] = {
        "rows": args.rows,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "systems": {},
    }
    for round_index in range(args.rounds):
        order = args.only if round_index % 2 == 0 else list(reversed(args.only))
        for name in order:
            load = os.getloadavg()[0]
            print(f"--- round {round_index + 1}: {name} (load average {load:.2f})", flush=True)
            result = _runner(name)(args)
            result["load_before"] = round(load, 2)
            results["systems"].setdefault(name, []).append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)
    ray.shutdown()
    medians = {n: statistics.median(r["samples_per_s"] for r in runs) for n, runs in results["systems"].items()}
    results["median_samples_per_s"] = medians
    base, ddp = medians.get("reference"), medians.get("ddp")
    print(f"\n{'system':<52} {'samples/s':>10} {'x reference':>12} {'x Ray Train DDP':>16}")
    for name in args.only:
        rate = medians[name]
        label = results["systems"][name][0]["label"]
        print(
            f"{label:<52} {rate:>10,.0f} {rate / base if base else float('nan'):>12.2f} "
            f"{rate / ddp if ddp else float('nan'):>16.2f}"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


def _make_data(path: Path, rows: int) -> None:
    from heterps_ray.data.layout import is_dataset
    from heterps_ray.data.synth import SynthSpec, synthesize

    if is_dataset(path):
        return
    spec = SynthSpec(vocab_min=ROWS_PER_TABLE, vocab_max=ROWS_PER_TABLE)
    synthesize(path, rows, seed=0, rows_per_part=25_000, spec=spec)


def _job(args: argparse.Namespace, mode: str, **runtime: Any) -> Any:
    from heterps_ray.config import load_job

    return load_job(
        REPO / "configs" / "jobs" / "quickstart.yaml",
        {
            "data.path": str(args.data),
            "cluster": str(args.cluster.resolve()),
            "data.synth_rows": None,
            "batch_size": args.batch_size,
            "mode": mode,
            "output_dir": str(args.output.parent / f"run_{mode}"),
            "runtime.micro_batches": 1,
            "runtime.max_in_flight": 4,
            **{f"runtime.{k}": v for k, v in runtime.items()},
        },
    )


def run_reference(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from heterps_ray.data.dataset import Dataset
    from heterps_ray.models import build_model
    from heterps_ray.runtime.reference import ReferenceTrainer

    job = _job(args, "sync")
    torch.set_num_threads(2)
    trainer = ReferenceTrainer(build_model(job.model), job.optimizer, seed=job.seed)
    batches = Dataset(args.data).iter_batches("train", args.batch_size)
    for _ in range(args.warmup):
        trainer.train_step(next(batches))
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        trainer.train_step(next(batches))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "label": "reference (1 process, 2 threads)",
        "samples_per_s": args.steps * args.batch_size / seconds,
        "seconds": seconds,
        "profile": {"cpu_ms_per_batch": {"reference": round(cpu * 1e3 / args.steps, 2)}},
    }


def _run_pipeline(
    args: argparse.Namespace, mode: str, plan_name: str, runtime: dict[str, int]
) -> dict[str, Any]:
    from heterps_ray.costmodel.plan import load_plan
    from heterps_ray.runtime.driver import train

    plan = load_plan(REPO / "configs" / "plans" / f"{plan_name}.json")
    cpu = _CpuPerProcess()
    summary = train(
        _job(args, mode, **runtime),
        plan,
        steps=args.warmup + args.steps,
        progress=False,
        overwrite=True,
        on_chunk=cpu,
    )
    # wall time between the first chunk boundary after the warm-up and the last one: everything the
    # driver does between chunks (stats, progress, tracking) counts, as it does for a user
    samples, seconds = cpu.rate_after(args.warmup, args.batch_size)
    stages = " | ".join(
        f"{s['layers'][0]}..{s['layers'][-1]}@{s['type']}x{s['replicas']}" for s in summary.stages
    )
    return {
        "label": f"pipeline {mode}, {plan_name} ({stages})"
        + "".join(f", {k}={v}" for k, v in runtime.items()),
        "samples_per_s": samples / seconds,
        "seconds": seconds,
        "auc": summary.auc,
        "profile": {
            "stage_busy": {
                f"s{s['index']} {'+'.join(s['layers'])} on {s['type']}": round(s["busy"], 3)
                for s in summary.stages
            },
            "cpu_ms_per_batch": cpu.per_batch(),
            "data_worker_wait_s": summary.extra["data_wait_s"],
            "train_seconds": summary.seconds,
            "ps": [{k: p[k] for k in ("rows", "pulls", "pushes", "keys_per_s", "busy")} for p in summary.ps],
        },
    }


class _CpuPerProcess:
    """An ``on_chunk`` hook: CPU time (user + system) of every actor process, the raylet and the
    driver between the first and the last chunk boundary, per batch trained in between."""

    def __init__(self) -> None:
        self.first: tuple[int, dict[str, float]] | None = None
        self.last: tuple[int, dict[str, float]] | None = None
        self.procs: dict[str, Any] = {}
        self.boundaries: list[tuple[int, float]] = []  # (batches done, perf_counter) per chunk end

    def __call__(self, live: Any) -> None:
        import psutil
        import ray

        self.boundaries.append((live.step, time.perf_counter()))
        if not self.procs:
            actors = [("data", w) for w in live.data_workers] + [
                (f"stage{s + 1}", w) for s, replicas in enumerate(live.stage_workers) for w in replicas
            ]
            actors += [("ps", s) for s in live.shards if isinstance(s, ray.actor.ActorHandle)]
            for n, (role, actor) in enumerate(actors):
                self.procs[f"{role}#{n}"] = psutil.Process(ray.get(actor.describe.remote())["pid"])
            self.procs["driver"] = psutil.Process()
            for proc in psutil.process_iter(["name"]):
                if proc.info["name"] in ("raylet", "gcs_server"):
                    self.procs[proc.info["name"]] = proc
        now = {}
        for name, proc in self.procs.items():
            times = proc.cpu_times()
            now[name] = times.user + times.system
        if self.first is None:
            self.first = (live.step, now)
        self.last = (live.step, now)

    def rate_after(self, warmup: int, batch_size: int) -> tuple[int, float]:
        """(samples, seconds) between the first boundary at or after `warmup` batches and the last."""
        after = [b for b in self.boundaries if b[0] >= warmup]
        if len(after) < 2:
            raise SystemExit(f"too few chunks after {warmup} warm-up batches: raise --steps")
        (s0, t0), (s1, t1) = after[0], after[-1]
        return (s1 - s0) * batch_size, t1 - t0

    def per_batch(self) -> dict[str, float]:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return {}
        batches = self.last[0] - self.first[0]
        out = {k: round((self.last[1][k] - self.first[1][k]) * 1e3 / batches, 2) for k in self.first[1]}
        out["total"] = round(sum(out.values()), 2)
        return out


def _ddp_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: 26 x 1M-row sparse embeddings + the CTR-DNN MLP, wrapped in DDP."""
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    from heterps_ray.config import ModelConfig
    from heterps_ray.data.dataset import Dataset, partition_files
    from heterps_ray.models import build_model, loss_fn

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    spec = build_model(ModelConfig(name="ctr_dnn"))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(NUM_SLOTS * ROWS_PER_TABLE, spec.embedding_dim, sparse=True)
            torch.nn.init.uniform_(self.emb.weight, -spec.embedding_init_scale, spec.embedding_init_scale)
            self.dense = spec.build(0, spec.num_layers, seed=0)

        def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
            return self.dense((dense, self.emb(ids)))[0]

    net = Net()
    model = prepare_model(net)  # DDP over gloo; `net` keeps the parameters it wraps
    sparse_opt = torch.optim.Adagrad([net.emb.weight], lr=0.05, initial_accumulator_value=0.1)
    dense_opt = torch.optim.Adam(net.dense.parameters(), lr=1e-3)
    offsets = torch.arange(NUM_SLOTS, dtype=torch.int64) * ROWS_PER_TABLE
    dataset = Dataset(config["data"])
    files = partition_files(dataset.files("train"), world, rank)
    batches = dataset.iter_batches("train", config["batch_size"] // world, files=files)

    def step() -> None:
        batch = next(batches)
        keys = torch.from_numpy(batch["keys"].view(np.uint64) % np.uint64(ROWS_PER_TABLE)).long() + offsets
        logit = model(keys, torch.from_numpy(batch["dense"]))
        loss = loss_fn(logit, torch.from_numpy(batch["label"]))
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()

    for _ in range(config["warmup"]):
        step()
    t0 = time.perf_counter()
    for _ in range(config["steps"]):
        step()
    seconds = time.perf_counter() - t0
    samples = config["steps"] * (config["batch_size"] // world)
    # one file per worker (same machine), so the driver sees every worker's time, not only rank 0's
    Path(config["out"], f"ddp_rank{rank}.json").write_text(
        json.dumps({"seconds": seconds, "samples": samples})
    )
    ray.train.report({"seconds": seconds, "samples": samples})


def run_ddp(args: argparse.Namespace) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = args.output.parent / "ddp"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("ddp_rank*.json"):
        old.unlink()
    trainer = TorchTrainer(
        _ddp_loop,
        train_loop_config={
            "data": str(args.data),
            "batch_size": args.batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "out": str(out),
        },
        scaling_config=ScalingConfig(
            num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}, trainer_resources={"CPU": 0}
        ),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(args.output.parent / "ray_train"), name="ddp"),
    )
    trainer.fit()
    workers = [json.loads(f.read_text()) for f in sorted(out.glob("ddp_rank*.json"))]
    if len(workers) != 2:
        raise RuntimeError(f"expected 2 DDP worker reports in {out}, found {len(workers)}")
    seconds = max(w["seconds"] for w in workers)  # the step is synchronous: the slowest worker sets the pace
    return {
        "label": "Ray Train TorchTrainer DDP (2 x 1 CPU, gloo)",
        "samples_per_s": sum(w["samples"] for w in workers) / seconds,
        "seconds": seconds,
    }


DEFAULT_SYSTEMS = [
    "reference",
    "sync:one_stage_big",
    "async:one_stage_big",
    "sync:one_stage_small",
    "sync:two_stage",
    "async:two_stage:batches_ahead=1",
    "sync:quickstart",
    "async:quickstart_async",
    "ddp",
]


def _runner(name: str) -> Any:
    """The function that measures system `name` (reference, ddp, or `<mode>:<plan>`)."""
    if name == "reference":
        return run_reference
    if name == "ddp":
        return run_ddp
    mode, plan_name, *settings = name.split(":")
    if mode not in ("sync", "async") or not (REPO / "configs" / "plans" / f"{plan_name}.json").exists():
        raise SystemExit(
            f"--only: unknown system {name!r}; use reference, ddp or "
            "<sync|async>:<plan in configs/plans>[:<runtime setting>=<int>...]"
        )
    runtime = {k: int(v) for k, v in (item.split("=", 1) for item in settings)}
    return lambda args: _run_pipeline(args, mode, plan_name, runtime)


if __name__ == "__main__":
    main()
