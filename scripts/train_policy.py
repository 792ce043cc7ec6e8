"""Pretrain one RL scheduling policy across many generated problems and ship it in the package.

    python scripts/train_policy.py --minutes 40 --seed 0
    python scripts/train_policy.py --iterations 5 --pool 20 --out /tmp/policy     # a smoke run
    python scripts/train_policy.py --minutes 36 --pool 1000 --wide 400 --init runs/policy_issue8  # issue 16
    python scripts/train_policy.py --tune --samples 6 --seed 0 --ship             # Tune, ship the winner
    python scripts/train_policy.py --imitate --pool 600 --wide 300 --runtime-share 0.25 \
        --init heterps_ray/scheduling/rl/pretrained --out runs/policy26               # taught by exact (issue 26)

PPO (RLlib) on SchedulingEnv over a pool of generated problems (3..30 layers, 2..5 types by
default; `--wide N` adds N production-sized problems of the wide catalogue, 20..120 layers and 3..8
types, GPU-only layers, tight and loose floors, binding instance limits), one problem drawn per episode.
`--init` starts from a saved policy; one saved before the set encoder (network.py) is upgraded so that
it starts out scoring exactly as it did. The reward is the log cost ratio to each problem's best
heuristic plan, so the training curve (`curve` in policy.json) reads as "how much cheaper than the
best simple plan, on average". The pool is drawn from seed + 1_000_000, so problems generated
from small integer seeds (the benchmarks) are unseen.
`--tune` runs Ray Tune with ASHA over the pretraining settings instead
(experiments.policy_search.tune_policy): every trial pretrains for up to --env-steps env steps (a full
run), is scored by the policy alone on held-out validation problems every --report-every env steps, and
ASHA stops the trials behind; the best trial that ran the full length wins. The table goes to --tune-output (JSON) and stdout; with
--ship, the winner's final weights go to --out (so the Tune command is the retrain command).
`--imitate` teaches the policy exact's plans instead (rl/imitation.py): exact labels every pool problem
(`--runtime-share` of them given the runtime section `heterps profile` writes; labels cached in --labels,
so a rerun only solves new problems), behaviour cloning on exact's episodes, `--dagger` rounds on the
policy's own states (labelled with exact's type), `--priced` rounds on them (labelled with the type whose
completion by exact's remaining types is the cheapest plan meeting the floor; `--priced-rollouts`: at
some layers also by the policy's own greedy completion; the shipped policy, see
BENCHMARKS.md), then `--ppo-iterations` of PPO on the reward (0: none).
While /tmp/heterps_quiet exists (another engineer measuring), training waits between iterations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from heterps_ray.scheduling.rl.env import CONTEXT_FEATURES, TYPE_FEATURES
from heterps_ray.scheduling.rl.policy import PRETRAINED_DIR, load_policy, save_policy
from heterps_ray.scheduling.rl.pretrain import PRETRAIN_CONFIG, pretrain, training_pool
from heterps_ray.scheduling.rl.scheduler import RLConfig, problem_fingerprint

QUIET_FLAG = Path("/tmp/heterps_quiet")


def _metadata(config: Any, args: argparse.Namespace, command: str, *ranges: Sequence[int]) -> dict[str, Any]:
    """What policy.json records of a training run: the network, the pool it saw, the command."""
    layers, types, wide_layers, wide_types = (list(r) for r in ranges)
    return {
        "hidden": config.hidden,
        "set_hidden": config.set_hidden,
        "type_features": list(TYPE_FEATURES),
        "context_features": list(CONTEXT_FEATURES),
        "config": dataclasses.asdict(config),
        "seed": args.seed,
        "pool": args.pool,
        "layers": layers,
        "types": types,
        "wide": args.wide,
        "wide_layers": wide_layers,
        "wide_types": wide_types,
        "command": command,
        "init": None if args.init is None else str(args.init),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    parser.add_argument("--iterations", type=int, default=None, help="stop after this many PPO iterations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool", type=int, default=1000, help="generated training problems")
    parser.add_argument("--layers", default="3,30", help="inclusive range of layers per problem")
    parser.add_argument("--types", default="2,5", help="inclusive range of resource types per problem")
    parser.add_argument(
        "--wide", type=int, default=0, help="extra training problems of the wide catalogue (issue 16)"
    )
    parser.add_argument(
        "--wide-layers", default="20,120", help="inclusive range of layers of the wide problems"
    )
    parser.add_argument("--wide-types", default="3,8", help="inclusive range of types of the wide problems")
    parser.add_argument(
        "--gpu-cloud", type=int, default=0, help="GPU-cloud problems added to the pool (the wide sizes)"
    )
    parser.add_argument("--out", type=Path, default=PRETRAINED_DIR, help="where policy.pt / policy.json go")
    parser.add_argument("--save-every", type=int, default=10, help="iterations between saves")
    parser.add_argument(
        "--init", type=Path, default=None, help="start from this saved policy (continue training)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override an RLConfig field"
    )
    tuning = parser.add_argument_group("--tune: pick the settings with Ray Tune")
    tuning.add_argument("--tune", action="store_true", help="search the settings instead of training")
    tuning.add_argument("--samples", type=int, default=6, help="trials (the first is the current config)")
    tuning.add_argument(
        "--env-steps", type=int, default=327_680, help="layer decisions of PPO of a full-length trial"
    )
    tuning.add_argument("--report-every", type=int, default=32_768, help="env steps between validations")
    tuning.add_argument("--grace", type=int, default=98_304, help="env steps before ASHA may stop a trial")
    tuning.add_argument("--reduction", type=float, default=3.0, help="ASHA's reduction factor")
    tuning.add_argument("--concurrent", type=int, default=2, help="trials at a time")
    tuning.add_argument("--ship", action="store_true", help="write Tune's winner to --out")
    tuning.add_argument(
        "--validation", type=int, default=30, help="held-out problems each trial is scored on"
    )
    tuning.add_argument("--tune-storage", type=Path, default=Path("runs/tune"), help="Tune's trial folders")
    tuning.add_argument("--tune-output", type=Path, default=Path("scripts/train_policy/rl_tune_asha.json"))
    imitation = parser.add_argument_group("--imitate: learn exact's plans (behaviour cloning, DAgger)")
    imitation.add_argument("--imitate", action="store_true", help="imitate exact instead of PPO from scratch")
    imitation.add_argument("--labels", type=Path, default=Path("runs/exact_labels.json"), help="label cache")
    imitation.add_argument(
        "--runtime-share", type=float, default=0.0, help="share of problems given a runtime section"
    )
    imitation.add_argument("--label-limit-s", type=float, default=10.0, help="exact's time per problem")
    imitation.add_argument(
        "--label-minutes", type=float, default=None, help="stop labelling after this long (rerun to go on)"
    )
    imitation.add_argument("--labels-only", action="store_true", help="only extend --labels, then exit")
    imitation.add_argument("--epochs", type=int, default=30, help="behaviour-cloning epochs per round")
    imitation.add_argument("--bc-lr", type=float, default=1e-3, help="behaviour cloning's Adam step")
    imitation.add_argument("--dagger", type=int, default=2, help="DAgger rounds after behaviour cloning")
    imitation.add_argument(
        "--priced",
        type=int,
        default=0,
        help="rounds on the policy's own states labelled by priced completions",
    )
    imitation.add_argument(
        "--priced-samples", type=int, default=1, help="sampled episodes per problem and round"
    )
    imitation.add_argument(
        "--priced-own", action="store_true", help="also price completions by the policy's own remaining types"
    )
    imitation.add_argument(
        "--priced-walk-steps",
        type=int,
        default=0,
        help="complete a state no completion by exact's types labels by exact's level walk (this many quick levels)",
    )
    imitation.add_argument("--priced-walks", type=int, default=2, help="such walks per episode at most")
    imitation.add_argument("--priced-temperature", type=float, default=0.5, help="their sampling temperature")
    imitation.add_argument(
        "--priced-epochs", type=int, default=None, help="cloning epochs of a priced round (default --epochs)"
    )
    imitation.add_argument(
        "--priced-rollouts",
        type=int,
        default=0,
        help="layers per episode whose types are also priced by the policy's own greedy completion",
    )
    imitation.add_argument("--ppo-iterations", type=int, default=0, help="PPO iterations after imitation")
    parser.add_argument(
        "--plot", type=Path, default=None, help="only draw --out's training curve into this PNG, then exit"
    )
    parser.add_argument(
        "--score",
        type=Path,
        nargs="+",
        default=None,
        metavar="POLICY_DIR",
        help="only score these saved policies alone on the --validation problems (as Tune does), then exit",
    )
    parser.add_argument(
        "--plot-tune",
        type=Path,
        default=None,
        help="only draw every trial of --tune-output (validation score over env steps) into this PNG, then exit",
    )
    args = parser.parse_args(argv)
    if args.plot is not None:
        return _plot_curve(args.out, args.plot)
    if args.plot_tune is not None:
        return _plot_tune(args.tune_output, args.plot_tune)
    if args.score is not None:
        return _score(args.score, args.validation, _int_range(args.layers), _int_range(args.types))
    command = "python scripts/train_policy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.imitate:
        return _imitate(args, command)

    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if args.tune:
        return _tune(args, command)

    config = _override(PRETRAIN_CONFIG, args.set)
    layers = _int_range(args.layers)
    types = _int_range(args.types)
    started = time.perf_counter()
    wide_layers, wide_types = _int_range(args.wide_layers), _int_range(args.wide_types)
    pool = training_pool(
        args.pool, args.seed, layers, types, wide=args.wide, wide_layers=wide_layers, wide_types=wide_types
    )
    print(f"generated {len(pool)} problems in {time.perf_counter() - started:.0f} s", flush=True)
    curve: list[dict[str, float]] = []
    metadata = {**_metadata(config, args, command, layers, types, wide_layers, wide_types), "curve": curve}

    def saved(iteration: int, module: object, point: dict[str, float]) -> None:
        curve.append(point)
        print(json.dumps(point), flush=True)
        if iteration % args.save_every == 0:
            save_policy(module, args.out, {**metadata, "iterations": iteration})

    module, _ = pretrain(
        config,
        pool,
        args.seed,
        iterations=args.iterations,
        minutes=args.minutes,
        init=None if args.init is None else load_policy(args.init),
        on_iteration=saved,
        between_iterations=_wait_while_quiet,
    )
    save_policy(module, args.out, {**metadata, "iterations": len(curve)})
    print(f"saved {args.out} after {len(curve)} iterations", flush=True)
    return 0


def _imitate(args: argparse.Namespace, command: str) -> int:
    import torch

    from heterps_ray.scheduling.generator import with_runtime_section
    from heterps_ray.scheduling.rl.imitation import (
        clone,
        dagger_states,
        demonstrations,
        exact_labels,
        priced_states,
    )
    from heterps_ray.scheduling.rl.network import PolicyNetwork

    torch.set_num_threads(1)
    started = time.perf_counter()
    config = _override(PRETRAIN_CONFIG, args.set)
    pool = training_pool(
        args.pool,
        args.seed,
        _int_range(args.layers),
        _int_range(args.types),
        wide=args.wide,
        wide_layers=_int_range(args.wide_layers),
        wide_types=_int_range(args.wide_types),
        gpu_cloud=args.gpu_cloud,
    )
    # every k-th classic or wide problem gets the runtime section (the true model, DESIGN.md §3b); the
    # GPU-cloud ones have theirs
    every = round(1.0 / args.runtime_share) if args.runtime_share > 0 else 0
    plain = args.pool + args.wide
    pool = [
        with_runtime_section(p) if every and i < plain and i % every == every - 1 else p
        for i, p in enumerate(pool)
    ]
    labels = json.loads(args.labels.read_text()) if args.labels.exists() else {}
    deadline = math.inf if args.label_minutes is None else time.perf_counter() + 60.0 * args.label_minutes
    labelled = [p for p in pool if problem_fingerprint(p) in labels]
    # label the classic and the wide problems in step, so a --label-minutes cut leaves both kinds
    starts = (0, args.pool, plain, len(pool))
    share = [
        (i - starts[k]) / max(starts[k + 1] - starts[k], 1)
        for k in range(3)
        for i in range(starts[k], starts[k + 1])
    ]
    for problem in [pool[i] for i in sorted(range(len(pool)), key=share.__getitem__)]:
        if problem_fingerprint(problem) in labels:
            continue
        if time.perf_counter() > deadline:
            print(f"--label-minutes reached: {len(labelled)} of {len(pool)} problems labelled", flush=True)
            break
        _wait_while_quiet()
        exact_labels([problem], labels, args.label_limit_s)
        labelled.append(problem)
        args.labels.parent.mkdir(parents=True, exist_ok=True)
        args.labels.write_text(json.dumps(labels) + "\n")
    solved = sum(labels[problem_fingerprint(p)] is not None for p in labelled)
    label_s = time.perf_counter() - started
    print(f"{len(labelled)} problems labelled ({solved} with an exact plan) in {label_s:.0f} s", flush=True)
    if args.labels_only:
        return 0

    module = (
        load_policy(args.init)
        if args.init is not None
        else PolicyNetwork(len(TYPE_FEATURES), len(CONTEXT_FEATURES), config.hidden, config.set_hidden)
    )
    states = demonstrations(labelled, labels)
    rounds = []

    def fit(name: str, epochs: int | None = None) -> None:
        epochs = args.epochs if epochs is None else epochs
        result = clone(module, states, epochs=epochs, lr=args.bc_lr, seed=args.seed)
        rounds.append({"round": name, **result, "seconds": round(time.perf_counter() - started, 1)})
        print(json.dumps(rounds[-1]), flush=True)

    if args.epochs > 0:  # 0: a policy cloned before (--init) goes straight to its DAgger / priced rounds
        fit("behaviour cloning")
    for i in range(args.dagger):
        _wait_while_quiet()
        states = states + dagger_states(module, labelled, labels, seed=args.seed + i)
        fit(f"dagger {i + 1}")
    for i in range(args.priced):
        _wait_while_quiet()
        states = states + priced_states(
            module,
            labelled,
            labels,
            samples=args.priced_samples,
            temperature=args.priced_temperature,
            seed=args.seed + 100 + i,
            own=args.priced_own,
            walk_steps=args.priced_walk_steps,
            walks=args.priced_walks,
            rollouts=args.priced_rollouts,
        )
        fit(f"priced {i + 1}", args.priced_epochs)
    metadata = {
        **_metadata(
            config,
            args,
            command,
            _int_range(args.layers),
            _int_range(args.types),
            _int_range(args.wide_layers),
            _int_range(args.wide_types),
        ),
        "runtime_share": args.runtime_share,
        "imitation": {"labelled": len(labelled), "exact_plans": solved, "rounds": rounds},
        "curve": [],
    }
    if args.ppo_iterations > 0:
        import ray

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)

        def point(iteration: int, trained: object, p: dict[str, float]) -> None:
            metadata["curve"].append(p)
            print(json.dumps(p), flush=True)

        module, _ = pretrain(
            config,
            labelled,
            args.seed,
            iterations=args.ppo_iterations,
            init=module,
            on_iteration=point,
            between_iterations=_wait_while_quiet,
        )
    metadata["training_s"] = round(time.perf_counter() - started, 1)
    save_policy(module, args.out, {**metadata, "iterations": len(metadata["curve"])})
    print(f"saved {args.out} after {metadata['training_s']:.0f} s", flush=True)
    return 0


def _tune(args: argparse.Namespace, command: str) -> int:
    from heterps_ray.experiments.policy_search import ship_policy, tune_policy

    search = tune_policy(
        num_samples=args.samples,
        max_env_steps=args.env_steps,
        report_every=args.report_every,
        grace_env_steps=args.grace,
        reduction_factor=args.reduction,
        max_concurrent=args.concurrent,
        pool_size=args.pool,
        validation=args.validation,
        seed=args.seed,
        layers=_int_range(args.layers),
        types=_int_range(args.types),
        storage_path=args.tune_storage,
        between_iterations=_wait_while_quiet,
    )
    print(search.table.to_string())
    print("best:", json.dumps(search.best_config), "from", search.best_checkpoint)
    args.tune_output.parent.mkdir(parents=True, exist_ok=True)
    args.tune_output.write_text(
        json.dumps(
            {
                "command": command,
                "settings": search.settings,
                "best_config": search.best_config,
                "best_checkpoint": str(search.best_checkpoint),
                "table": json.loads(search.table.to_json(orient="records")),
                "trials": [
                    {k: v for k, v in t.items() if k != "checkpoint"} | {"checkpoint": str(t["checkpoint"])}
                    for t in search.trials
                ],
            },
            indent=1,
        )
        + "\n"
    )
    if args.ship:
        ship_policy(search, args.out, command)
        print(f"shipped {search.best_checkpoint} to {args.out}", flush=True)
    return 0


def _score(directories: list[Path], count: int, layers: tuple[int, int], types: tuple[int, int]) -> int:
    from heterps_ray.scheduling import get_scheduler
    from heterps_ray.scheduling.rl.pretrain import policy_only_score, validation_problems

    problems = validation_problems(count, layers, types)
    plans = {p.name: get_scheduler("exact").schedule(p) for p in problems}
    exact = {name: float(plan.cost) if plan.feasible else None for name, plan in plans.items()}
    for directory in directories:
        print(
            json.dumps(
                {"policy": str(directory), **policy_only_score(load_policy(directory), problems, exact)}
            )
        )
    return 0


def _plot_curve(policy_dir: Path, png: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from heterps_ray.scheduling.rl.policy import policy_metadata

    meta = policy_metadata(policy_dir)
    curve = meta["curve"]
    validation = meta.get("validation", [])  # a Tune trial's policy also has its validation scores
    figure, axes = plt.subplots(
        1, 2 if validation else 1, figsize=(11 if validation else 7, 3.5), squeeze=False
    )
    axis = axes[0][0]
    axis.plot([p["env_steps"] / 1e3 for p in curve], [p["episode_return_mean"] for p in curve], lw=1)
    axis.set_xlabel("env steps (layer decisions), thousands")
    axis.set_ylabel("mean episode return\nlog(reference cost / plan cost)")
    axis.grid(alpha=0.3)
    if validation:
        right = axes[0][1]
        steps = [v["env_steps"] / 1e3 for v in validation]
        for key in ("mean_ratio", "median_ratio", "greedy_median_ratio"):
            right.plot(steps, [v[key] for v in validation], marker="o", lw=1, label=key.replace("_", " "))
        right.set_xlabel("env steps, thousands")
        right.set_ylabel("validation: policy's cost / exact")
        right.legend(fontsize=7)
        right.grid(alpha=0.3)
    figure.suptitle(textwrap.fill(meta["command"], 150), fontsize=7)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=120)
    print(f"wrote {png}")
    return 0


def _plot_tune(tune_json: Path, png: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(tune_json.read_text())
    figure, axis = plt.subplots(figsize=(8, 4))
    for trial in record["trials"]:
        config = trial["config"]
        label = (
            f"{'hand-set ' if trial['current'] else ''}lr {config['lr']:.2g}"
            f"{' decay' if config.get('lr_end', 1.0) != 1.0 else ''}, ent {config['entropy_coeff']:.2g}, "
            f"batch {config['train_batch_size']}, {config['num_epochs']} ep, hidden {config['hidden']}"
        )
        steps = [h["env_steps"] / 1e3 for h in trial["history"]]
        scores = [h["mean_ratio"] for h in trial["history"]]
        axis.plot(
            steps,
            scores,
            marker="o",
            ms=3,
            lw=1.5 if trial["full_length"] else 1,
            ls="-" if trial["full_length"] else "--",
            label=label,
        )
    for milestone in record["settings"]["milestones"]:
        axis.axvline(milestone / 1e3, color="grey", lw=0.8, ls=":")
    axis.set_yscale("log")
    axis.set_xlabel("env steps, thousands (dotted: ASHA rungs and the full length; dashed: stopped by ASHA)")
    axis.set_ylabel("validation mean ratio\n(policy alone / exact, miss = 10)")
    axis.set_title(textwrap.fill(record["command"], 150), fontsize=6)
    axis.legend(fontsize=6)
    axis.grid(alpha=0.3, which="both")
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=120)
    print(f"wrote {png}")
    return 0


def _wait_while_quiet() -> None:
    # Another engineer's measurement needs the shared machine quiet; wait between iterations.
    while QUIET_FLAG.exists():
        time.sleep(10)


def _int_range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def _override(config: RLConfig, assignments: list[str]) -> RLConfig:
    types = {f.name: f.type for f in dataclasses.fields(RLConfig)}
    changes = {}
    for item in assignments:
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"--set {item}: unknown RLConfig field (known: {sorted(types)})")
        kind = type(getattr(config, name))
        changes[name] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    return dataclasses.replace(config, **changes)


if __name__ == "__main__":
    sys.exit(main())
