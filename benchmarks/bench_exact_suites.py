"""Time `exact` on every problem of issue 40's suites, optionally side by side with another checkout of
the project (alternating per problem, the order flipped every problem).

    python benchmarks/bench_exact_suites.py --output runs/exact_suites.jsonl
    git worktree add /tmp/exact-before a7226fb
    python benchmarks/bench_exact_suites.py --against /tmp/exact-before --output runs/exact_ab.jsonl

The suites: the GPU cloud (`generate_problem(seed, (20, 120), (3, 8), catalogue="gpu_cloud")`, seeds
0-23), the wide suite on the true model (catalogue "wide", seeds 0-39, `with_runtime_section`) and on
the base model (the same problems without it), and the held-out set (`rl.pretrain.held_out_problems`).
Each side runs in its own process (one Python, its own `heterps_ray` first on the path), exact with a
60 s limit. Per suite: median and max seconds, how many
within 20 s, how many proven, and whether both sides found the same cost. Speed: run it alone
(`../shared/bench/quiet.sh` first).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SUITES = {
    "gpu": "GPU cloud, 20-120 x 3-8",
    "wide": "wide, true model, 20-120 x 3-8",
    "base": "wide, base model, 20-120 x 3-8",
    "held": "held-out",
}
LIMIT_S = 20.0  # issue 40's target for exact on every problem up to 120 x 8


@functools.cache
def held_out() -> dict[int, Any]:
    """The held-out set by seed, generated once per process."""
    from heterps_ray.scheduling.rl.pretrain import held_out_problems

    return dict(held_out_problems())


def specs() -> list[str]:
    return (
        [f"gpu:{seed}" for seed in range(24)]
        + [f"wide:{seed}" for seed in range(40)]
        + [f"base:{seed}" for seed in range(40)]
        + [f"held:{seed}" for seed in held_out()]
    )


def problem(spec: str) -> Any:
    from heterps_ray.scheduling.generator import generate_problem, with_runtime_section

    suite, seed = spec.split(":")
    if suite == "gpu":
        return generate_problem(int(seed), num_layers=(20, 120), num_types=(3, 8), catalogue="gpu_cloud")
    if suite in ("wide", "base"):
        base = generate_problem(int(seed), num_layers=(20, 120), num_types=(3, 8), catalogue="wide")
        return with_runtime_section(base) if suite == "wide" else base
    return held_out()[int(seed)]


def worker() -> None:
    """One row of JSON per problem spec read from stdin."""
    import torch

    from heterps_ray.scheduling import get_scheduler

    torch.set_num_threads(1)
    for line in sys.stdin:
        spec = line.strip()
        task = problem(spec)
        started = time.perf_counter()
        plan = get_scheduler("exact", budget_s=60.0).schedule(task)
        proof = plan.extra.get("proof", {})
        row = {
            "spec": spec,
            "size": f"{task.num_layers}x{task.num_types}",
            "seconds": round(time.perf_counter() - started, 2),
            "proven": bool(proof.get("proven")),
            "cost": plan.cost if plan.feasible else None,
            "ilps": proof.get("ilp_solves"),
        }
        print(json.dumps(row), flush=True)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    sides = sorted({r["side"] for r in rows})
    lines = [
        "| suite | side | problems | median s | max s | within 20 s | proven |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, name in SUITES.items():
        for side in sides:
            mine = [r for r in rows if r["side"] == side and r["spec"].startswith(key + ":")]
            if not mine:
                continue
            seconds = [r["seconds"] for r in mine]
            within = sum(s <= LIMIT_S for s in seconds)
            proven = sum(r["proven"] for r in mine)
            lines.append(
                f"| {name} | {side} | {len(mine)} | {statistics.median(seconds):.2f} | {max(seconds):.2f} "
                f"| {within} | {proven} |"
            )
    if len(sides) == 2:
        by: dict[str, dict[str, Any]] = {}
        for r in rows:
            by.setdefault(r["spec"], {})[r["side"]] = r
        pairs = [d for d in by.values() if len(d) == 2]
        differ = [
            d["this"]["spec"]
            for d in pairs
            if (d["this"]["cost"] is None) != (d["against"]["cost"] is None)
            or (
                d["this"]["cost"] is not None
                and not math.isclose(d["this"]["cost"], d["against"]["cost"], rel_tol=1e-9)
            )
        ]
        ratios = [d["this"]["seconds"] / max(d["against"]["seconds"], 1e-3) for d in pairs]
        lines.append(
            f"\n{len(pairs)} problems on both sides; costs differ on {len(differ)} {differ}; this / against: "
            f"median {statistics.median(ratios):.3f}, range {min(ratios):.3f} … {max(ratios):.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, default=None, help="another checkout to alternate with")
    parser.add_argument("--only", default=None, help="comma-separated specs (gpu:16,wide:33,held:9000031)")
    parser.add_argument("--output", type=Path, default=None, help="rows as JSON lines (appended)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    root = Path(__file__).resolve().parents[1]
    sides = {"this": root} | ({"against": args.against.resolve()} if args.against else {})
    procs = {
        side: subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            cwd=path,
            env=dict(os.environ, PYTHONPATH=str(path)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for side, path in sides.items()
    }
    todo = args.only.split(",") if args.only else specs()
    rows = []
    out = args.output.open("a") if args.output else None
    for i, spec in enumerate(todo):
        order = list(procs) if i % 2 == 0 else list(reversed(procs))
        for side in order:
            proc = procs[side]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(spec + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                print(
                    f"bench_exact_suites.py: the {side} worker ({sides[side]}) stopped at {spec}",
                    file=sys.stderr,
                )
                return 1
            row = json.loads(line) | {"side": side}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
