"""One level of the runtime walk as a 0/1 program over stages (scipy.optimize.milp, HiGHS): the rows of
runtime_levels.py's module docstring (flow over stage boundaries, neighbours on different types,
max_instances, the loop, each shared host, and with ``ps_hosting: auto`` a replica beyond the minimal
counts), over the segments through which a plan may cost less than the incumbent."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from heterps_ray.scheduling.highs import solve_milp
from heterps_ray.scheduling.levels import Level
from heterps_ray.scheduling.segment_paths import assignment_of

if TYPE_CHECKING:
    from heterps_ray.scheduling.runtime_levels import RuntimeLevels

ROW_SLACK = 1e-12  # the ILP's loop and host rows relaxed by this (relative): float rounding only
# HiGHS settings for these programs (0/1 stage choices, few rows). Presolve's probing and the sub-MIP
# heuristics cost most of the time (a 5,000-segment level: 48 s -> 12 s without them); the DP gives the
# incumbent bound instead. At the root HiGHS then spent most of its time separating cuts into a pool of
# thousands that closed little of the gap: a pool of 3, with the cheap primal heuristics off too (where
# the level has an objective: a feasibility check keeps them, they find its plan), took the ILPs of a
# 74 x 6 GPU-cloud problem from 34 s to 9.5 s with the same answers (BENCHMARKS "Exact within 20 s").
MIP_OPTIONS: dict[str, Any] = {
    "presolve": False,
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
    "mip_heuristic_run_root_reduced_cost": False,
    "mip_pool_soft_limit": 3,
}
PRIMAL_HEURISTICS_OFF = {
    "mip_heuristic_run_feasibility_jump": False,
    "mip_heuristic_run_shifting": False,
    "mip_heuristic_run_zi_round": False,
}
# Strong branching solves an LP per candidate column before it trusts a column's pseudo-costs. Up to
# ~3,000 segments it keeps the trees small (1-80 nodes) and pays; at 5,000-13,000 segments each of
# those LPs is dear and pseudo-costs from the start (mip_pscost_minreliable 0) took a 108 x 5 problem's
# ILPs from 28 s to 11 s and a 110 x 8 one's from 35 s to 17 s, while on 3,000-segment levels they
# grew the trees to 300-2,100 nodes and doubled the time.
PSEUDO_COST_FROM_SEGMENTS = 4000


def solve_case(
    levels: RuntimeLevels, hosted: bool, target: float, objective: bool, upper: float
) -> Level | None:
    """One case's ILP over the segments through which a plan may cost less than `upper`."""
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.sparse import coo_matrix

    case = levels._case(hosted, target)
    if case is None:
        return None
    m, cap, k, rate = case
    L, T = levels.L, levels.T
    loop = levels.busy[hosted] + levels.waiting
    budget = levels.loop_budget(target)
    allowed = levels.valid & np.isfinite(rate)
    if objective and math.isfinite(upper):
        fixed = levels.shards_rate(hosted, m)
        allowed &= levels._through(hosted, target, rate) + fixed < upper * (1.0 - 1e-12)
    if levels.sync:
        allowed &= levels.K * levels.busy[hosted] <= budget * (1.0 + ROW_SLACK)
    # a first stage's DataWorkers may be raised to the limit (the loop): any count <= cap is fine
    ii, jj, tt = np.nonzero(allowed)
    if not (ii == 0).any() or not (jj == L - 1).any():
        return None
    n_seg = len(ii)
    kk = k[ii, jj, tt]
    first = ii == 0
    asynchronous = not levels.sync and not hosted
    # variables: segments, then n_t (async on actor shards: DataWorkers per type), then bump y_t
    # and v (auto on actor shards: a replica beyond the minimal counts), then M (sync, K > 1)
    cols: dict[str, int] = {}
    n_var = n_seg
    if asynchronous:
        cols["n"] = n_var
        n_var += T
    bump = levels.auto and not hosted
    if bump:
        cols["y"] = n_var
        n_var += T
        if asynchronous:
            cols["v"] = n_var
            n_var += 1
    if levels.sync and levels.K > 1:
        cols["M"] = n_var
        n_var += 1
    r_i: list[np.ndarray] = []
    r_j: list[np.ndarray] = []
    r_v: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []

    def add(rows: Any, cols_: Any, vals: Any) -> None:
        r_i.append(np.asarray(rows, dtype=np.int64))
        r_j.append(np.asarray(cols_, dtype=np.int64))
        r_v.append(np.asarray(vals, dtype=np.float64))

    seg = np.arange(n_seg)
    row = 0
    # one stage starts at layer 0; a stage ending at b - 1 is followed by one starting at b
    add(np.full(int(first.sum()), row), seg[first], np.ones(int(first.sum())))
    lo.append(1.0)
    hi.append(1.0)
    row += 1
    flow_row = row + np.arange(L - 1)  # boundary b = 1..L-1 -> row + b - 1
    ends = jj < L - 1
    add(flow_row[jj[ends]], seg[ends], np.ones(int(ends.sum())))
    starts = ii > 0
    add(flow_row[ii[starts] - 1], seg[starts], -np.ones(int(starts.sum())))
    lo += [0.0] * (L - 1)
    hi += [0.0] * (L - 1)
    row += L - 1
    # neighbours differ in type: per boundary and type, at most one of (ends there, starts there)
    alt_row = row + (np.arange(L - 1)[:, None] * T + np.arange(T)[None, :])  # [L-1, T]
    add(alt_row[jj[ends], tt[ends]], seg[ends], np.ones(int(ends.sum())))
    add(alt_row[ii[starts] - 1, tt[starts]], seg[starts], np.ones(int(starts.sum())))
    lo += [-np.inf] * ((L - 1) * T)
    hi += [1.0] * ((L - 1) * T)
    row += (L - 1) * T
    # max_instances per type
    cap_row = row + tt
    if asynchronous:
        later = ~first
        add(cap_row[later], seg[later], kk[later])
        add(row + np.arange(T), cols["n"] + np.arange(T), np.ones(T))
    else:
        add(cap_row, seg, kk)
    if bump:
        add(row + np.arange(T), cols["y"] + np.arange(T), np.ones(T))
    lo += [-np.inf] * T
    hi += [float(c) for c in cap]
    row += T
    if asynchronous:
        # n_t >= k_0 x (first stage on t) and n_t <= cap_t x; the loop: Σ loop x <= budget Σ n
        f = seg[first]
        add(row + tt[f], f, -kk[f])
        add(row + np.arange(T), cols["n"] + np.arange(T), np.ones(T))
        lo += [0.0] * T
        hi += [np.inf] * T
        row += T
        add(row + tt[f], f, -cap[tt[f]].astype(np.float64))
        add(row + np.arange(T), cols["n"] + np.arange(T), np.ones(T))
        lo += [-np.inf] * T
        hi += [0.0] * T
        row += T
        add(np.full(n_seg, row), seg, loop[ii, jj, tt])
        add(np.full(T, row), cols["n"] + np.arange(T), np.full(T, -budget * (1.0 + ROW_SLACK)))
        lo.append(-np.inf)
        hi.append(0.0)
        row += 1
    else:
        # sync (or hosted: one DataWorker): the loop of one DataWorker within the budget
        add(np.full(n_seg, row), seg, loop[ii, jj, tt])
        if "M" in cols:
            add([row], [cols["M"]], [float(levels.K - 1)])
        lo.append(-np.inf)
        hi.append(budget * (1.0 + ROW_SLACK))
        row += 1
        if "M" in cols:  # M >= busy of every chosen stage
            add(row + seg, seg, levels.busy[hosted][ii, jj, tt])
            add(row + seg, np.full(n_seg, cols["M"]), -np.ones(n_seg))
            lo += [-np.inf] * n_seg
            hi += [0.0] * n_seg
            row += n_seg
    for (per, _, _), limit in zip(levels.hosts, levels.host_budgets(hosted, target), strict=True):
        if limit < 0:
            return None
        add(np.full(n_seg, row), seg, per[hosted][ii, jj, tt])
        lo.append(-np.inf)
        hi.append(limit * (1.0 + ROW_SLACK))
        row += 1
    if bump:
        # y_t only where a stage on t can take it; some count is at least 2
        on_t = seg if not asynchronous else seg[~first]
        add(row + tt[on_t], on_t, -np.ones(len(on_t)))
        add(row + np.arange(T), cols["y"] + np.arange(T), np.ones(T))
        lo += [-np.inf] * T
        hi += [0.0] * T
        row += T
        two = seg[(kk >= 2) & ~first] if asynchronous else seg[kk >= 2]
        add(np.full(len(two), row), two, np.ones(len(two)))
        add(np.full(T, row), cols["y"] + np.arange(T), np.ones(T))
        if asynchronous:
            add([row], [cols["v"]], [1.0])
        lo.append(1.0)
        hi.append(np.inf)
        row += 1
        if asynchronous:  # v <= Σ n - 1: a second DataWorker
            add([row], [cols["v"]], [1.0])
            add(np.full(T, row), cols["n"] + np.arange(T), -np.ones(T))
            lo.append(-np.inf)
            hi.append(-1.0)
            row += 1
    A = coo_matrix(
        (np.concatenate(r_v), (np.concatenate(r_i), np.concatenate(r_j))), shape=(row, n_var)
    ).tocsr()
    price = levels.price
    c = np.zeros(n_var)
    if asynchronous:
        c[:n_seg] = np.where(first, 0.0, kk * price[tt])
        c[cols["n"] : cols["n"] + T] = price
    else:
        c[:n_seg] = kk * price[tt]
    if bump:
        c[cols["y"] : cols["y"] + T] = price
    integrality = np.ones(n_var)
    var_lo = np.zeros(n_var)
    var_hi = np.ones(n_var)
    if asynchronous:
        var_hi[cols["n"] : cols["n"] + T] = cap
    if "M" in cols:
        integrality[cols["M"]] = 0
        var_hi[cols["M"]] = np.inf
    options: dict[str, Any] = {
        "mip_rel_gap": 0.0,
        **MIP_OPTIONS,
        **(PRIMAL_HEURISTICS_OFF if objective else {}),
    }
    if n_seg >= PSEUDO_COST_FROM_SEGMENTS:
        options["mip_pscost_minreliable"] = 0
    limit = math.inf
    if objective and math.isfinite(upper):
        # prune every node that cannot beat the incumbent (a plan at `upper` is known): HiGHS then finds
        # nothing below it when nothing cheaper exists, and `RuntimeLevels.solve` keeps the incumbent
        limit = upper - levels.shards_rate(hosted, m)
        options["objective_bound"] = limit
    left = levels.deadline - time.perf_counter()
    if math.isfinite(left):
        options["time_limit"] = max(left, 0.1)
    levels.ilp_solves += 1
    result = solve_milp(
        c=c if objective else np.zeros(n_var),
        constraints=LinearConstraint(A, np.array(lo), np.array(hi)),
        integrality=integrality,
        bounds=Bounds(var_lo, var_hi),
        options=options,
    )
    if result.status == 2:  # proven infeasible
        return None
    if result.status != 0 or result.x is None:
        levels.proof.solver_optimal = False
        levels.proof.notes.append(f"ILP at {target:.6g} samples/s: {result.message}")
        if result.x is None:
            return None
    x = result.x
    chosen = np.flatnonzero(x[:n_seg] > 0.5)
    path = sorted((int(ii[s]), int(jj[s]), int(tt[s])) for s in chosen)
    if not objective:
        return Level(math.nan, -math.inf, assignment_of(path))
    found = float(c @ np.round(x))
    fixed = levels.shards_rate(hosted, m)
    dual = getattr(result, "mip_dual_bound", None)
    proven = found if dual is None or not math.isfinite(dual) else min(found, float(dual))
    if found > limit:
        # a plan above the objective bound (one HiGHS met before the bound pruned the rest) comes back
        # "optimal" with its own cost as the dual bound, though cheaper plans above the bound can exist
        # (measured: 16.2128 "optimal" where 16.1888 is feasible): what it proved is the bound
        proven = limit if result.status == 0 else min(proven, limit)
    return Level(found + fixed, proven + fixed, assignment_of(path))
