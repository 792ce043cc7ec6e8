"""Where two traced runs part: the first event of each process whose tensors differ.

Trace each run into a folder of its own (heterps_ray/runtime/trace.py), then compare them:

    HETERPS_TRACE_DIR=/tmp/a heterps train JOB --plan PLAN
    HETERPS_TRACE_DIR=/tmp/b heterps train JOB --plan PLAN --overwrite
    python scripts/diff_traces.py /tmp/a /tmp/b

A process is known by the roles it traced ("data worker 0", "stage 0"; "driver"); processes of the same
roles in the two runs are paired in the order of their process ids. For each pair it prints the first
event whose tensors differ, with the tensors' digests, shapes and addresses mod 64, and how many events
saw the same bytes at another alignment. Exit 0 when every pair agrees, 1 when one differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

Process = list[dict[str, Any]]


def load(folder: Path) -> dict[tuple[str, ...], list[Process]]:
    """A trace folder's processes by their roles, each process's events in order."""
    if not folder.is_dir():
        raise SystemExit(f"{folder}: expected a trace folder (HETERPS_TRACE_DIR of a run)")
    found: dict[tuple[str, ...], list[tuple[int, Process]]] = defaultdict(list)
    for path in folder.glob("*.jsonl"):
        events = sorted(
            (json.loads(line) for line in path.read_text().splitlines() if line), key=lambda e: e["n"]
        )
        if events:
            roles = tuple(sorted({e["where"] for e in events}))
            found[roles].append((int(path.stem), events))
    if not found:
        raise SystemExit(f"{folder}: no trace files (<pid>.jsonl) in it")
    return {roles: [events for _, events in sorted(procs)] for roles, procs in found.items()}


def tensors(event: dict[str, Any]) -> dict[str, list[Any]]:
    return {k: v for k, v in event.items() if isinstance(v, list)}


def first_difference(a: Process, b: Process) -> tuple[str | None, list[str], int]:
    """(the first event that differs, or None; its differing tensors, one line each; how many events
    before it had equal bytes at other addresses)."""
    realigned = 0
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if (x["event"], x["where"]) != (y["event"], y["where"]):
            return f"event {i}: {x['where']} {x['event']} against {y['where']} {y['event']}", [], realigned
        tx, ty = tensors(x), tensors(y)
        values = sorted(k for k in tx.keys() | ty.keys() if tx.get(k, [None])[:3] != ty.get(k, [None])[:3])
        if values:
            lines = [f"    {k}: {tx.get(k)} against {ty.get(k)}" for k in values]
            return (
                f"event {i}: {x['where']} {x['event']}, {len(values)} of {len(tx)} tensors differ",
                lines,
                realigned,
            )
        realigned += any(tx[k][3] != ty[k][3] for k in tx)
    if len(a) != len(b):
        return f"event {min(len(a), len(b))}: one run has {len(a)} events, the other {len(b)}", [], realigned
    return None, [], realigned


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    a, b = load(args.a), load(args.b)
    differ = False
    for roles in sorted(a.keys() | b.keys()):
        name = " + ".join(roles)
        left, right = a.get(roles, []), b.get(roles, [])
        if len(left) != len(right):
            print(f"{name}: {len(left)} process(es) in {args.a}, {len(right)} in {args.b}")
            differ = True
        for k, (x, y) in enumerate(zip(left, right, strict=False)):
            what, lines, realigned = first_difference(x, y)
            label = f"{name} #{k}" if len(left) > 1 else name
            moved = (
                f" ({realigned} events before: the same bytes at another address mod 64)" if realigned else ""
            )
            if what is None:
                print(f"{label}: {len(x)} events, equal{moved}")
            else:
                print(
                    "\n".join(
                        [f"{label}: differs at {what}{moved} [sha, shape, dtype, address % 64]:", *lines]
                    )
                )
                differ = True
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
