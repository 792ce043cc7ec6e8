"""Benchmark: samples/s of the heterps_ray pipeline against (a) the one-process reference trainer and
(b) Ray Train's TorchTrainer with DDP (2 CPU workers, gloo), on the same model and data, side by
side in one run on the same machine.

Model: CTR-DNN (26 slots, embedding dim 9, FC 512-256-128-32, batch 512). Data: synthetic
Criteo-like rows whose 26 slots each draw from 1M distinct values. The DDP baseline holds the 26
tables of 1M rows as one `nn.Embedding(26M, 9, sparse=True)` (slot offsets, keys mod 1M) with
sparse Adagrad, dense Adam; the reference and the pipeline create rows lazily on first pull.

    .venv/bin/python scripts/bench_runtime.py --rows 200000 --steps 120
"""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--only", nargs="*", default=["reference", "sync", "async", "ddp"])
    parser.add_argument("--logs", action="store_true", help="show the actors' and Ray Train workers' logs")
    args = parser.parse_args()

    _make_data(args.data, args.rows)
    import ray

    from heterps_ray.config import load_cluster

    cluster = load_cluster(REPO / "configs" / "clusters" / "local.yaml")
    ray.init(
        num_cpus=2,
        resources=cluster.local_resources(),
        object_store_memory=1 << 30,
        include_dashboard=False,
        log_to_driver=args.logs,
        configure_logging=False,
    )
    results: dict[str, Any] = {
        "rows": args.rows,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "cpus": os.cpu_count(),
    }
    for name in args.only:
        print(f"--- {name}", flush=True)
        results[name] = RUNNERS[name](args)
        print(json.dumps({k: v for k, v in results[name].items() if k != "profile"}), flush=True)
    ray.shutdown()
    base = results.get("reference", {}).get("samples_per_s")
    ddp = results.get("ddp", {}).get("samples_per_s")
    print(f"\n{'system':<34} {'samples/s':>10} {'x reference':>12} {'x Ray Train DDP':>16}")
    for name in args.only:
        rate = results[name]["samples_per_s"]
        print(
            f"{results[name]['label']:<34} {rate:>10,.0f} {rate / base if base else float('nan'):>12.2f} "
            f"{rate / ddp if ddp else float('nan'):>16.2f}"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


def _make_data(path: Path, rows: int) -> None:
    from heterps_ray.data.synth import SynthSpec, synthesize

    if (path / "meta.json").exists():
        return
    spec = SynthSpec(vocab_min=ROWS_PER_TABLE, vocab_max=ROWS_PER_TABLE)
    synthesize(path, rows, seed=0, rows_per_part=25_000, spec=spec)


def _job(args: argparse.Namespace, mode: str) -> Any:
    from heterps_ray.config import load_job

    return load_job(
        REPO / "configs" / "jobs" / "quickstart.yaml",
        {
            "data.path": str(args.data),
            "data.synth_rows": None,
            "batch_size": args.batch_size,
            "mode": mode,
            "output_dir": str(args.output.parent / f"run_{mode}"),
            "runtime.micro_batches": 1,
            "runtime.max_in_flight": 4,
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
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(next(batches))
    seconds = time.perf_counter() - t0
    return {
        "label": "reference (1 process, 2 threads)",
        "samples_per_s": args.steps * args.batch_size / seconds,
        "seconds": seconds,
    }


def _run_pipeline(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from heterps_ray.runtime.driver import train
    from heterps_ray.scheduling.plan import load_plan

    plan_name = "quickstart.json" if mode == "sync" else "quickstart_async.json"
    plan = load_plan(REPO / "configs" / "plans" / plan_name)
    summary = train(_job(args, mode), plan, steps=args.warmup + args.steps, progress=False, overwrite=True)
    chunks = summary.extra["chunks"]
    # drop whole chunks until the warm-up batches are behind us
    skipped = 0
    while chunks and skipped < args.warmup * args.batch_size:
        skipped += chunks[0][0]
        chunks = chunks[1:]
    samples = sum(c[0] for c in chunks)
    seconds = sum(c[1] for c in chunks)
    label = f"heterps_ray pipeline, {mode} ({'+'.join(str(s['replicas']) for s in summary.stages)} actors)"
    return {
        "label": label,
        "samples_per_s": samples / seconds,
        "seconds": seconds,
        "profile": {
            "stage_busy": {
                f"s{s['index']} {'+'.join(s['layers'])} on {s['type']}": round(s["busy"], 3)
                for s in summary.stages
            },
            "data_worker_wait_s": summary.extra["data_wait_s"],
            "train_seconds": summary.seconds,
            "ps": [{k: p[k] for k in ("rows", "pulls", "pushes", "keys_per_s", "busy")} for p in summary.ps],
        },
    }


def run_sync(args: argparse.Namespace) -> dict[str, Any]:
    return _run_pipeline(args, "sync")


def run_async(args: argparse.Namespace) -> dict[str, Any]:
    return _run_pipeline(args, "async")


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


RUNNERS = {"reference": run_reference, "sync": run_sync, "async": run_async, "ddp": run_ddp}


if __name__ == "__main__":
    main()
