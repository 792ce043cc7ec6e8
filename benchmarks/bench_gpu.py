"""Benchmark: the GPU beside its peer. A plain one-process PyTorch loop on the same card against heterps'
best plan, side by side in one run, alternating over `--rounds` rounds, at each batch size (issue 39;
BENCHMARKS.md "The GPU tier"). Medians and ratios are reported; absolute rates only within this run.

* ``plain_gpu``: the CTR-DNN of the job in one process, its table an ``nn.Embedding(sparse=True)`` over
  the data's distinct keys in GPU memory with ``torch.optim.Adagrad``, Adam on the dense net, TF32 off,
  each batch copied from pinned host memory (the keys mapped to rows before timing).
* ``plain_cpu``: the same loop with the table (and its Adagrad) on the CPU: rows copied to the GPU and
  their gradients back every batch.
* ``heterps``: ``heterps run`` of the same job (profile -> fit -> plan by exact -> train; the table where
  the plan puts it: in the GPU's memory for a plan on the GPU type): its steady throughput after the
  warm-up chunk, the model's prediction, the plan, the profile's time, where the table lived and its hit
  rate. The first heterps run profiles; the others plan on that profile (``--problem``).

On a GPU machine (prepared with ``bash ../shared/gpu/prepare.sh``; on it ``source .whl/install.sh``)::

    python3 benchmarks/bench_gpu.py --workdir /tmp/bench_gpu --out bench_gpu.json

On the CPU (CI), tiny, with the cuda type on the CPU under the explicit test flag::

    HETERPS_CUDA_AS_CPU=1 python benchmarks/bench_gpu.py --tiny --workdir /tmp/bench_gpu_tiny

The CPU stand-in for the GPU gap (``--proxy``, issue 49): the same comparison on the CPU, the cuda type
computing there under the test flag, through the device tier's own code. A table-bound job (26 slots x
dim 16, dense 64-32, 450k Criteo-shaped rows): heterps' one-stage plan with its table in the device tier
against the plain loop on the same device, alternating, at batch 2048 and 8192::

    ../shared/bench/quiet.sh && HETERPS_CUDA_AS_CPU=1 python benchmarks/bench_gpu.py --proxy --workdir /tmp/bench_proxy
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The job of the first H200 run (../shared/gpu/h200-2026-12-04/job2m.yaml): CTR-DNN 26 x 16, 1024-1024-512-256.
MODEL = {"name": "ctr_dnn", "embedding_dim": 16, "hidden": [1024, 1024, 512, 256]}
TINY_MODEL = {"name": "ctr_dnn", "embedding_dim": 4, "hidden": [32, 16]}
# --proxy: a table-bound job, where the sparse path is most of a step (issue 49)
PROXY_MODEL = {"name": "ctr_dnn", "embedding_dim": 16, "hidden": [64, 32]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench_gpu")
    parser.add_argument(
        "--out", type=Path, default=None, help="results JSON (default: workdir/bench_gpu.json)"
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="synthetic rows (train + eval)")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=None, help="default: 2048 8192 (64 128 with --tiny)"
    )
    parser.add_argument(
        "--shape", default=None, help="the synthetic data's shape (heterps data synth --shape; "
        "default: default, criteo-kaggle with --proxy)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the systems (alternating order)")
    parser.add_argument(
        "--plain-steps", type=int, default=300, help="timed batches of the plain loop, table on the GPU"
    )
    parser.add_argument(
        "--plain-cpu-steps", type=int, default=100, help="timed batches of it with the table on the CPU"
    )
    parser.add_argument("--gpu-type", default="h200", help="name of the cuda resource type")
    # 2 (as ../shared/gpu/h200-2026-12-04/h200.yaml): at 6, the profile's actors of both types (2 roles
    # each) left no 4 CPUs of the 16 for its PS probe's shard, which waited 120 s for them (2026-12-04)
    parser.add_argument("--gpu-cpus", type=float, default=2.0, help="CPUs a GPU actor asks Ray for")
    parser.add_argument(
        "--readers", type=int, default=6, help="threads converting the GPU DataWorker's data (runtime.readers)"
    )
    parser.add_argument("--cpu-cores", type=int, default=4, help="cores of one actor of the cpu type")
    parser.add_argument(
        "--gpu-threads", type=int, default=None, help="torch threads of the cuda type's actors "
        "(default: 2; 1 with --tiny; every core with --proxy, as the plain loop's torch)",
    )
    parser.add_argument("--systems", nargs="+", default=["plain_gpu", "heterps", "plain_cpu"])
    parser.add_argument("--tiny", action="store_true", help="CI: tiny model and data (CPU)")
    parser.add_argument(
        "--proxy",
        action="store_true",
        help="the CPU stand-in: a table-bound job, heterps' one-stage plan on the cuda type against the plain "
        "loop on the same device (run with HETERPS_CUDA_AS_CPU=1)",
    )
    parser.add_argument(
        "--quick-profile", action="store_true", help="a rough profile (the default with --tiny)"
    )
    parser.add_argument(
        "--full-profile", action="store_true", help="the job's whole profile, also with --tiny"
    )
    parser.add_argument(
        "--min-samples",
        type=int,
        default=6_000_000,
        help="samples each heterps run trains at least (epochs over the data)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.rows, args.plain_steps, args.plain_cpu_steps, args.min_samples = 6_000, 20, 20, 0
    if args.proxy:
        if os.environ.get("HETERPS_CUDA_AS_CPU") != "1":
            parser.error("--proxy runs the cuda type on the CPU: set HETERPS_CUDA_AS_CPU=1")
        args.rows, args.min_samples = max(args.rows // 4, 450_000), min(args.min_samples, 1_500_000)
        args.systems = [s for s in args.systems if s != "plain_cpu"]  # one device: the loop on it is the peer
        # a 2-core machine: one reader, and the profile's actors of both types (2 each) within its CPUs
        args.quick_profile, args.readers, args.gpu_cpus, args.cpu_cores = True, 1, 0.5, 1
        args.shape = args.shape or "criteo-kaggle"
    args.batch_sizes = args.batch_sizes or ([64, 128] if args.tiny else [2048, 8192])
    args.quick_profile = (args.quick_profile or args.tiny) and not args.full_profile
    args.workdir = args.workdir.resolve()
    out = (args.out or args.workdir / "bench_gpu.json").resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)

    import ray
    import torch

    from heterps_ray.cluster import connect
    from heterps_ray.config import JobConfig
    from heterps_ray.data.dataset import prepare_dataset
    from heterps_ray.data.layout import is_dataset
    from heterps_ray.data.synth import SHAPES, SynthSpec, synthesize
    from heterps_ray.devices import claim_device, cuda_seen

    job = JobConfig.model_validate(_job(args, args.batch_sizes[0]))
    device = claim_device(args.gpu_type, "cuda")
    started = time.perf_counter()
    if args.shape and not is_dataset(Path(job.data.path)):
        synthesize(job.data.path, args.rows, seed=job.seed, spec=SynthSpec(**SHAPES[args.shape]))
    dataset = prepare_dataset(job.data, seed=job.seed)
    data_s = time.perf_counter() - started
    train = _load_train(dataset, device)
    connect(job.cluster)
    results: dict[str, Any] = {
        "machine": {"cuda": cuda_seen(), "load_average": os.getloadavg(), "cpus": os.cpu_count(),
                    "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"},
        "args": {k: str(v) for k, v in vars(args).items()},
        "data_seconds": round(data_s, 1),
        "runs": [],
    }  # fmt: skip
    problem: Path | None = None
    try:
        for rnd in range(args.rounds):
            sizes = args.batch_sizes if rnd % 2 == 0 else args.batch_sizes[::-1]
            for batch_size in sizes:
                systems = args.systems if rnd % 2 == 0 else args.systems[::-1]
                for system in systems:
                    if system == "heterps":
                        run, problem = _heterps(args, batch_size, problem, rnd)
                    else:
                        on_gpu = system == "plain_gpu"
                        steps = args.plain_steps if on_gpu else args.plain_cpu_steps
                        run = _plain(train, job, device, batch_size, steps, on_gpu)
                    run.update(system=system, batch_size=batch_size, round=rnd)
                    results["runs"].append(run)
                    print(json.dumps(run), flush=True)
                    out.write_text(json.dumps(results, indent=2, default=str) + "\n")  # so far, if cut short
    finally:
        ray.shutdown()
    results["summary"] = _summary(results["runs"])
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    for line in _table(results["summary"]):
        print(line)
    print(f"wrote {out}")
    return 0


def _job(args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    tiny, cheap_gpu = args.tiny, args.tiny or args.proxy
    gpu = {
        "name": args.gpu_type,
        "device": "cuda",
        "price_per_hour": 0.05 if cheap_gpu else 4.10,
        # tiny, proxy: a second one for the PS shards the planner counts (hosted in the DataWorker: none starts)
        "max_instances": 2 if cheap_gpu else 1,
        "ray_resources": {"CPU": 0.5 if tiny else args.gpu_cpus},
        "num_gpus": 1,
        # proxy: every core of the machine, as the plain loop's torch has
        "torch_threads": args.gpu_threads or (1 if tiny else (os.cpu_count() or 1) if args.proxy else 2),
        "bandwidth_gbps": 50,
        "io_bandwidth_gbps": 8,
        "latency_ms": 0.1,
    }
    cpu = {"name": "cpu", "device": "cpu", "price_per_hour": 0.17, "max_instances": 2 if tiny else 3,
           "ray_resources": {"CPU": 0.5 if cheap_gpu else args.cpu_cores}, "torch_threads": 1 if tiny else args.cpu_cores,
           "bandwidth_gbps": 10, "io_bandwidth_gbps": 4, "latency_ms": 0.2}  # fmt: skip
    epochs = max(1, -(-args.min_samples // int(args.rows * 0.9)))
    return {
        "name": f"bench-gpu-{batch_size}",
        "model": TINY_MODEL if tiny else PROXY_MODEL if args.proxy else MODEL,
        # tiny, proxy: the cuda type alone, so that the plan is its one stage, the table in its device tier
        # (at batch 64 on the CPU the compiled row store beats the tier's ops, and the planner says so)
        "cluster": {"name": "gpu-box", "resource_types": [gpu] if cheap_gpu else [cpu, gpu],
                    "ps": {"resource": gpu["name"] if cheap_gpu else "cpu"}},  # fmt: skip
        "data": {"path": str(args.workdir / "data"), "synth_rows": args.rows},
        "batch_size": batch_size,
        "samples": epochs * int(args.rows * 0.9),  # what a run trains (its cold misses priced over it)
        "throughput_min": 0 if cheap_gpu else 60_000,
        "mode": "sync",
        "scheduler": "exact",
        "output_dir": str(args.workdir / f"run-{batch_size}"),
        "seed": 0,
        # a run long enough for its steady rate (several chunks after the warm-up one)
        "runtime": {"epochs": epochs, "readers": 1 if tiny else args.readers, "op_profile_batches": 5},
    }


# -- the plain loop ---------------------------------------------------------------------------------


def _load_train(dataset: Any, device: Any) -> dict[str, Any]:
    """The train split as the plain loop reads it: each key mapped to a row of one embedding table
    (pandas.factorize over all keys, before any timing), in pinned host memory on a GPU machine."""
    import pandas as pd
    import torch

    batch = dataset.load("train")
    codes, uniques = pd.factorize(batch["keys"].ravel())
    tensors = {
        "rows": torch.from_numpy(codes.astype(np.int64).reshape(batch["keys"].shape)),
        "dense": torch.from_numpy(batch["dense"]),
        "label": torch.from_numpy(batch["label"]),
    }
    if device.type == "cuda":
        tensors = {k: v.pin_memory() for k, v in tensors.items()}
    return {**tensors, "distinct": len(uniques)}


def _plain(
    train: dict[str, Any], job: Any, device: Any, batch_size: int, steps: int, table_on_gpu: bool
) -> dict[str, Any]:
    """One plain loop: `steps` timed batches after a warm-up of 20 (the data wraps around)."""
    import torch

    from heterps_ray.devices import set_precision
    from heterps_ray.models import build_model, loss_fn

    set_precision(device, "fp32")
    spec = build_model(job.model)
    net = spec.build(0, spec.num_layers, job.seed).to(device)
    table_device = device if table_on_gpu else torch.device("cpu")
    table = torch.nn.Embedding(train["distinct"], spec.embedding_dim, sparse=True).to(table_device)
    torch.nn.init.uniform_(table.weight, -spec.embedding_init_scale, spec.embedding_init_scale)
    sparse_opt = torch.optim.Adagrad(table.parameters(), lr=job.optimizer.sparse_lr,
                                     initial_accumulator_value=job.optimizer.sparse_init_accumulator)  # fmt: skip
    dense_opt = torch.optim.Adam(net.parameters(), lr=job.optimizer.dense_lr)
    batches = len(train["label"]) // batch_size
    warmup, losses = 20, []

    def step(i: int) -> None:
        part = slice((i % batches) * batch_size, (i % batches + 1) * batch_size)
        rows = train["rows"][part].to(table_device, non_blocking=True)
        dense = train["dense"][part].to(device, non_blocking=True)
        label = train["label"][part].to(device, non_blocking=True)
        emb = table(rows).to(device, non_blocking=True)
        (logit,) = net((dense, emb))
        loss = loss_fn(logit, label)
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        losses.append(loss.detach())

    for i in range(warmup):
        step(i)
    _sync(device)
    started = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    _sync(device)
    seconds = time.perf_counter() - started
    return {"throughput": steps * batch_size / seconds, "seconds": round(seconds, 3), "steps": steps,
            "last_loss": float(losses[-1])}  # fmt: skip


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- heterps ----------------------------------------------------------------------------------------


def _heterps(
    args: argparse.Namespace, batch_size: int, problem: Path | None, rnd: int
) -> tuple[dict[str, Any], Path]:
    """`heterps run` of the job at `batch_size`: profiled when no problem is given yet."""
    from heterps_ray.closedloop.run import run_job
    from heterps_ray.config import JobConfig

    job = JobConfig.model_validate(_job(args, batch_size))
    job = job.model_copy(update={"output_dir": Path(job.output_dir) / f"round{rnd}"})
    started = time.perf_counter()
    report = run_job(
        job, overwrite=True, progress=False, quick_profile=args.quick_profile, problem_file=problem
    )
    wall = time.perf_counter() - started
    summary = json.loads((Path(report.output_dir) / "run_summary.json").read_text())
    run = {
        "throughput": report.achieved_throughput,
        "predicted": report.predicted_throughput,
        "model_error": report.achieved_throughput / report.predicted_throughput - 1 if report.predicted_throughput else None,
        "plan": report.plan,
        "auc": report.auc,
        "seconds": {**report.seconds, "wall": round(wall, 1)},
        "profiled": problem is None,
        "table": summary["extra"].get("table"),
        "samples": summary["samples"],
        "train_seconds": summary["seconds"],
        "data_wait_s": summary["extra"].get("data_wait_s"),  # blocked on the reader / on gradients
        "data_phases_s": summary["extra"].get("data_phases_s"),  # its training thread: read, pull, compute, ...
        "threads_cpu_ms_per_batch": summary["extra"].get("data_threads_cpu_ms_per_batch"),  # every thread's CPU
        "ops_per_batch": summary["extra"].get("data_ops_per_batch"),  # aten ops, kernels, waits; host/aten ms
    }  # fmt: skip
    return run, problem or Path(report.output_dir) / "problem.yaml"


# -- figures ----------------------------------------------------------------------------------------


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch size: each system's median throughput, heterps over the plain loops, and where a heterps
    batch went (:func:`_where`)."""
    out: dict[str, Any] = {}
    for batch_size in sorted({r["batch_size"] for r in runs}):
        mine = [r for r in runs if r["batch_size"] == batch_size]
        medians = {s: statistics.median(r["throughput"] for r in mine if r["system"] == s)
                   for s in sorted({r["system"] for r in mine})}  # fmt: skip
        row: dict[str, Any] = {"median": medians}
        if "heterps" in medians:
            for peer in ("plain_gpu", "plain_cpu"):
                if peer in medians:
                    row[f"heterps_over_{peer}"] = medians["heterps"] / medians[peer]
            errors = [
                r["model_error"] for r in mine if r["system"] == "heterps" and r["model_error"] is not None
            ]
            row["model_error_median"] = statistics.median(errors) if errors else None
            row["where"] = _where([r for r in mine if r["system"] == "heterps"], batch_size, medians)
        out[str(batch_size)] = row
    return out


def _where(runs: list[dict[str, Any]], batch_size: int, medians: dict[str, float]) -> dict[str, Any]:
    """Where a heterps batch went (the first DataWorker, medians over the runs), in ms a batch: its
    step beside the plain loop's; the training thread's phases; every thread's CPU; the batch's ops and
    waits (torch.profiler, a few batches); and the host work a GPU would not take over (the training
    thread outside torch's ops, and the reader thread) as a share of the plain loop's step."""

    def median_of(values: list[dict[str, float]]) -> dict[str, float]:
        keys = sorted({k for v in values for k in v})
        return {k: round(statistics.median(v.get(k, 0.0) for v in values), 3) for k in keys}

    batches = [max(r["samples"] // batch_size, 1) for r in runs]
    where: dict[str, Any] = {"step_ms": {s: 1000.0 * batch_size / rate for s, rate in medians.items()}}
    phases = [{k: 1000.0 * v / n for k, v in (r.get("data_phases_s") or [{}])[0].items()}
              for r, n in zip(runs, batches, strict=True)]  # fmt: skip
    where["phases_ms"] = median_of(phases)
    where["threads_cpu_ms"] = median_of([(r.get("threads_cpu_ms_per_batch") or [{}])[0] for r in runs])
    ops = [o[0] for o in (r.get("ops_per_batch") for r in runs) if o and o[0]]
    if ops:
        where["ops"] = median_of(ops)
        peer = next((p for p in ("plain_gpu", "plain_cpu") if p in medians), None)
        if peer:
            host = where["ops"]["host_ms"] + where["threads_cpu_ms"].get("reader", 0.0)
            where["host_ms"] = round(host, 3)
            where["host_over_plain_step"] = round(host / where["step_ms"][peer], 3)
    return where


def _table(summary: dict[str, Any]) -> list[str]:
    lines = ["batch   system      median samples/s"]
    for batch_size, row in summary.items():
        for system, rate in row["median"].items():
            lines.append(f"{batch_size:>6}  {system:<10}  {rate:>16,.0f}")
        for key, value in row.items():
            if key.startswith("heterps_over") or key == "model_error_median":
                lines.append(
                    f"{batch_size:>6}  {key}: {value:.3f}"
                    if value is not None
                    else f"{batch_size:>6}  {key}: -"
                )
    for batch_size, row in summary.items():
        where = row.get("where")
        if not where:
            continue
        lines.append(f"where a heterps batch of {batch_size} went (ms a batch; the first DataWorker):")
        steps = ", ".join(f"{s} {ms:.2f}" for s, ms in where["step_ms"].items())
        lines.append(f"  step: {steps}")
        for title, key in (("training thread", "phases_ms"), ("CPU by thread", "threads_cpu_ms"), ("ops", "ops")):
            if key in where:
                lines.append(f"  {title}: " + ", ".join(f"{k} {v:g}" for k, v in where[key].items()))
        if "host_over_plain_step" in where:
            lines.append(
                f"  host work a GPU would not take over: {where['host_ms']:.2f} ms, "
                f"{where['host_over_plain_step']:.1%} of the plain loop's step"
            )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
