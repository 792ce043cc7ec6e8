"""`heterps profile JOB.yaml --output problem.yaml`: measure the job's model on the live cluster.

It lives in the closed loop, not in profiling/, because it also runs the runtime's probes
(closedloop/probes.py `profile_job`): the profiler itself imports nothing above it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="profile the job's model on every resource type of the Ray cluster -> a problem file",
        description=(
            "Start actors pinned to each resource type the Ray cluster declares, time every layer forward "
            "and backward at several batch sizes, 1 vs 2 replicas, actor-to-actor messages, a PS shard and "
            "the input read rate; fit DESIGN.md §3's coefficients by least squares. Writes the problem "
            "YAML (poor fits listed on top), the raw measurements (.measurements.parquet), the fit "
            "quality (.fit.csv) beside it. Uses an embedded local "
            "Ray with the cluster's resource types unless --address is given."
        ),
    )
    p.add_argument("job", metavar="JOB.yaml", help="job config: model, cluster, batch size, data")
    p.add_argument(
        "--output", "-o", required=True, type=Path, metavar="problem.yaml", help="problem file to write"
    )
    p.add_argument(
        "--repeat-factor", type=int, default=1, help="multiply every repeat count (slower, steadier)"
    )
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="comma-separated batch sizes to time (default 64,128,256,512,1024)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a fast, rough profile for smoke tests (not for planning)"
    )
    p.add_argument(
        "--probe-steps",
        type=int,
        default=None,
        help="batches each runtime probe trains (default: a short warm-up chunk and one of the dataset's "
        "read chunks; --quick: no probes, so no call terms)",
    )
    p.add_argument(
        "--address", default=None, help="Ray cluster address (default: start an embedded local Ray)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    import dataclasses

    import ray

    from heterps_ray.closedloop.probes import profile_job
    from heterps_ray.cluster import connect
    from heterps_ray.config import load_job, writable
    from heterps_ray.errors import ConfigError
    from heterps_ray.profiling.fit import write_problem
    from heterps_ray.profiling.profiler import ProfileSettings

    writable(args.output, "--output", directory=False)
    job = load_job(args.job)
    base = ProfileSettings.quick if args.quick else ProfileSettings
    settings = base(progress=not args.no_progress)
    if args.repeat_factor < 1:
        raise ConfigError(None, "--repeat-factor", "a positive integer", args.repeat_factor)
    settings = settings.scaled(args.repeat_factor)
    if args.probe_steps is not None:
        if args.probe_steps < 1:
            raise ConfigError(None, "--probe-steps", "1 or more batches", args.probe_steps)
        settings = dataclasses.replace(settings, probe_steps=args.probe_steps)
    if args.batch_sizes:
        try:
            sizes = tuple(int(x) for x in args.batch_sizes.split(","))
        except ValueError:
            sizes = ()
        if len(set(sizes)) < 2 or min(sizes) < 1:
            raise ConfigError(
                None,
                "--batch-sizes",
                "two or more distinct positive integers, comma-separated",
                args.batch_sizes,
            )
        settings = dataclasses.replace(settings, batch_sizes=sizes)
    owns_ray = connect(job.cluster, args.address)
    try:
        result = profile_job(job, settings)
    finally:
        if owns_ray:
            ray.shutdown()
    paths = write_problem(result, args.output, header=str(result.problem.get("notes", "")))
    print(
        f"wrote {paths['problem']} ({len(result.problem['layers'])} layers x {len(result.problem['resources'])} types)"
    )
    print(
        f"  raw measurements {paths['measurements']}, fit quality {paths['quality']}"
    )
    print("  took " + ", ".join(f"{part} {took:.1f}s" for part, took in result.seconds.items()))
    spread = result.problem.get("runtime", {}).get("spread", {})
    if spread:  # how far each type's repeated one-stage probes fell from their median
        print("  the profile's own spread: " + ", ".join(f"{name} ±{s:.1%}" for name, s in spread.items()))
    for item in result.unmeasured:  # what this cluster did not let the profile measure
        print(f"  not measured: {item}")
    if result.flags:
        print(f"{len(result.flags)} poor fits (R² < 0.9, negative or clipped coefficients):")
        for flag in result.flags:
            print(f"  {flag}")
    else:
        print("every fit has R² >= 0.9 and non-negative coefficients")
    return 0
