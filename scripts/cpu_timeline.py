"""Run a command and print, every half second, which processes of the machine took CPU and how much:
what ran beside a profile's probe, a benchmark's window or a test (issue 41: what else was busy while
cpu_big's one-stage run read slow).

    python scripts/cpu_timeline.py -- .venv/bin/heterps profile configs/jobs/quickstart.yaml -o /tmp/profile.yaml

Each line: the time (UTC), the cores the whole machine took over the interval, then the busiest
processes (cores, pid, title: Ray names an actor's process ``ray::Class.method`` while it runs one).
Sampling costs about 0.03 of a core.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil

INTERVAL_S = 0.5
SHOWN = 5  # processes per line
QUIET_CORES = 0.02  # a process below this over an interval is left out


def snapshot() -> dict[int, tuple[str, float]]:
    """Each process's title and CPU seconds so far."""
    out = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:  # exited or not ours to read
            continue
        title = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or "?"
        out[proc.info["pid"]] = (title, times.user + times.system)
    return out


def line(
    at: float, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float
) -> str:
    cores = {
        (pid, title): (cpu - before[pid][1]) / wall for pid, (title, cpu) in after.items() if pid in before
    }
    busy = sorted(((c, key) for key, c in cores.items() if c >= QUIET_CORES), reverse=True)
    stamp = time.strftime("%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 10)}"
    shown = " | ".join(f"{c:4.2f} {pid} {title[:40]}" for c, (pid, title) in busy[:SHOWN])
    return f"{stamp} {sum(c for c, _ in busy):4.2f}  {shown}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="write the timeline here (default: stderr)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sink = open(args.out, "w") if args.out else sys.stderr  # noqa: SIM115 (closed below)
    child = subprocess.Popen(command)
    try:
        last, last_t = snapshot(), time.time()
        while child.poll() is None:
            time.sleep(max(0.0, INTERVAL_S - (time.time() - last_t)))
            now, now_t = snapshot(), time.time()
            print(line(now_t, last, now, now_t - last_t), file=sink, flush=True)
            last, last_t = now, now_t
    finally:
        if child.poll() is None:
            child.terminate()
        if sink is not sys.stderr:
            sink.close()
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
