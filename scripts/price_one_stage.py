"""The one-stage plan's price on each type of each problem file, and how far each lies from their
median (issue 29: three profiles taken one after another should agree within ±5%):

    python scripts/price_one_stage.py p1.yaml p2.yaml p3.yaml

or take them: `--take 3 --job JOB --out DIR` runs three ``heterps profile``s one after another (each
its own process, like a user's) and, before the first and after each, the plain one-process loop on
the job's data with 2 torch threads (what a one-stage plan on a 2-thread type computes): the
machine's own speed beside each profile. A reference is the median of REFERENCE_WINDOWS windows of
REFERENCE_STEPS batches (about 15 s, half a profile): one 1.7 s window moved by up to 34% between
neighbours on this host, more than the profiles did. The repeatability figure (issue 41) is each
price divided by the reference taken just before its profile: within ±5% of their median on each
type. Where the profiles disagree and the references moved with them, the machine moved
(BENCHMARKS.md, issue 29: "Why cpu_big's price moves between profiles").

    python scripts/price_one_stage.py --take 3 --job configs/jobs/quickstart.yaml --out /tmp/take
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from heterps_ray.config import JobConfig, load_job
from heterps_ray.costmodel import CostModel, load_problem
from heterps_ray.runtime.reference import reference_rate

REFERENCE_STEPS = 256  # batches per reference window: two of the data's read chunks at batch 512 (each one conversion)
REFERENCE_WINDOWS = 7  # windows per reference, their median the machine's speed (module docstring)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("problems", nargs="*", help="problem files written by `heterps profile`")
    parser.add_argument("--take", type=int, default=0, help="take this many profiles one after another")
    parser.add_argument("--job", help="the job to profile (with --take)")
    parser.add_argument("--out", type=Path, help="folder for the profiles (with --take)")
    args = parser.parse_args(argv)
    references: list[float] = []
    paths = list(args.problems)
    if args.take:
        if not args.job or not args.out:
            parser.error("--take needs --job and --out")
        paths, references = take(args.job, args.out, args.take)
    report(paths, references)


def take(job_path: str, out: Path, count: int) -> tuple[list[str], list[float]]:
    """`count` profiles of the job, each its own process, the reference loop before the first and
    after each; returns the problem files and the references (samples/s)."""
    job = load_job(job_path)
    out.mkdir(parents=True, exist_ok=True)
    references = [reference(job)]
    print(f"reference {time.strftime('%H:%M:%S')}: {references[-1]:,.0f} samples/s", flush=True)
    paths = []
    for i in range(1, count + 1):
        path = str(out / f"p{i}.yaml")
        command = [sys.executable, "-m", "heterps_ray", "profile", job_path, "-o", path, "--no-progress"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        print("\n".join(line for line in done.stdout.splitlines() if "took" in line or "spread" in line))
        if done.returncode:
            raise SystemExit(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-2000:]}")
        paths.append(path)
        references.append(reference(job))
        print(f"reference {time.strftime('%H:%M:%S')}: {references[-1]:,.0f} samples/s", flush=True)
    return paths, references


def reference(job: JobConfig) -> float:
    """The plain loop's samples/s now: the median of REFERENCE_WINDOWS windows back to back."""
    return statistics.median(reference_rate(job, REFERENCE_STEPS) for _ in range(REFERENCE_WINDOWS))


def report(paths: list[str], references: list[float]) -> None:
    prices: dict[str, list[float]] = {}
    spreads: dict[str, list[float]] = {}
    for path in paths:
        problem = load_problem(path)
        model = CostModel(problem)
        for rtype in problem.resources:
            evaluation = model.evaluate([rtype.name] * len(problem.layers), [1], 1)
            prices.setdefault(rtype.name, []).append(evaluation.throughput)
            spread = problem.runtime.spread.get(rtype.name) if problem.runtime else None
            spreads.setdefault(rtype.name, []).append(spread if spread is not None else float("nan"))
    for name, values in prices.items():
        median = statistics.median(values)
        shown = ", ".join(f"{v:,.0f}" for v in values)
        own = ", ".join(f"±{s:.1%}" for s in spreads[name])
        print(
            f"{name}: {shown} samples/s; median {median:,.0f}, "
            f"{min(values) / median - 1:+.1%} .. {max(values) / median - 1:+.1%}; profiles' own spread {own}"
        )
    if len(references) >= len(paths):  # repeatability against the host: each price over the loop just before it
        for name, values in prices.items():
            ratios = [v / r for v, r in zip(values, references, strict=False)]
            middle = statistics.median(ratios)
            print(
                f"{name} price / reference before it: " + ", ".join(f"{x:.4f}" for x in ratios)
                + f"; {min(ratios) / middle - 1:+.1%} .. {max(ratios) / middle - 1:+.1%} of their median"
            )  # fmt: skip
    if len(references) == len(paths) + 1:  # a profile's machine: the mean of the references either side
        beside = [(a + b) / 2 for a, b in zip(references, references[1:], strict=False)]
        middle = statistics.median(beside)
        print(
            "reference loop beside each profile: "
            + ", ".join(f"{r:,.0f}" for r in beside)
            + f" samples/s; {min(beside) / middle - 1:+.1%} .. {max(beside) / middle - 1:+.1%} of their median"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
