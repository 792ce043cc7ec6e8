"""The level walk's optimum against a second formulation (issue 26): one MILP over every throughput
level at once (scheduling/milp.py), which shares no search code with the walk. Equal costs on
generated problems with and without runtime sections, and equal highest throughputs where no plan
meets the floor."""

from __future__ import annotations

import ctypes
import os

import pytest

from heterps_ray.costmodel import CostModel, Problem, problem_from_dict
from heterps_ray.scheduling import get_scheduler, provision_counts
from heterps_ray.scheduling.generator import generate_problem, with_runtime_section
from heterps_ray.scheduling.highs import c_stdout_silenced
from heterps_ray.scheduling.milp import milp_optimum, unsupported_reason

REL = 1e-6  # HiGHS' feasibility tolerances (1e-7 absolute on rows of ms) leave the MILP's cost ~1e-8 off


def _assert_same_optimum(problem: Problem) -> None:
    walk = get_scheduler("exact", method="levels").schedule(problem)
    assert walk.extra["proof"].get("proven", True)
    if walk.feasible:
        found = milp_optimum(problem)
        assert found.status == "optimal"
        assert found.objective == pytest.approx(walk.cost, rel=REL)
        # the MILP's plan, provisioned exactly by the cost model, is no cheaper than the walk's
        counts = provision_counts(CostModel(problem), found.assignment)
        assert counts.feasible and counts.cost >= walk.cost * (1.0 - 1e-9)
    else:
        assert milp_optimum(problem).status == "infeasible"
        fastest = milp_optimum(problem, objective="fastest")
        assert fastest.status == "optimal"
        assert fastest.objective == pytest.approx(walk.best_throughput, rel=REL)


def _with_floor(problem: Problem, share: float) -> Problem:
    """`problem` with its floor at `share` of the highest throughput the MILP finds for it."""
    fastest = milp_optimum(problem, objective="fastest").objective
    return problem_from_dict({**problem.to_dict(), "throughput_min": round(share * fastest, 1)})


def _shared_host(problem: Problem) -> Problem:
    """`problem` with its CPU type and its first GPU type on one 8-core machine."""
    data = problem.to_dict()
    names = [r["name"] for r in data["resources"]][:2]
    data["hosts"] = [{"name": "box", "cores": 8.0, "types": names, "call_cpu_ms": 0.3}]
    return problem_from_dict(data)


@pytest.mark.parametrize("seed", range(6))
def test_the_milp_equals_the_walk_on_small_problems_on_both_models(seed):
    base = generate_problem(seed, num_layers=(3, 6), num_types=(2, 3))
    _assert_same_optimum(base)
    _assert_same_optimum(with_runtime_section(base))  # async, 4 micro-batches, shards on actors


@pytest.mark.parametrize("seed", range(3))
def test_the_milp_equals_the_walk_in_sync_mode_and_on_a_shared_host(seed):
    base = generate_problem(seed, num_layers=(3, 6), num_types=(2, 3))
    sync = with_runtime_section(base, mode="sync", ps_wait_ms_per_row=1e-4)
    _assert_same_optimum(_with_floor(sync, 0.5))
    _assert_same_optimum(_with_floor(_shared_host(with_runtime_section(base)), 0.7))


@pytest.mark.parametrize("seed", [0, 1, 4])
def test_the_milp_equals_the_walk_on_medium_problems_on_both_models(seed):
    base = generate_problem(seed, num_layers=(8, 12), num_types=(3, 4), catalogue="wide")
    _assert_same_optimum(base)
    _assert_same_optimum(with_runtime_section(base))


def test_where_no_plan_meets_the_floor_both_find_the_same_fastest_plan():
    base = generate_problem(3, num_layers=(4, 6), num_types=(2, 3), infeasible_share=1.0)
    _assert_same_optimum(base)
    _assert_same_optimum(with_runtime_section(base))


def test_the_milp_refuses_what_it_cannot_express_and_says_why():
    hosted = with_runtime_section(generate_problem(0, num_layers=(3, 4)), ps_hosting="auto")
    assert "ps_hosting: auto" in (unsupported_reason(hosted) or "")
    with pytest.raises(ValueError, match="ps_hosting: auto"):
        milp_optimum(hosted)


def test_what_highs_prints_with_c_printf_never_reaches_stdout(capfd):
    """HiGHS prints some lines with C printf whatever its options say (ERGO-Code/HiGHS#2783), which
    landed inside `heterps plan`'s output: solve_milp points fd 1 at /dev/null around the call and
    flushes C's buffers before it points back."""
    libc = ctypes.CDLL(None)
    print("before", flush=True)
    with c_stdout_silenced():
        libc.printf(b"from C, buffered\n")
        os.write(1, b"to fd 1\n")
    libc.printf(b"from C after\n")
    libc.fflush(None)
    print("after", flush=True)
    assert capfd.readouterr().out == "before\nfrom C after\nafter\n"
