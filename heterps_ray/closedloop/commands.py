"""`heterps run`: the command line of the closed loop (run.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from heterps_ray.errors import ConfigError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="profile -> fit -> plan -> train -> report, end to end",
        description=(
            "Run a job end to end: generate its data if the job asks for synthetic data, profile its "
            "model on every resource type of the Ray cluster, fit the cost model, plan with the job's "
            "scheduler, train the plan, and report predicted against achieved throughput, $/hour, the "
            "projected total cost, AUC and logloss. Outputs go to the job's output_dir. Uses an embedded "
            "local Ray with the cluster's resource types, or the cluster at --address (or $RAY_ADDRESS, "
            "as inside `ray job submit`). The floor is kept in closed loop: when the steady throughput "
            "after warm-up is more than 10% under throughput_min, training stops at a checkpoint, the model "
            "is refit on the measurement, the scheduler re-plans and training resumes (at most 3 times; "
            "run_report.json lists each attempt, throughput_min and floor_met). Exit codes: 0 done with "
            "the floor met (or too short a run to measure it), 2 bad input, 3 no plan meets the floor "
            "(at plan time, or as measured in closed loop; the message names the highest throughput "
            "reached or measured, and run_report.json is still written)."
        ),
    )
    p.add_argument("job", metavar="JOB.yaml", help="job config")
    p.add_argument("--address", default=None, help="Ray cluster address (default: an embedded local Ray)")
    p.add_argument("--steps", type=int, default=None, help="batches to train (default: the job's)")
    p.add_argument(
        "--budget-s", type=float, default=None, help="scheduler time budget (rl: train per problem)"
    )
    p.add_argument("--output-dir", default=None, help="override the job's output_dir")
    p.add_argument("--quick-profile", action="store_true", help="a fast, rough profile (smoke runs)")
    p.add_argument(
        "--problem",
        metavar="FILE",
        default=None,
        help="plan on this problem file instead of profiling (e.g. an earlier run's problem.yaml); "
        "the job's floor, batch size and samples apply",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in output_dir")
    p.add_argument(
        "--resume",
        nargs="?",
        const="yes",
        default="no",
        choices=["yes", "auto"],
        metavar="auto",
        help="continue the killed run in output_dir from its newest valid checkpoint, with the problem, "
        "plan and re-plans it had decided (a changed job file is refused); `--resume auto` resumes when "
        "output_dir holds a run and starts one otherwise (for retried `ray job submit`s); deletes nothing",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="the cluster's autoscaler starts the nodes (worker groups may start empty): request one node "
        "of each type for the profile and the plan's actors' bundles before training, give them back at "
        "the end; a type not there within cluster.autoscale.node_timeout_s is planned without "
        "(same as cluster.autoscale.enabled: true)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from heterps_ray.closedloop.report import REPORT_FILE
    from heterps_ray.closedloop.run import run_job
    from heterps_ray.config import load_job, writable
    from heterps_ray.costmodel import load_problem

    if args.output_dir:
        writable(args.output_dir, "--output-dir", directory=True)
    overrides = {"output_dir": str(Path(args.output_dir).resolve())} if args.output_dir else None
    job = load_job(args.job, overrides)
    if args.problem is not None:
        load_problem(args.problem)  # a bad file fails here, before Ray starts (run_job reads it again)
    if args.autoscale:
        autoscale = job.cluster.autoscale.model_copy(update={"enabled": True})
        job = job.model_copy(update={"cluster": job.cluster.model_copy(update={"autoscale": autoscale})})
    if args.steps is not None and args.steps < 1:
        raise ConfigError(None, "--steps", "a positive integer", args.steps)
    report = run_job(
        job,
        address=args.address,
        overwrite=args.overwrite,
        resume=args.resume,
        steps=args.steps,
        budget_s=args.budget_s,
        progress=not args.no_progress,
        quick_profile=args.quick_profile,
        problem_file=args.problem,
    )
    print(report.table())
    print(f"wrote {report.output_dir}/{REPORT_FILE}")
    return 0
