"""The prepared check for the first GPU machine (issue 28): one command, run as it is.

    python scripts/gpu_check.py                       # on a GPU machine: CUDA must be visible
    python scripts/gpu_check.py --cpu-half            # CI: the cuda type mapped to the CPU, explicitly
    python scripts/gpu_check.py --no-ray [--cpu-half] # where Ray cannot be imported: the in-process half

It asserts that CUDA is visible, then, in this order:
1. in-process (no Ray): the model's dense layers on the GPU type's device against the CPU reference
   trainer (runtime/reference.py), losses within 1e-4 and AUC within 1e-3; the profiler's timing of
   every layer there (forward, backward, copies, peak GPU memory);
2. with Ray (an embedded local Ray, the GPU type declared with its GPUs): a 3-stage sync plan with the
   dense stages on the ``cuda`` type against the same reference (same tolerances); the plan
   checkpointed, resumed (equal to the uninterrupted run) and exported; an async plan with a
   replicated GPU stage; the table in the GPU's memory (issue 39): a one-stage plan on the cuda type
   against the reference, its rows against the same plan's with the rows on the CPU, a cache a
   quarter of the table, a checkpoint and a resume through it; a profile of the GPU type (its device
   as measured); and the per-call split of one GPU stage call as the driver pays it: Ray's call, the
   copies, the compute, the peak memory.

Everything lands in one JSON file (``--out``, default WORKDIR/gpu_check.json) with a pass/fail per
check; the exit status is 0 when every check passed, 1 when one failed, 2 when CUDA is not visible.
``--cpu-half`` sets HETERPS_CUDA_AS_CPU=1: the ``cuda`` type computes on the CPU by that explicit flag
only (never by a silent fallback), so CI runs every line of the check but the device itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GPU = "gpu"  # the check's cuda resource type
CPU = "cpu"
MODEL = {"name": "ctr_dnn", "embedding_dim": 8, "hidden": [64, 32]}  # embedding, fc1, fc2, logit
LOSS_TOL = 1e-4
AUC_TOL = 1e-3


class Check:
    """The checks' results, in order: name, passed, figures."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def __call__(self, name: str, passed: bool, **figures: Any) -> bool:
        self.results.append({"check": name, "passed": bool(passed), **figures})
        shown = ", ".join(f"{k} {_short(v)}" for k, v in figures.items() if not isinstance(v, list | dict))
        print(f"{'PASS' if passed else 'FAIL'} {name}" + (f": {shown}" if shown else ""), flush=True)
        return bool(passed)

    @property
    def passed(self) -> bool:
        return all(r["passed"] for r in self.results)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cpu_half:
        os.environ["HETERPS_CUDA_AS_CPU"] = "1"  # before Ray starts: the actors inherit it
    if args.no_ray:
        sys.modules["ray"] = None  # type: ignore[assignment]  # the in-process half must not need Ray
    import torch

    from heterps_ray.devices import cuda_seen

    if not args.cpu_half and not torch.cuda.is_available():
        print(
            f"error: CUDA is not visible here ({cuda_seen()}); --cpu-half runs the check on the CPU",
            file=sys.stderr,
        )
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or workdir / "gpu_check.json")
    report: dict[str, Any] = {
        "mode": "cpu-half (HETERPS_CUDA_AS_CPU=1)" if args.cpu_half else "gpu",
        "ray": not args.no_ray and _ray_importable(),
        "cuda": cuda_seen(),
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "load_average": os.getloadavg(),
    }
    check = Check()
    started = time.perf_counter()
    data = _dataset(workdir / "data", args.steps, args.batch_size)
    job = _job(workdir, data, args)
    reference = _reference(job, args.steps)
    report["in_process"] = _in_process(job, args, reference, check)
    if report["ray"]:
        report["ray_checks"] = _with_ray(job, args, reference, check, workdir)
    report["checks"] = check.results
    report["passed"] = check.passed
    report["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"{'all checks passed' if check.passed else 'FAILED'}; wrote {out} ({report['seconds']} s)")
    return 0 if check.passed else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-half", action="store_true", help="map the cuda type to the CPU (HETERPS_CUDA_AS_CPU=1)"
    )
    p.add_argument(
        "--no-ray", action="store_true", help="only the in-process half (stage compute, reference, timing)"
    )
    p.add_argument("--steps", type=int, default=100, help="batches each training run trains (default 100)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workdir", default=None, help="data and runs (default: a new temp directory)")
    p.add_argument("--out", default=None, help="the JSON report (default WORKDIR/gpu_check.json)")
    return p


def _ray_importable() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        print("Ray cannot be imported: the in-process half only", flush=True)
        return False
    return True


# -- set-up ------------------------------------------------------------------------------------


def _dataset(path: Path, steps: int, batch_size: int) -> Path:
    from heterps_ray.data import DEFAULT_EVAL_FRACTION
    from heterps_ray.data.layout import is_dataset
    from heterps_ray.data.synth import synthesize

    if not is_dataset(path):
        rows = int(steps * batch_size / (1.0 - DEFAULT_EVAL_FRACTION)) + 4 * batch_size
        synthesize(path, rows, seed=11)
    return path


def _job(workdir: Path, data: Path, args: argparse.Namespace) -> Any:
    """A CPU type for the data and embedding stage, a cuda type for the dense stages: two of its
    actors share one GPU where the machine has one (num_gpus 0.5), else each has its own."""
    import torch

    from heterps_ray.config import JobConfig

    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu_half else 1
    per_actor = 1.0 if gpus >= 2 else 0.5
    cluster = {
        "name": "gpu-check",
        "resource_types": [
            {"name": CPU, "device": "cpu", "price_per_hour": 0.34, "max_instances": 4, "ray_resources": {"CPU": 0.25}},
            {"name": GPU, "device": "cuda", "price_per_hour": 0.526, "max_instances": 3,
             "ray_resources": {"CPU": 0.25}, "num_gpus": per_actor},
        ],
        "ps": {"resource": CPU},
    }  # fmt: skip
    return JobConfig.model_validate(
        {
            "name": "gpu-check",
            "model": MODEL,
            "cluster": cluster,
            "data": {"path": str(data)},
            "batch_size": args.batch_size,
            "samples": args.steps * args.batch_size,
            "throughput_min": 0,
            "mode": "sync",
            "output_dir": str(workdir / "sync"),
            "seed": 5,
            "optimizer": {"dense_lr": 0.003},
            "runtime": {"micro_batches": 2, "max_in_flight": 2, "gpu_precision": "fp32"},
        }
    )


def _reference(job: Any, steps: int) -> dict[str, Any]:
    """The CPU reference trainer's losses and eval metrics for `steps` batches."""
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.models import build_model
    from heterps_ray.runtime.reference import ReferenceTrainer

    dataset = Dataset(job.data.path)
    trainer = ReferenceTrainer(build_model(job.model), job.optimizer, seed=job.seed)
    history = trainer.fit(dataset, job.batch_size, steps=steps, progress=False)
    eval_batch = dataset.load("eval")
    return {"losses": history["loss"], "metrics": trainer.evaluate(eval_batch), "eval": eval_batch}


def _compare(
    name: str, losses: list[float], auc: float | None, reference: dict[str, Any], check: Check
) -> None:
    ref = reference["losses"]
    diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True)) if len(losses) == len(ref) else math.inf
    auc_diff = abs((auc if auc is not None else math.nan) - reference["metrics"]["auc"])
    check(f"{name}: losses equal the CPU reference's", diff < LOSS_TOL, max_loss_diff=diff, steps=len(losses))
    check(f"{name}: AUC equals the CPU reference's", auc_diff < AUC_TOL, auc=auc,
          reference_auc=reference["metrics"]["auc"], auc_diff=auc_diff)  # fmt: skip


# -- in-process: no Ray ---------------------------------------------------------------------------


def _in_process(
    job: Any, args: argparse.Namespace, reference: dict[str, Any], check: Check
) -> dict[str, Any]:
    """The dense net on the GPU type's device against the reference, then the profiler's timing there."""
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.devices import claim_device, set_precision
    from heterps_ray.models import build_model
    from heterps_ray.profiling_host import LayerProfiler
    from heterps_ray.runtime.reference import ReferenceTrainer

    gpu = job.cluster.type(GPU)
    device = claim_device(GPU, gpu.device)
    set_precision(device, job.runtime.gpu_precision)
    dataset = Dataset(job.data.path)
    spec = build_model(job.model)
    trainer = ReferenceTrainer(spec, job.optimizer, seed=job.seed, device=device)
    started = time.perf_counter()
    history = trainer.fit(dataset, job.batch_size, steps=args.steps, progress=False)
    seconds = time.perf_counter() - started
    _compare(f"in-process dense net on {device}", history["loss"], trainer.evaluate(reference["eval"])["auc"],
             reference, check)  # fmt: skip

    profiler = LayerProfiler({"name": job.model.name, **job.model.params}, job.seed, 1, gpu.device, GPU)
    sizes = sorted({max(16, job.batch_size // 4), job.batch_size})
    items = [(i, b) for i in range(spec.num_layers + 1) for b in sizes]
    timed = profiler.time_layers(items, 2, job.seed)
    layers = []
    for (index, batch_size), result in zip(items, timed, strict=True):
        name = spec.layers[index].name if index < spec.num_layers else "(whole model)"
        if result is None:
            layers.append({"layer": name, "batch_size": batch_size, "oom": True})
            continue
        fwd, bwd, copies, peak = result
        layers.append({"layer": name, "batch_size": batch_size, "forward_ms": fwd, "backward_ms": bwd,
                       "copy_ms": copies, "compute_ms": fwd + bwd - copies, "peak_mb": peak})  # fmt: skip
    on_gpu = device.type == "cuda"
    check("in-process profiler timing", all("oom" in r or r["forward_ms"] > 0 for r in layers),
          device=str(profiler.device), peak_recorded=all(("peak_mb" not in r) or ((r["peak_mb"] is not None) == on_gpu)
                                                         for r in layers))  # fmt: skip
    return {"device": str(device), "train_seconds": round(seconds, 3), "layers": layers}


# -- with Ray ------------------------------------------------------------------------------------


def _plan(stages: list[tuple[list[str], str, int]], ps_shards: int) -> Any:
    from heterps_ray.costmodel.plan import Plan

    assignment = [t for layers, t, _ in stages for _ in layers]
    return Plan.from_dict({
        "problem": "gpu check", "assignment": assignment, "ps_shards": ps_shards, "ps_type": CPU,
        "stages": [{"layers": layers, "type": t, "replicas": r} for layers, t, r in stages],
        "throughput": None, "cost": None, "cost_rate": 0.0, "feasible": True, "scheduler": "manual",
        "seconds": 0.0,
    })  # fmt: skip


def _with_ray(
    job: Any, args: argparse.Namespace, reference: dict[str, Any], check: Check, workdir: Path
) -> dict[str, Any]:
    import ray

    from heterps_ray.cluster import connect
    from heterps_ray.runtime.driver import train
    from heterps_ray.runtime.warm import release_idle
    from heterps_ray.serving.export import export_model

    owns = connect(job.cluster)
    out: dict[str, Any] = {"cluster_resources": ray.cluster_resources()}
    try:
        sync = _plan([(["embedding"], CPU, 1), (["fc1", "fc2"], GPU, 1), (["logit"], GPU, 1)], 1)
        whole = train(job, sync, steps=args.steps, progress=False, overwrite=True)
        _compare(
            "3-stage sync plan, dense stages on the cuda type", whole.losses, whole.auc, reference, check
        )
        devices = {s["index"]: s["device"] for s in whole.stages}
        expected = "cpu" if args.cpu_half else "cuda"
        check("run summary records each stage's real device",
              devices[0] == "cpu" and all(str(devices[i]).startswith(expected) for i in (1, 2)),
              devices=devices)  # fmt: skip
        out["sync"] = {"seconds": whole.seconds, "throughput": whole.throughput, "stages": whole.stages}

        half = max(args.steps // 2, 1)
        ckpt_job = job.model_copy(update={
            "output_dir": workdir / "resumed",
            "runtime": job.runtime.model_copy(update={"checkpoint_every": half}),
        })  # fmt: skip
        train(ckpt_job, sync, steps=half, progress=False, overwrite=True)
        resumed = train(ckpt_job, sync, steps=args.steps, progress=False, resume=True)
        auc_diff = abs((resumed.auc or math.nan) - (whole.auc or math.nan))
        tail = max(abs(a - b) for a, b in zip(resumed.losses[-3:], whole.losses[-3:], strict=True))
        check("checkpointed and resumed run equals the uninterrupted one", auc_diff < 1e-4 and tail < LOSS_TOL,
              auc_diff=auc_diff, last_losses_diff=tail)  # fmt: skip
        exported = export_model(workdir / "resumed", workdir / "export")
        check(
            "export of the resumed run",
            exported["embeddings"]["rows"] > 0,
            rows=exported["embeddings"]["rows"],
        )

        async_job = job.model_copy(update={"mode": "async", "output_dir": workdir / "async"})
        replicated = _plan([(["embedding"], CPU, 1), (["fc1", "fc2", "logit"], GPU, 2)], 1)
        run = train(async_job, replicated, steps=args.steps, progress=False, overwrite=True)
        gpu_actors = [p for p in run.placement if p.get("stage") == 1]
        check("async plan with a replicated GPU stage",
              all(math.isfinite(x) for x in run.losses) and len(gpu_actors) == 2
              and all(str(p["device"]).startswith(expected) for p in gpu_actors),
              auc=run.auc, replicas=len(gpu_actors))  # fmt: skip
        out["async"] = {"seconds": run.seconds, "throughput": run.throughput, "auc": run.auc}

        out["gpu_table"] = _gpu_table(job, args, reference, check, workdir)

        release_idle()  # the runs' warm actors hold the GPUs the profiler's actors need
        out["profile"] = _profile_gpu_type(job, args, check, expected)
        out["call_split"] = _call_split(job, check)
    finally:
        release_idle()
        if owns:
            ray.shutdown()
    return out


def _gpu_table(
    job: Any, args: argparse.Namespace, reference: dict[str, Any], check: Check, workdir: Path
) -> dict[str, Any]:
    """The table in the GPU's memory (issue 39): a one-stage plan on the cuda type against the reference;
    its rows against the same plan's with the rows on the CPU (the GPU's Adagrad is the CPU store's
    arithmetic); a cache a quarter of the table; a checkpoint and a resume through it."""
    from heterps_ray.models import build_model
    from heterps_ray.ps.row_bytes import device_row_bytes
    from heterps_ray.runtime.checkpoint import load_checkpoint
    from heterps_ray.runtime.driver import train

    one = _plan([(["embedding", "fc1", "fc2", "logit"], GPU, 1)], 1)

    def run(name: str, steps: int | None = None, resume: bool = False, **changes: Any) -> Any:
        runtime = {k: v for k, v in changes.items() if k != "gpu_memory_gb"}
        gpu = job.cluster.type(GPU).model_copy(update={"gpu_memory_gb": changes.get("gpu_memory_gb")})
        cluster = job.cluster.model_copy(update={"resource_types": [job.cluster.type(CPU), gpu]})
        variant = job.model_copy(update={"output_dir": workdir / name, "cluster": cluster,
                                         "runtime": job.runtime.model_copy(update=runtime)})  # fmt: skip
        return train(variant, one, steps=steps or args.steps, progress=False, overwrite=not resume, resume=resume)

    def rows(summary: Any) -> dict[str, Any]:
        return load_checkpoint(Path(summary.output_dir) / "model").table.state()

    def rows_diff(a: Any, b: Any) -> float:
        ra, rb = rows(a), rows(b)
        if len(ra["keys"]) != len(rb["keys"]) or (ra["keys"] != rb["keys"]).any():
            return math.inf
        return float(max(abs(ra[f] - rb[f]).max() for f in ("weights", "accumulators")))

    held = run("table-gpu")
    _compare("one-stage plan on the cuda type, table in its memory", held.losses, held.auc, reference, check)
    tier = held.extra["table"]
    check("the table lived in the GPU's memory", tier["tier"] == "gpu" and tier["device_bytes"] > 0
          and tier["evicted"] == 0, hit_rate=tier["hit_rate"], rows=tier["rows_held"])  # fmt: skip
    on_cpu = run("table-cpu", gpu_table="off")
    diff = rows_diff(held, on_cpu)
    check("its rows equal those of the same plan with the rows on the CPU", diff < 1e-5, max_row_diff=diff,
          loss_diff=max(abs(a - b) for a, b in zip(held.losses, on_cpu.losses, strict=True)))  # fmt: skip
    # a quarter of the rows, or (a short check's small table) half as many as one batch has keys
    slots = build_model(job.model).num_slots
    capacity = max(tier["rows_held"] // 4, args.batch_size * slots // 2)
    cached = run("table-cache", gpu_memory_gb=capacity * 1.5 * device_row_bytes(MODEL["embedding_dim"]) / 2**30)
    cache = cached.extra["table"]
    loss_diff = max(abs(a - b) for a, b in zip(cached.losses, held.losses, strict=True))
    check("a table over the GPU budget trains through the cache to the same model",
          cache["tier"] == "gpu_cache" and cache["evicted"] > 0 and loss_diff < 1e-5 and rows_diff(cached, held) < 1e-5,
          table_over_budget=tier["rows_held"] / capacity, hit_rate=cache["hit_rate"], evicted=cache["evicted"],
          loss_diff=loss_diff)  # fmt: skip
    half = max(args.steps // 2, 1)
    run("table-resumed", steps=half, checkpoint_every=half // 2 or 1)
    resumed = run("table-resumed", resume=True, checkpoint_every=half // 2 or 1)
    tail = max(abs(a - b) for a, b in zip(resumed.losses[-3:], held.losses[-3:], strict=True))
    check("checkpointed and resumed with the table in GPU memory equals the uninterrupted run",
          tail < 1e-5 and rows_diff(resumed, held) < 1e-5, last_losses_diff=tail)  # fmt: skip
    return {"table": tier, "cache": cache, "throughput": held.throughput, "throughput_rows_on_cpu": on_cpu.throughput}


def _profile_gpu_type(job: Any, args: argparse.Namespace, check: Check, expected: str) -> dict[str, Any]:
    """A quick profile of the GPU type alone: its device as measured, copies and peak memory per layer."""
    from heterps_ray.models import build_model
    from heterps_ray.profiling.profiler import ProfileSettings, fit_runs, measure

    gpu_only = job.model_copy(
        update={
            "cluster": job.cluster.model_copy(
                update={
                    "resource_types": [job.cluster.type(GPU)],
                    "ps": job.cluster.ps.model_copy(update={"resource": None}),
                }
            )
        }
    )
    sizes = tuple(sorted({max(16, job.batch_size // 4), job.batch_size}))
    settings = ProfileSettings.quick(
        batch_sizes=sizes, progress=False, start_timeout_s=120.0, call_timeout_s=300.0
    )
    run = measure(gpu_only, build_model(gpu_only.model), settings)
    result = fit_runs(gpu_only, [run], settings)
    (resource,) = result.problem["resources"]
    rows = run.measurements[run.measurements["kind"] == "layer"]
    by_layer = rows.groupby(["layer", "batch_size"])[
        ["forward_ms", "backward_ms", "copy_ms", "peak_mb"]
    ].median()
    check("profile of the GPU type", resource["device"] == expected and rows["copy_ms"].notna().all(),
          device=resource["device"], oom=int((run.measurements["kind"] == "oom").sum()))  # fmt: skip
    table = by_layer.reset_index().to_dict("records")
    return {"device": resource["device"], "layers": [{k: _plain(v) for k, v in r.items()} for r in table]}


def _call_split(job: Any, check: Check, calls: int = 30) -> dict[str, Any]:
    """One dense layer's forward + backward called on an actor of the GPU type from the driver, as a
    stage call is paid: the whole call, of it Ray's part (the call minus the actor's own time), the
    copies and the compute, and the peak GPU memory (a call's activations travel besides, not here)."""
    import ray

    from heterps_ray.profiling_host import LayerProfiler

    gpu = job.cluster.type(GPU)
    actor: Any = (
        ray.remote(LayerProfiler)
        .options(**gpu.actor_options())
        .remote({"name": job.model.name, **job.model.params}, job.seed, gpu.torch_threads, gpu.device, GPU)
    )
    try:
        item = [(1, job.batch_size)]  # fc1
        ray.get(actor.time_layers.remote(item, 3, 0), timeout=300)
        parts: dict[str, list[float]] = {"call_ms": [], "ray_ms": [], "copy_ms": [], "compute_ms": []}
        peak = None
        for i in range(calls):
            t0 = time.perf_counter()
            ((fwd, bwd, copies, peak),) = ray.get(actor.time_layers.remote(item, 0, i), timeout=300)
            call = (time.perf_counter() - t0) * 1000.0
            for key, value in (("call_ms", call), ("ray_ms", call - fwd - bwd), ("copy_ms", copies),
                               ("compute_ms", fwd + bwd - copies)):  # fmt: skip
                parts[key].append(value)
    finally:
        ray.kill(actor)
    split = {k: statistics.median(v) for k, v in parts.items()}
    check("per-call split of a GPU stage call", all(v >= 0 for v in split.values()),
          batch_size=job.batch_size, peak_mb=peak, **{k: round(v, 3) for k, v in split.items()})  # fmt: skip
    return {"layer": "fc1", "batch_size": job.batch_size, "calls": calls, **split, "peak_mb": peak}


def _plain(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value.item() if hasattr(value, "item") else value


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
