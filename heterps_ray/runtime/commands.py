"""Sub-commands of the runtime: `heterps train` (the distributed pipeline of a plan)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    _register_train(subparsers)
    _register_reference(subparsers)


# -- heterps train ------------------------------------------------------------------------------


def _register_train(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a job with a plan on Ray (PS shards + a pipeline of actors)",
        description=(
            "Start the PS shards, DataWorkers and StageWorkers of PLAN on Ray, train, evaluate AUC and "
            "logloss on the eval split, and write run_summary.json and model/ to the job's output_dir. "
            "Uses an embedded local Ray with the cluster's resource types unless --address is given."
        ),
    )
    p.add_argument("job", metavar="JOB.yaml", help="job config (model, cluster, data, mode, ...)")
    p.add_argument(
        "--plan", required=True, metavar="PLAN.json", help="plan from `heterps plan` or hand-written"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="batches to train (default: runtime.train_steps or all epochs)",
    )
    p.add_argument(
        "--address", default=None, help="Ray cluster address (default: start an embedded local Ray)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in output_dir")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in output_dir from its newest valid checkpoint, also under another plan "
        "(sync mode: with as many DataWorkers)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from heterps_ray.config import load_job
    from heterps_ray.costmodel.plan import load_plan
    from heterps_ray.errors import ConfigError
    from heterps_ray.runtime.driver import SUMMARY_FILE, train

    if args.steps is not None and args.steps < 1:
        raise ConfigError(None, "--steps", "a positive integer", args.steps)
    if args.resume and args.overwrite:
        raise ConfigError(None, "--resume", "not together with --overwrite", "both")
    job = load_job(args.job)
    plan = load_plan(args.plan)
    summary = train(
        job,
        plan,
        steps=args.steps,
        progress=not args.no_progress,
        address=args.address,
        overwrite=args.overwrite,
        plan_file=args.plan,
        resume=args.resume,
    )
    busy = " ".join(f"s{s['index']}:{s['busy']:.0%}" for s in summary.stages)
    print(
        f"trained {summary.steps} batches ({summary.samples:,} samples) in {summary.seconds:.1f} s: "
        f"{summary.throughput:,.0f} samples/s, busy {busy}"
    )
    if summary.steady_throughput is not None:
        print(f"after the first chunk (warm-up): {summary.steady_throughput:,.0f} samples/s")
    if "resumed_from" in summary.extra:
        print(f"resumed from {summary.extra['resumed_from']['checkpoint']}")
    for fault in summary.extra.get("faults", []):
        who = ", ".join(f"{a['kind']} {a['replica']} ({a['how']})" for a in fault["actors"])
        print(
            f"fault at step {fault['step']}: {who}; recovered in {fault['recovery_s']:.1f} s from step "
            f"{fault['rolled_back_to']}, {fault['batches_replayed']} batches replayed"
        )
    if "batches_applied" in summary.extra:
        extra = summary.extra
        print(
            f"batches applied once on every PS shard: {extra['batches_applied']}, lost "
            f"{extra['batches_lost']}, applied twice {extra['batches_duplicated']}"
        )
    if summary.extra.get("checkpoints"):
        print(f"checkpoints written: {len(summary.extra['checkpoints'])} (newest kept in checkpoints/)")
    if summary.auc is not None:
        print(f"eval ({summary.eval_rows:,} rows): AUC {summary.auc:.4f}, logloss {summary.logloss:.4f}")
    print(f"wrote {summary.output_dir}/{SUMMARY_FILE} and the model in {summary.output_dir}/model/")
    return 0


# -- heterps reference --------------------------------------------------------------------------


def _register_reference(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "reference",
        help="train a job's model in one process (plain PyTorch): the ground truth for `train`",
        description=(
            "Train the job's model with the single-process reference trainer (sparse table with "
            "Adagrad, dense layers with Adam/SGD, BCE loss) on the train split, evaluate AUC and "
            "logloss on the eval split and write reference_summary.json to the job's output_dir. "
            "If data.path holds no dataset and data.synth_rows is set, synthetic data is generated first."
        ),
    )
    p.add_argument("job", metavar="JOB.yaml", help="job config (model, data, batch_size, optimizer, seed)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="batches to train (default: runtime.train_steps or all epochs)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_reference)


def _reference(args: argparse.Namespace) -> int:
    from heterps_ray.config import load_job
    from heterps_ray.errors import ConfigError

    for flag, value in (("--steps", args.steps), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ConfigError(None, flag, "a positive integer", value)
    job = load_job(args.job)

    from heterps_ray.runtime.reference import SUMMARY_FILE, run_reference, torch_threads

    with torch_threads(args.threads):
        summary = run_reference(job, steps=args.steps, progress=not args.no_progress)
    print(
        f"trained {summary['model']} for {summary['steps']} batches ({summary['samples']:,} samples) "
        f"in {summary['train_seconds']:.1f} s ({summary['samples_per_second']:,.0f} samples/s)"
    )
    achievable = summary["achievable_auc"]
    reach = f" (achievable {achievable:.4f})" if achievable is not None else ""
    print(
        f"eval ({summary['eval_rows']:,} rows): AUC {summary['auc']:.4f}{reach}, logloss {summary['logloss']:.4f}"
    )
    print(f"wrote {job.output_dir / SUMMARY_FILE}")
    return 0
