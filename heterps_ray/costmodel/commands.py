"""`heterps simulate --problem FILE --plan PLAN.json`: play a plan out in the pipeline simulator."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="discrete-event simulation of a plan: throughput, per-stage utilisation, queue depths",
        description=(
            "Simulate PLAN on PROBLEM as the runtime runs it (micro-batches, bounded in-flight links, M:N "
            "replicas, PS contention, the sync barrier) and print the throughput and per-stage "
            "utilisation beside the analytic model's. The runtime details `heterps profile` measured "
            "(the problem's ps and runtime fields) are used."
        ),
    )
    p.add_argument("--problem", required=True, type=Path, metavar="FILE", help="problem file (YAML or JSON)")
    p.add_argument("--plan", required=True, type=Path, metavar="PLAN.json", help="plan for that problem")
    p.add_argument("--batches", type=int, default=40, help="batches to simulate (default 40)")
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per batch (default 1)")
    p.add_argument(
        "--max-in-flight", type=int, default=4, help="in-flight micro-batches per DataWorker (default 4)"
    )
    p.add_argument(
        "--drain-every",
        type=int,
        default=20,
        help="batches per DataWorker between pipeline drains (the runtime's driver: 20; 0: never)",
    )
    p.add_argument("--timeline", type=Path, default=None, help="write the per-call timeline (CSV)")
    p.add_argument("--queues", type=Path, default=None, help="write queue depths over time (CSV)")
    p.add_argument(
        "--no-host-sharing",
        action="store_true",
        help="ignore the problem's `hosts` (every actor on cores of its own)",
    )
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from heterps_ray.config import writable
    from heterps_ray.costmodel import CostModel, load_problem
    from heterps_ray.costmodel.simulator import simulate
    from heterps_ray.errors import ConfigError

    for flag, output in (("--timeline", args.timeline), ("--queues", args.queues)):
        if output is not None:
            writable(output, flag, directory=False)
    if args.drain_every < 0:
        raise ConfigError(None, "--drain-every", "a non-negative integer", args.drain_every)
    for name in ("batches", "micro_batches", "max_in_flight"):
        if getattr(args, name) < 1:
            raise ConfigError(None, f"--{name.replace('_', '-')}", "a positive integer", getattr(args, name))
    problem = load_problem(args.problem)
    plan = _read_plan(args.plan, problem)
    if problem.batch_size % args.micro_batches:
        raise ConfigError(
            None, "--micro-batches", f"a divisor of the batch size {problem.batch_size}", args.micro_batches
        )
    result = simulate(
        problem,
        plan,
        batches=args.batches,
        micro_batches=args.micro_batches,
        mode=args.mode,
        max_in_flight=args.max_in_flight,
        drain_every=args.drain_every or None,
        host_sharing=not args.no_host_sharing,
    )
    assignment = [stage["type"] for stage in plan["stages"] for _ in stage["layers"]]
    replicas = [int(stage.get("replicas", 1)) for stage in plan["stages"]]
    shards = int(plan.get("ps_shards") or problem.ps_min_shards)
    analytic = CostModel(problem).evaluate(assignment, replicas, shards)

    print(
        f"simulated {args.batches} batches ({result.samples:,} samples; {args.mode}, {args.micro_batches} "
        f"micro-batch(es), at most {args.max_in_flight} in flight) in {result.makespan_ms / 1000:.3f} s of "
        f"simulated time"
    )
    print(
        f"throughput: simulator {result.throughput:,.0f} samples/s | analytic model {analytic.throughput:,.0f} samples/s"
    )
    for host in [] if args.no_host_sharing else problem.hosts or ():
        print(
            f"host {host.name}: {host.cores:g} cores shared by {', '.join(host.types)} "
            f"({host.background_cores:g} taken by background load); busy actors share them by their threads"
        )
    for rtype in problem.resources:
        if rtype.call_overhead_ms or rtype.fused_saving_ms:
            print(
                f"type {rtype.name}: {rtype.call_overhead_ms:g} ms per call a stage receives; a stage's layers "
                f"after its first {rtype.fused_saving_ms:g} ms cheaper each"
            )
    header = f"{'stage':<6} {'type':<12} {'replicas':>8} {'utilisation':>11} {'mean queue':>10} {'max queue':>9} {'analytic (samples/s)':>21}"
    print(header)
    print("-" * len(header))
    summary = result.summary()
    for row, stage in zip(summary.itertuples(), analytic.stages, strict=True):
        print(
            f"{row.stage:<6} {row.type:<12} {row.replicas:>8} {row.utilisation:>11.0%} {row.mean_queue:>10.2f} "
            f"{row.max_queue:>9} {stage.throughput:>21,.0f}"
        )
    print(
        f"{'ps':<6} {problem.ps_resource:<12} {shards:>8} {result.ps_utilisation:>11.0%} {'-':>10} {'-':>9} "
        f"{analytic.ps_throughput:>21,.0f}"
    )
    if args.timeline:
        result.spans.to_csv(args.timeline, index=False)
        print(f"wrote the timeline to {args.timeline}")
    if args.queues:
        result.queues.to_csv(args.queues, index=False)
        print(f"wrote queue depths to {args.queues}")
    return 0


def _read_plan(path: Path, problem: Any) -> dict[str, Any]:
    """A plan JSON (DESIGN.md §4) whose stages cover the problem's layers in order, on known types."""
    from heterps_ray.config import read_text
    from heterps_ray.errors import ConfigError

    file = str(path)
    text = read_text(path, "a readable plan JSON file")
    try:
        plan = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(file, "<file>", f"valid JSON ({exc})") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("stages"), list) or not plan["stages"]:
        raise ConfigError(file, "stages", "a non-empty list of {layers, type, replicas}")
    names = problem.layer_names
    covered: list[str] = []
    for i, stage in enumerate(plan["stages"]):
        if not isinstance(stage, dict) or not isinstance(stage.get("layers"), list):
            raise ConfigError(file, f"stages.{i}", "a mapping with layers, type and replicas", stage)
        layers = [names[x] if isinstance(x, int) and 0 <= x < len(names) else x for x in stage["layers"]]
        expected = names[len(covered) : len(covered) + len(layers)]
        if layers != expected:
            raise ConfigError(
                file, f"stages.{i}.layers", f"the next layers of the problem in order: {expected}", layers
            )
        if stage.get("type") not in problem.type_names:
            raise ConfigError(
                file,
                f"stages.{i}.type",
                f"a resource type of the problem, one of {problem.type_names}",
                stage.get("type"),
            )
        for layer in layers:
            if not problem.can_run(names.index(layer), stage["type"]):
                raise ConfigError(
                    file, f"stages.{i}.type", f"a type that can run layer {layer!r}", stage["type"]
                )
        replicas = stage.get("replicas", 1)
        if not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(file, f"stages.{i}.replicas", "a positive integer", replicas)
        stage["layers"] = layers
        covered += layers
    if covered != names:
        raise ConfigError(file, "stages", f"stages covering all layers {names}", covered)
    return plan
