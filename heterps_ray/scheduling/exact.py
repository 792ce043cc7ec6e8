"""Exact schedulers: brute force over assignments, and an exact search over throughput levels.

`brute` enumerates every assignment and provisions each exactly (T^L plans; small problems only).
`exact` does that up to BRUTE_FORCE_LIMIT assignments and the level search above it.

A problem with runtime terms (DESIGN.md §3b) couples its stages through the DataWorker's loop and the
shared hosts, which the level search's per-segment DP does not see: above BRUTE_FORCE_LIMIT
assignments `exact` walks the same levels with each level solved as an ILP over the stages
(runtime_levels.py), and the fastest plan comes from the same search.

The level search is exact for any size (tests check it equals brute force). For a target X the
cheapest cost *rate* R*(X) is a shortest path over stage boundaries: a stage is a segment of
layers i..j on type t needing k(i,j,t,X) replicas (closed form from Amdahl), and adjacent stages
must differ in type (else they would be one stage). That is a DP over (layer, type of the last
stage) in O(L^2 T^2). The per-type max_instances couple the stages; when the DP's path breaks
them, a DP that also counts the instances of the offending types solves that level exactly (types
are added until the path keeps every limit), or, when that state space is too large, an ILP over
the same segments (scipy.optimize.milp / HiGHS) after a Lagrangian bound prunes them.

Cost = R * N / Theta is not monotone, so we walk the levels: X_0 = floor; solve R*(X_n);
its plan has throughput Theta_n >= X_n at rate R_n = R*(X_n); next X_{n+1} = Theta_n (1 + STEP_RTOL).
Each step raises Theta strictly. Let P* be optimal and X_n the last level <= Theta(P*): the plan
found there costs R_n <= R(P*) and reaches Theta_n >= Theta(P*), so it is at least as cheap. This
needs R_n to be R*(X_n) exactly: the DPs are exact, and the ILP fallback runs with no MIP gap. The
bounds that skip or stop, each a lower bound for the reason given:

* the relaxed DP's rate R_lb(X) <= R*(X): each stage within its own type's limit, not their sum,
  a relaxation of the plans reaching X; R* never falls as X rises (a plan reaching X' reaches X);
* theta_max (the relaxed max_throughput) >= every plan's throughput: a plan's throughput is one of
  the candidates {theta_s(k)} U {theta_ps(m)}, and the first candidate the relaxation rejects no
  plan reaches.

We skip to R_lb(X) N / 3600 / C (C the best cost found: a plan in between costs R / Theta > C) and
stop when R_lb(X) N / 3600 / theta_max >= C, or X > theta_max. Every plan found is re-provisioned
exactly for its assignment, which can only lower its cost. scheduling/milp.py is a second
formulation of the same optimum (tests/test_milp.py).

Why not one ILP as the scheduler: cost R/Theta is not linear; with z = 1/Theta it is a sum of count x z
products, which milp.py linearises with a binary per count, a program whose relaxation is weak and
which HiGHS solves far slower than the walk at size. For a fixed level it is a shortest path with a
few side constraints, which the DPs solve exactly and fast (the ILP is the fallback for huge
instance limits).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from heterps_ray.costmodel import CostModel, Problem
from heterps_ray.costmodel.formulas import FLOOR_RTOL, S_PER_HOUR, fewest_replicas, stage_throughput
from heterps_ray.costmodel.plan import Plan
from heterps_ray.costmodel.pricing import monetary_cost
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling.base import Scheduler, register_scheduler
from heterps_ray.scheduling.provisioning import (
    REACH_RTOL,
    STEP_RTOL,
    Provisioned,
    plan_from_counts,
    provision_counts,
)
from heterps_ray.scheduling.segment_paths import cheapest_path, through

DP_STATE_LIMIT = 20_000  # instance-count states of the counting DP; above it: Lagrangian + ILP
_TOO_MANY_STATES = object()
BRUTE_FORCE_LIMIT = 256  # assignments; above this `exact` (method "auto") uses the level search
RUNTIME_BRUTE_LIMIT = 200_000  # assignments `brute` enumerates for a problem with runtime terms


def count_assignments(problem: Problem) -> int:
    """Runnable assignments: the product over layers of the types that can run them."""
    return math.prod(len(layer.time_ms) for layer in problem.layers)


# ---------------------------------------------------------------------------------------------
# Brute force


def brute_force(
    problem: Problem, model: CostModel | None = None, limit: int = 1_000_000, scheduler: str = "brute"
) -> Plan:
    """Every runnable assignment, provisioned exactly; the cheapest feasible (else the fastest)."""
    started = time.perf_counter()
    model = model or CostModel(problem)
    n = count_assignments(problem)
    if n > limit:
        raise ConfigError(
            None, "scheduler", f"a problem with at most {limit:,} assignments for brute force", n
        )
    choices = [np.flatnonzero(model.runnable[li]).tolist() for li in range(problem.num_layers)]
    best: tuple[tuple[int, ...], Provisioned] | None = None
    fastest: tuple[tuple[int, ...], Provisioned] | None = None
    for assignment in itertools.product(*choices):
        counts = provision_counts(model, assignment)
        if counts.feasible and (best is None or counts.cost < best[1].cost):
            best = (assignment, counts)
        if fastest is None or (-counts.max_throughput, counts.cost) < (
            -fastest[1].max_throughput,
            fastest[1].cost,
        ):
            fastest = (assignment, counts)
    assert fastest is not None  # every layer can run somewhere (validated), so n >= 1
    chosen = best or fastest
    return plan_from_counts(
        problem,
        model,
        chosen[0],
        chosen[1],
        scheduler=scheduler,
        seconds=time.perf_counter() - started,
        plans_evaluated=n,
        best_throughput=fastest[1].max_throughput,
    )


def _runtime_fastest(model: CostModel, known: float = 0.0) -> tuple[float, tuple[int, ...] | None]:
    """fastest_plan for a problem with runtime terms: the ILP levels' bisection (runtime_levels.py)."""
    from heterps_ray.scheduling.runtime_levels import RuntimeLevels

    search = RuntimeLevels(model)
    seeds = [(t,) * model.num_layers for t in range(model.num_types) if model.runnable[:, t].all()]
    fastest: tuple[int, ...] | None = None
    for assignment in seeds:
        most = provision_counts(model, assignment).max_throughput
        if most > known:
            known, fastest = most, assignment
    if known <= 0.0:  # any plan at all: the lowest level
        level = search.solve(1e-9, objective=False)
        if level is None:
            return 0.0, None
        fastest = level.assignment
        known = provision_counts(model, fastest).max_throughput
        if known <= 0.0:
            return 0.0, None
    theta_max, reached = search.fastest(known, search.throughput_bound(known))
    return theta_max, reached or fastest


# ---------------------------------------------------------------------------------------------
# Level search (DP over stage boundaries, ILP when max_instances bind)


@dataclass(frozen=True)
class _Level:
    """The cheapest plan at one target throughput."""

    rate: float  # $/hour
    assignment: tuple[int, ...]
    replicas: tuple[int, ...]
    ps_shards: int
    throughput: float  # samples/s actually reached (>= the target)


class _LevelSearch:
    def __init__(self, model: CostModel, state_limit: int = DP_STATE_LIMIT):
        self.model = model
        self.state_limit = state_limit
        L, T = model.num_layers, model.num_types
        self.L, self.T = L, T
        self.tau, self.alpha = model.segment_tables()  # [L, L, T]
        self.valid = np.isfinite(self.tau)
        self.cap = model.max_instances.astype(np.int64)
        self.shards = np.arange(model.ps_min_shards, int(self.cap[model.ps_type]) + 1)
        self.ps_table = np.array([model.ps_throughput(int(m)) for m in self.shards])
        self.solves = 0
        self.counting_solves = 0
        self.ilp_solves = 0

    # -- one level -----------------------------------------------------------------------------

    def replicas_needed(self, target: float) -> np.ndarray:
        """k(i,j,t): fewest replicas of segment (i,j,t) reaching `target` samples/s (huge if none)."""
        k = fewest_replicas(self.model.batch_size, self.tau, self.alpha, target)
        return np.minimum(np.where(self.valid, k, np.inf), 1e12)

    def solve(self, target: float, relaxed: bool = False) -> _Level | None:
        """Cheapest cost rate over plans reaching `target` within max_instances; None if none does.

        relaxed: each stage within its type's limit, but not their sum (a bound, no ILP)."""
        self.solves += 1
        model = self.model
        reach = target * (1.0 - REACH_RTOL)
        if model.rows_per_sample > 0.0:
            idx = int(np.searchsorted(self.ps_table, reach, side="left"))
            if idx >= len(self.shards):
                return None
        else:
            idx = 0
        m = int(self.shards[idx])
        cap = self.cap.copy()
        cap[model.ps_type] -= m
        k = self.replicas_needed(reach)
        seg_ok = k <= cap[None, None, :]
        seg_rate = np.where(seg_ok, k * model.price[None, None, :], np.inf)
        path = cheapest_path(seg_rate)[1]
        if path is None:
            return None
        usage = self._usage(path, k)
        if not relaxed and (usage > cap).any():
            path = self._constrained_path(seg_rate, k, cap, path)
            if path is None:
                return None
        return self._level(path, k, m)

    def _usage(self, path: list[tuple[int, int, int]], k: np.ndarray) -> np.ndarray:
        usage = np.zeros(self.T, dtype=np.int64)
        for i, j, t in path:
            usage[t] += int(k[i, j, t])
        return usage

    def _rate(self, path: list[tuple[int, int, int]], seg_rate: np.ndarray) -> float:
        return float(sum(seg_rate[s] for s in path))

    def _constrained_path(
        self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, path: list[tuple[int, int, int]]
    ) -> list[tuple[int, int, int]] | None:
        """Cheapest path within max_instances.

        First a DP whose state also counts the instances of the types whose limits the free path
        breaks (adding types until the path keeps every limit: exact, as the untracked limits only
        relax it). When that state space is too large: a Lagrangian relaxation of the limits, then
        the ILP over the segments its bound cannot exclude."""
        tracked = sorted(int(t) for t in np.flatnonzero(self._usage(path, k) > cap))
        while True:
            counted = self._counting_dp(seg_rate, k, cap, tracked)
            if counted is _TOO_MANY_STATES:
                break
            if counted is None:
                return None
            assert isinstance(counted, list)
            over = np.flatnonzero(self._usage(counted, k) > cap)
            if len(over) == 0:
                return counted
            tracked = sorted(set(tracked) | {int(t) for t in over})
        return self._lagrangian_then_ilp(seg_rate, k, cap, path)

    def _counting_dp(
        self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, tracked: list[int]
    ) -> list[tuple[int, int, int]] | None | object:
        """Shortest path whose state is (layer, last type, instances used of each tracked type)."""
        L, T = self.L, self.T
        dims = [int(cap[t]) + 1 for t in tracked]
        U = math.prod(dims)
        if U > self.state_limit:
            return _TOO_MANY_STATES
        self.counting_solves += 1
        coords = np.indices(dims).reshape(len(dims), U) if dims else np.zeros((0, 1), dtype=np.int64)
        strides = [math.prod(dims[d + 1 :]) for d in range(len(dims))]
        axis_of = {t: d for d, t in enumerate(tracked)}
        idx = np.arange(U)
        best = np.full((L, T, U), np.inf)
        came_from = np.zeros((L, T, U), dtype=np.int16)  # start layer of the last stage
        prev_type = np.full((L, T, U), -1, dtype=np.int8)
        excl = np.full((L, T, U), np.inf)  # excl[j, t]: best[j, t' != t], and which t'
        excl_type = np.full((L, T, U), -1, dtype=np.int8)
        start = np.full(U, np.inf)
        start[0] = 0.0
        for j in range(L):
            for t in range(T):
                # every stage (i..j on t) at once: state u comes from state u - k(i,j,t) of type t's
                # axis (or u itself, untracked) after a chain to i - 1 whose last stage is not on t
                starts = np.flatnonzero(np.isfinite(seg_rate[: j + 1, j, t]))
                if len(starts) == 0:
                    continue
                chains = np.where(
                    (starts == 0)[:, None], start[None, :], excl[np.maximum(starts - 1, 0), t]
                )  # [starts, U]
                if t in axis_of:  # usage of t grows by k: shift the state
                    d = axis_of[t]
                    kk = k[starts, j, t].astype(np.int64)[:, None]
                    ok = coords[d][None, :] >= kk
                    src_idx = np.where(ok, idx[None, :] - kk * strides[d], 0)
                    value = np.where(ok, np.take_along_axis(chains, src_idx, axis=1), np.inf)
                else:
                    src_idx = np.broadcast_to(idx, chains.shape)
                    value = chains
                value = value + seg_rate[starts, j, t][:, None]
                pick = np.argmin(value, axis=0)  # the first (lowest i) of equal values
                found = value[pick, idx]
                reached = np.isfinite(found)
                chosen = starts[pick]
                from_state = src_idx[pick, idx]
                best[j, t] = found
                came_from[j, t] = np.where(reached, chosen, 0)
                prev_type[j, t] = np.where(
                    reached & (chosen > 0), excl_type[np.maximum(chosen - 1, 0), t, from_state], -1
                )
            if T > 1:
                order = np.argsort(best[j], axis=0)  # [T, U]
                first, second = order[0], order[1]
                for t in range(T):
                    other = np.where(first == t, second, first)
                    excl[j, t] = best[j, other, idx]
                    excl_type[j, t] = other
        flat = int(np.argmin(best[L - 1]))
        t, u = divmod(flat, U)
        if not math.isfinite(best[L - 1, t, u]):
            return None
        path, j = [], L - 1
        while j >= 0:
            i, before = int(came_from[j, t, u]), int(prev_type[j, t, u])
            path.append((i, j, t))
            if t in axis_of:
                u -= int(k[i, j, t]) * strides[axis_of[t]]
            t, j = before, i - 1
        return path[::-1]

    def _lagrangian_then_ilp(
        self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, path: list[tuple[int, int, int]]
    ) -> list[tuple[int, int, int]] | None:
        """Lagrangian relaxation of the limits (subgradient on lambda): lower bounds and often a
        feasible path that meets them; otherwise the segments its bound cannot exclude go to the ILP."""
        T = self.T
        lam = np.zeros(T)
        lower = self._rate(path, seg_rate)  # the unconstrained optimum bounds the constrained one
        upper, incumbent = math.inf, None
        step = max(float(self.model.price.max()), 1e-9)
        for _ in range(30):
            priced = seg_rate + k * lam[None, None, :]
            candidate = cheapest_path(priced)[1]
            if candidate is None:
                break
            usage = self._usage(candidate, k)
            lower = max(lower, self._rate(candidate, priced) - float(lam @ cap))
            if (usage <= cap).all():
                rate = self._rate(candidate, seg_rate)
                if rate < upper:
                    upper, incumbent = rate, candidate
            if upper <= lower * (1.0 + 1e-12):
                return incumbent
            violation = (usage - cap).astype(np.float64)
            lam = np.maximum(0.0, lam + step * violation / max(float(np.abs(violation).sum()), 1.0))
            step *= 0.8
        # prune by the Lagrangian bound of the best path through each segment
        priced = seg_rate + k * lam[None, None, :]
        bound = through(priced) - float(lam @ cap)
        keep = np.isfinite(seg_rate) & (bound <= upper * (1.0 + 1e-9))
        return self._ilp(np.where(keep, seg_rate, np.inf), k, cap)

    def _ilp(self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray) -> list[tuple[int, int, int]] | None:
        """The same shortest path with the per-type instance limits, as a 0/1 program."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import lil_matrix

        self.ilp_solves += 1
        L, T = self.L, self.T
        segs: list[tuple[int, int, int]] = [
            (int(i), int(j), int(t)) for i, j, t in np.argwhere(np.isfinite(seg_rate))
        ]
        n = len(segs)
        if n == 0:
            return None
        rows: list[tuple[dict[int, float], float, float]] = []
        starts: dict[int, list[int]] = {}
        ends: dict[int, list[int]] = {}
        for v, (i, j, _) in enumerate(segs):
            starts.setdefault(i, []).append(v)
            ends.setdefault(j, []).append(v)
        rows.append(({v: 1.0 for v in starts.get(0, [])}, 1.0, 1.0))  # one stage starts at layer 0
        for b in range(1, L):  # a stage ending at b-1 is followed by one starting at b
            coef = {v: 1.0 for v in ends.get(b - 1, [])}
            for v in starts.get(b, []):
                coef[v] = coef.get(v, 0.0) - 1.0
            rows.append((coef, 0.0, 0.0))
        rows.append(({v: 1.0 for v in ends.get(L - 1, [])}, 1.0, 1.0))
        for b in range(1, L):  # neighbours differ in type
            for t in range(T):
                coef = {v: 1.0 for v in ends.get(b - 1, []) if segs[v][2] == t}
                for v in starts.get(b, []):
                    if segs[v][2] == t:
                        coef[v] = 1.0
                if len(coef) > 1:
                    rows.append((coef, -np.inf, 1.0))
        for t in range(T):  # max_instances
            coef = {v: float(k[segs[v]]) for v in range(n) if segs[v][2] == t}
            if coef:
                rows.append((coef, -np.inf, float(cap[t])))
        A = lil_matrix((len(rows), n))
        for r, (coef, _, _) in enumerate(rows):
            for v, c in coef.items():
                A[r, v] = c
        result = milp(
            c=np.array([seg_rate[s] for s in segs]),
            constraints=LinearConstraint(A.tocsr(), [lo for _, lo, _ in rows], [hi for _, _, hi in rows]),
            integrality=np.ones(n),
            bounds=Bounds(0, 1),
            # the walk steps past every level up to this plan's throughput on the claim that its rate
            # is R*(X): HiGHS' default gap (1e-4) would let a plan 0.01% dearer stand for R*(X)
            options={"mip_rel_gap": 0.0},
        )
        if result.x is None:
            return None
        chosen = [segs[v] for v in np.flatnonzero(result.x > 0.5)]
        return sorted(chosen)

    def _level(self, path: list[tuple[int, int, int]], k: np.ndarray, m: int) -> _Level:
        model = self.model
        assignment: list[int] = []
        replicas = []
        throughput = model.ps_throughput(m)
        rate = m * float(model.price[model.ps_type])
        for i, j, t in path:
            assignment += [t] * (j - i + 1)
            kk = int(k[i, j, t])
            replicas.append(kk)
            rate += kk * float(model.price[t])
            tau, alpha = float(self.tau[i, j, t]), float(self.alpha[i, j, t])
            throughput = min(throughput, stage_throughput(model.batch_size, tau, alpha, kk))
        return _Level(rate, tuple(assignment), tuple(replicas), m, throughput)

    # -- all levels ----------------------------------------------------------------------------

    def max_throughput(self, relaxed: bool = False, known: float = 0.0, bound: float = math.inf) -> float:
        """Highest throughput any plan reaches within max_instances (binary search over candidates);
        relaxed: an upper bound that checks each stage against its type's limit alone.

        `known`: a throughput some plan is known to reach, `bound`: one no plan exceeds (e.g. the
        relaxed bound); candidates outside them are not solved (fewer exact levels, same answer)."""
        cap_any = int(self.cap.max())
        ks = np.arange(1, cap_any + 1, dtype=np.float64)
        thetas = stage_throughput(
            self.model.batch_size, self.tau, self.alpha, ks[:, None, None, None]
        )  # [K, L, L, T]
        allowed = (ks[:, None, None, None] <= self.cap[None, None, :]) & self.valid[None]
        candidates = np.unique(np.concatenate([thetas[allowed], self.ps_table]))
        candidates = candidates[(candidates > 0.0) & (candidates <= bound * (1.0 + STEP_RTOL))]
        if len(candidates) == 0:
            return 0.0
        # invariant: candidates[<= lo] reachable (or lo = -1), candidates[> hi] not
        lo = int(np.searchsorted(candidates, known * (1.0 - REACH_RTOL), side="right")) - 1
        hi = len(candidates) - 1
        if lo < 0:
            if self.solve(float(candidates[0]), relaxed) is None:
                return 0.0
            lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            target = float(candidates[mid])
            level = self.solve(target, relaxed=True)
            if level is not None and not relaxed:
                # cheap first: the relaxed plan's assignment, provisioned exactly, often reaches the
                # level (and beyond: jump there); only when it does not is the level solved exactly
                reached = provision_counts(self.model, level.assignment).max_throughput
                if reached >= target * (1.0 - REACH_RTOL):
                    lo = max(
                        mid, int(np.searchsorted(candidates, reached * (1.0 + REACH_RTOL), side="right")) - 1
                    )
                    continue
                level = self.solve(target)
            if level is not None:
                lo = mid
            else:
                hi = mid - 1
        return float(candidates[lo])

    def cheapest(
        self, floor: float, theta_max: float, seeds: Sequence[tuple[int, ...]] = ()
    ) -> tuple[tuple[int, ...], Provisioned] | None:
        """The cheapest plan at or above `floor`; `theta_max` bounds every plan's throughput.

        `seeds` are assignments priced first as incumbents. With an incumbent of cost C, the
        relaxed rate R_lb(X) <= R*(X) proves every plan with throughput below R_lb(X) N / 3600 / C
        no cheaper, so the walk jumps there without solving the levels in between exactly."""
        model = self.model
        best: tuple[tuple[int, ...], Provisioned] | None = None

        def consider(assignment: tuple[int, ...]) -> None:
            nonlocal best
            counts = provision_counts(model, assignment)
            if counts.feasible and (best is None or counts.cost < best[1].cost):
                best = (assignment, counts)

        for assignment in seeds:
            consider(assignment)
        target = floor * (1.0 - FLOOR_RTOL)
        while target <= theta_max * (1.0 + STEP_RTOL):
            bound = self.solve(max(target, 0.0), relaxed=True)
            if bound is None:
                break
            consider(bound.assignment)
            if best is not None:
                if monetary_cost(bound.rate, model.samples, theta_max) >= best[1].cost:
                    break  # no faster level can be cheaper: R* only grows, Theta <= theta_max
                skip_to = bound.rate * model.samples / S_PER_HOUR / best[1].cost  # where R / Θ = best cost
                if skip_to > target * (1.0 + STEP_RTOL):
                    target = skip_to
                    continue
            level = self.solve(max(target, 0.0))
            if level is None:
                break
            consider(level.assignment)
            if math.isinf(level.throughput):
                break
            target = level.throughput * (1.0 + STEP_RTOL)
        return best


def level_search(problem: Problem, model: CostModel | None = None, state_limit: int = DP_STATE_LIMIT) -> Plan:
    """The exact optimum via the level search (see the module docstring). `state_limit` caps the
    counting DP's states per level; above it a level goes to Lagrangian relaxation + ILP."""
    started = time.perf_counter()
    model = model or CostModel(problem)
    search = _LevelSearch(model, state_limit)
    theta_bound = search.max_throughput(relaxed=True)
    singles = [(t,) * model.num_layers for t in range(model.num_types) if model.runnable[:, t].all()]
    found = search.cheapest(model.floor, theta_bound, singles) if theta_bound > 0.0 else None
    theta_max = None  # only needed, and only computed exactly, when nothing meets the floor
    if found is None:  # the fastest plan
        theta_max = search.max_throughput() if theta_bound > 0.0 else 0.0
        level = search.solve(theta_max) if theta_max > 0.0 else None
        assignment = level.assignment if level else tuple(int(np.argmax(r)) for r in model.runnable)
        counts = provision_counts(model, assignment)
    else:
        assignment, counts = found
    return plan_from_counts(
        problem,
        model,
        assignment,
        counts,
        scheduler="exact",
        seconds=time.perf_counter() - started,
        plans_evaluated=search.solves,
        best_throughput=theta_max,
        extra={
            "method": "levels",
            "proof": {
                "kind": "level walk, levels solved by DP",
                "proven": True,
                "stop": "the DP's rate at the level / max throughput >= cost, or no faster level",
            },
            "levels_solved": search.solves,
            "counting_dp_solves": search.counting_solves,
            "ilp_solves": search.ilp_solves,
        },
    )


def max_reachable_throughput(problem: Problem, relaxed: bool = False) -> float:
    """Highest throughput any plan of `problem` reaches within its max_instances (samples/s).

    relaxed: a fast upper bound that checks each stage against its type's limit, not their sum."""
    if problem.runtime is not None:
        if relaxed:
            return throughput_bounds(problem).upper
        return _runtime_fastest(CostModel(problem))[0]
    return _LevelSearch(CostModel(problem)).max_throughput(relaxed)


def fastest_plan(
    problem: Problem, model: CostModel | None = None, known: float = 0.0
) -> tuple[float, tuple[int, ...] | None]:
    """(highest throughput any plan reaches within max_instances, the assignment of a plan that
    reaches it); (0.0, None) when no plan runs at all. One search decides both, so a scheduler that
    reports "infeasible" with this throughput cannot contradict itself. `known`: a throughput some
    plan is known to reach (speeds the search up, same answer)."""
    if problem.runtime is not None:
        return _runtime_fastest(model or CostModel(problem), known)
    search = _LevelSearch(model or CostModel(problem))
    bound = search.max_throughput(relaxed=True, known=known)
    theta_max = search.max_throughput(known=known, bound=bound) if bound > 0.0 else 0.0
    level = search.solve(theta_max) if theta_max > 0.0 else None
    return theta_max, None if level is None else tuple(int(t) for t in level.assignment)


class ThroughputBounds(NamedTuple):
    """Bounds on the highest throughput any plan reaches (samples/s)."""

    lower: float  # a plan reaches it
    upper: float  # no plan exceeds it


def throughput_bounds(problem: Problem, model: CostModel | None = None) -> ThroughputBounds:
    """Bounds on the highest reachable throughput, fast (no ILP; ~0.1 s at 120 layers x 8 types).

    upper: the base model's relaxed level search (each stage within its own type's limit, not their
    sum: every plan passes it, so a level it fails no plan reaches); with runtime terms the bisection
    of RuntimeLevels.reachable, the same relaxation with the loop and hosts (its docstring says why
    every plan passes it). lower: the fastest counts of single-type plans and of the relaxed fastest
    plan's assignment, provisioned exactly (plans that exist). A floor above `upper` is met by no plan:
    the policy's refusal rests on it (rl/scheduler.py)."""
    model = model or CostModel(problem)
    singles = [(t,) * model.num_layers for t in range(model.num_types) if model.runnable[:, t].all()]
    if problem.runtime is not None:
        from heterps_ray.scheduling.runtime_levels import RuntimeLevels

        runtime = RuntimeLevels(model)
        lower = max((provision_counts(model, a).max_throughput for a in singles), default=0.0)
        return ThroughputBounds(lower, runtime.throughput_bound(max(lower, 1e-9)))
    search = _LevelSearch(model)
    upper = search.max_throughput(relaxed=True)
    level = search.solve(upper, relaxed=True) if upper > 0.0 else None
    if level is not None:
        singles.append(level.assignment)
    lower = max((provision_counts(model, a).max_throughput for a in singles), default=0.0)
    return ThroughputBounds(lower, upper)


@register_scheduler("exact")
class ExactScheduler(Scheduler):
    """The optimum. method: "auto" (brute force up to BRUTE_FORCE_LIMIT assignments, else the
    level search: DP levels for the base model, ILP levels with runtime terms), "levels" (any
    size) or "brute" (small problems only). plan.extra["proof"] says what proves it optimal."""

    name = "exact"

    def __init__(self, method: str = "auto", seed: int = 0, budget_s: float | None = None):
        if method not in ("levels", "brute", "auto"):
            raise ConfigError(None, "method", "levels, brute or auto", method)
        self.method = method

    def schedule(self, problem: Problem) -> Plan:
        runtime = problem.runtime is not None
        n = count_assignments(problem)
        use_brute = self.method == "brute" or (self.method == "auto" and n <= BRUTE_FORCE_LIMIT)
        if use_brute:
            limit = RUNTIME_BRUTE_LIMIT if runtime else 1_000_000
            plan = brute_force(problem, scheduler=self.name, limit=limit)
            proof = {"kind": "enumeration of every assignment, each provisioned exactly", "proven": True}
            return replace(plan, extra={**plan.extra, "method": "brute", "proof": proof})
        if runtime:
            return runtime_plan(problem, scheduler=self.name)
        return replace(level_search(problem), scheduler=self.name)


def runtime_plan(problem: Problem, scheduler: str = "exact", time_limit_s: float | None = None) -> Plan:
    """The exact optimum of a problem with runtime terms by the ILP level walk, as a Plan whose
    extra["proof"] says what proves it (runtime_levels.py)."""
    from heterps_ray.scheduling.runtime_levels import runtime_level_search

    started = time.perf_counter()
    model = CostModel(problem)
    assignment, counts, best_throughput, extra = runtime_level_search(problem, model, time_limit_s)
    return plan_from_counts(
        problem,
        model,
        assignment,
        counts,
        scheduler=scheduler,
        seconds=time.perf_counter() - started,
        plans_evaluated=int(extra["levels_solved"]),
        best_throughput=best_throughput,
        extra=extra,
    )


@register_scheduler("brute")
def _brute(seed: int = 0, budget_s: float | None = None) -> ExactScheduler:
    scheduler = ExactScheduler(method="brute")
    scheduler.name = "brute"
    return scheduler
