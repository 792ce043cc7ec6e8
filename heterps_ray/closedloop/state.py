"""What a `heterps run` has decided, on disk: output_dir/run_state.json, rewritten atomically after
each decision (the plan, every re-plan and missed floor), so that `heterps run JOB --resume` continues
a killed run with the same problem, plan and history, from its newest valid checkpoint.

The job it was started with is kept too: a resume under a changed job file is refused, naming the
fields that changed (output_dir excepted: the same directory may be mounted elsewhere on a new head).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from heterps_ray.closedloop.replan import Decisions
from heterps_ray.config import JobConfig
from heterps_ray.costmodel import load_plan, problem_from_dict
from heterps_ray.errors import ConfigError
from heterps_ray.ps.atomic import write_bytes_atomic
from heterps_ray.runtime.checkpoint import jsonable

STATE_FILE = "run_state.json"
_VERSION = 1


def save_state(
    out: Path, job: JobConfig, decisions: Decisions, seconds: dict[str, float], finished: bool = False
) -> Path:
    """Write output_dir/run_state.json: the job, the decisions so far, the phases' seconds."""
    d = decisions
    state = {
        "version": _VERSION,
        "job": _job_fields(job),
        "problem": d.problem.to_dict(),
        "plan_file": str(d.plan_file),
        "replans": d.replans,
        "floor_attempts": d.attempts,
        "measured": d.measured,
        "seconds": seconds,
        "finished": finished,
    }
    return write_bytes_atomic(out / STATE_FILE, (json.dumps(jsonable(state), indent=2) + "\n").encode())


def load_state(out: Path, job: JobConfig) -> tuple[Decisions, dict[str, float], bool]:
    """The decisions, phase seconds and finished flag of the run in `out`, checked against `job`.
    ConfigError (exit 2) when there is no run to resume or the job changed since."""
    path = out / STATE_FILE
    if not path.is_file():
        raise ConfigError(
            str(out),
            "--resume",
            f"an output_dir holding a `heterps run` ({STATE_FILE}, written once it has planned); "
            "run without --resume to start one (or --resume auto: resume when there is a run, else start)",
            "nothing of a run" if not out.is_dir() or not any(out.iterdir()) else f"no {STATE_FILE}",
        )
    try:
        state = json.loads(path.read_text())
        saved_job = dict(state["job"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            str(path), "job", f"a run state written by heterps run ({exc})", "unreadable"
        ) from None
    changed = _changed_fields(saved_job, _job_fields(job))
    if changed:
        raise ConfigError(
            str(path),
            ", ".join(changed),
            "the job the run was started with (a resumed run trains what it planned)",
            "changed since: "
            + "; ".join(f"{k}: {_at(saved_job, k)!r} -> {_at(_job_fields(job), k)!r}" for k in changed),
        )
    problem = problem_from_dict(state["problem"], str(path))
    plan_file = Path(state["plan_file"])
    decisions = Decisions(
        problem=problem,
        plan=load_plan(plan_file, problem),
        plan_file=plan_file,
        replans=list(state.get("replans", [])),
        attempts=list(state.get("floor_attempts", [])),
        measured=[float(m) for m in state.get("measured", [])],
    )
    return decisions, dict(state.get("seconds", {})), bool(state.get("finished"))


def has_state(out: Path) -> bool:
    return (out / STATE_FILE).is_file()


def _job_fields(job: JobConfig) -> dict[str, Any]:
    data = jsonable(job.model_dump(mode="json"))
    data.pop("output_dir", None)
    return data


def _changed_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two nested dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += _changed_fields(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def _at(data: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        data = data.get(key) if isinstance(data, dict) else None  # type: ignore[assignment]
    return data
