"""The exact optimum of a problem with runtime terms (DESIGN.md §3b): the level walk of exact.py with
each level solved as a 0/1 program over stages (scipy.optimize.milp, HiGHS).

Why the per-segment DP of the base model is not enough: the runtime terms couple the stages. A
DataWorker waits for a micro-batch's round through every stage, so the loop's time is a *sum* over
the stages (``loop = Σ busy_j + Σ waiting_j``, runtime_terms.py), and async DataWorkers (stage 0's
replicas ``n``) scale it: ``Θ_loop = n · 1000 · B · in_flight / (K · loop)``. A shared host's cores
are a second sum. For a target throughput X every term stays linear in the chosen stages:

* a stage (segment i..j on type t) reaching X needs k(i,j,t,X) replicas (Amdahl, closed form);
* the loop: ``Σ loop_s x_s ≤ (1000 · B · in_flight / (K · X)) · Σ_t n_t`` (async, n_t integer
  DataWorkers of stage 0's type), or ``Σ loop_s x_s + (K - 1) · M ≤ 1000 · B / X`` with
  ``M ≥ busy_s x_s`` (sync: GPipe's fill and drain);
* a host: ``Σ host_s x_s ≤ 1000 · B · free cores / (K · X)`` less the shards' service;
* max_instances per type, and stages of one type never adjacent (else they would be one stage).

So the cheapest cost rate R*(X) of plans reaching X is a shortest path with linear side
constraints: an ILP that HiGHS proves optimal (its dual bound is what the walk uses). With
``ps_hosting: auto`` a plan of one replica everywhere hosts its shards in the DataWorker (priced
differently): a level is the cheaper of the hosted program (every count 1) and the program on
actor shards with at least one count of 2 (a replica added where the minimal counts are all 1).

The walk over levels is exact.py's: X_0 = floor; the plan found at X_n reaches Θ_n >= X_n at its
rate R_n; the next level is above Θ_n (and above R*(X_n) · N / 3600 / C, C the best cost found). It
rests on R*(X) never falling as X rises (a plan reaching X' reaches every X <= X') and on these bounds,
each a lower bound for the reason given; a bound that cannot be shown to be one is not used:

* the DP bound ``lb(X) <= R*(X)`` (`lower_bound`): every segment weight is at most what a plan using
  the segment pays (its fewest counts at X, within its own type's limit, at their prices; async:
  the loop needs ``k_0 >= loop / c`` DataWorkers, so pricing the loop at ``p_t0 / c`` a ms gives a
  second weight no plan with its first stage on t0 pays less than), and the shards' fewest count;
* the ILP bound: HiGHS' dual bound over the segments a plan cheaper than the incumbent can use
  (`_through`, the same weights through each segment, excludes the others); plans using the others
  cost at least the incumbent, so min(incumbent, dual bound) <= R*(X);
* ``Θ_max`` (`throughput_bound`): a level `reachable` rejects no plan reaches (it checks each stage
  within its own type's limit, the cheapest loop with the most DataWorkers any type has, each host's
  cheapest CPU), and no plan reaching more reaches less, so every plan's Θ is below it.

Then: skip to ``lb(X) · N / 3600 / C`` (a plan between costs ``R / Θ >= lb / Θ > C``); stop once
``lb(X) · N / 3600 / Θ_max >= C``; step from X_n to Θ_n only when R_n is proven R*(X_n) (to the
solver's 1e-7): a plan with X_n <= Θ <= Θ_n then costs ``R / Θ >= R_n / Θ_n``. R_n and Θ_n are
one plan's (its assignment re-provisioned, rate_at), never the most the assignment reaches with more
replicas (issue 26: those replicas cost more than R*(X_n), so that step skipped cheaper plans).
Every plan found is re-provisioned exactly for its assignment (provisioning.py), which can only lower
its cost. The plan records the proof in ``plan.extra["proof"]``; scheduling/milp.py checks the
optimum by a second formulation (tests/test_milp.py).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from heterps_ray.costmodel import CostModel, Problem
from heterps_ray.costmodel.formulas import (
    BYTES_PER_MS_PER_GBPS,
    FLOOR_RTOL,
    MS_PER_S,
    S_PER_HOUR,
    fewest_replicas,
    stage_throughput,
)
from heterps_ray.costmodel.pricing import monetary_cost
from heterps_ray.costmodel.runtime_terms import call_ms
from heterps_ray.scheduling.provisioning import REACH_RTOL, STEP_RTOL, Provisioned, provision_counts
from heterps_ray.scheduling.segment_paths import assignment_of, cheapest_path, through

_ROW_SLACK = 1e-12  # the ILP's loop and host rows relaxed by this (relative): float rounding only
_SOLVER_RTOL = 1e-7  # a level whose ILP plan misses it within HiGHS' tolerances: the walk steps this far
_HUGE = 1e12  # replicas standing in for "no count reaches the level"


@dataclass
class Proof:
    """What the search proved, for plan.extra: every ILP's status and the bound that ended the walk."""

    ilp_solves: int = 0
    ilp_optimal: bool = True  # every ILP solved to proven optimality (or proven infeasible)
    levels_bounded: int = 0  # levels skipped by the DP bound
    levels_by_dp: int = 0  # levels solved by a DP candidate meeting the DP bound (no ILP)
    bisection_steps: int = 0  # exact feasibility checks for the fastest plan
    tolerance_steps: int = 0  # levels whose ILP plan missed them within HiGHS' tolerances (stepped 1e-7)
    stop: str = ""
    bound: float | None = None  # the lower bound on any plan's cost the walk ended with ($)
    notes: list[str] = field(default_factory=list)

    def to_extra(self, cost: float | None) -> dict[str, Any]:
        proven = self.ilp_optimal and self.stop != "time limit"
        return {
            "kind": "level walk, levels solved by ILP (HiGHS)",
            "proven": proven,
            "ilp_solves": self.ilp_solves,
            "ilp_all_optimal": self.ilp_optimal,
            "levels_skipped_by_dp_bound": self.levels_bounded,
            "levels_proven_by_dp": self.levels_by_dp,
            "bisection_steps": self.bisection_steps,
            "tolerance_steps": self.tolerance_steps,
            "stop": self.stop,
            "bound": self.bound,
            "cost": cost,
        }


@dataclass(frozen=True)
class _Level:
    rate: float  # $/hour of the plan found
    bound: float  # proven lower bound on R*(X) ($/hour)
    assignment: tuple[int, ...]
    throughput: float = math.nan  # samples/s the plan found reaches *at that rate* (nan: not priced)


class RuntimeLevels:
    """Per-segment runtime tables of one problem and the level ILP (see the module docstring)."""

    def __init__(self, model: CostModel, time_limit_s: float | None = None):
        problem, terms = model.problem, model.problem.runtime
        if terms is None:
            raise ValueError("RuntimeLevels needs a problem with a `runtime` section")
        self.model, self.terms = model, terms
        self.deadline = math.inf if time_limit_s is None else time.perf_counter() + time_limit_s
        L, T = model.num_layers, model.num_types
        self.L, self.T = L, T
        B, K = model.batch_size, terms.micro_batches
        self.B, self.K = B, K
        self.sync = terms.mode == "sync"
        self.auto = terms.ps_hosting == "auto"
        b = B / K
        types = problem.resources
        runnable = model.runnable
        per_layer = np.where(runnable, model.fixed_ms + model.per_sample_ms * b, 0.0)  # [L, T]
        zero = np.zeros((1, T))
        pre = np.concatenate([zero, np.cumsum(per_layer, axis=0)])
        pre_bad = np.concatenate([np.zeros((1, T), int), np.cumsum(~runnable, axis=0)])
        i = np.arange(L)[:, None, None]
        j = np.arange(L)[None, :, None]
        compute = pre[j[..., 0] + 1] - pre[i[..., 0]]  # [L, L, T]
        bad = ((pre_bad[j[..., 0] + 1] - pre_bad[i[..., 0]]) > 0) | (j < i)
        bw = np.array([r.bandwidth_gbps for r in types]) * BYTES_PER_MS_PER_GBPS  # bytes/ms
        rt = np.array([call_ms(problem, terms, r.name) for r in types])
        own = np.minimum(np.array([r.call_overhead_ms for r in types]), rt)
        out = np.array([layer.out_bytes_per_sample for layer in problem.layers]) * b
        calls = np.where(i == 0, 0, np.where(j == L - 1, 1, 2)) * np.ones((1, 1, T))
        recv = np.where(i > 0, 2.0 * out[np.maximum(i - 1, 0)] / bw, 0.0)
        send = np.where(j < L - 1, 2.0 * out[j] / bw, 0.0)
        other = calls * own + recv + send
        io = np.array([r.io_gbps for r in types]) * BYTES_PER_MS_PER_GBPS
        first = np.where(i == 0, problem.input_bytes_per_sample * b / io, 0.0)
        rows = model.rows_per_sample * b
        self.calls = calls
        self.compute = np.where(bad, np.inf, compute)
        self.waiting = calls * (rt - own)
        self.valid = ~bad
        _, self.alpha = model.segment_tables()
        self.busy = {}  # hosted (bool) -> busy ms per micro-batch [L, L, T]
        for hosted in (False, True):
            rate = terms.ps_hosted_ms_per_row if hosted else terms.ps_wait_ms_per_row
            ps_wait = np.where(i == 0, rows * rate, 0.0)
            self.busy[hosted] = np.where(bad, np.inf, compute + other + first + ps_wait)
        self.cap = model.max_instances.astype(np.int64)
        self.price = model.price
        self.ps_type = model.ps_type
        # hosts: per host, the per-segment CPU ms per micro-batch, its free cores, the shards' service
        self.hosts = []
        for host in problem.hosts or ():
            on = np.array([r.name in host.types for r in types])
            threads = np.array([min(r.threads or 1, host.cores) for r in types])
            call_cpu = host.call_cpu_ms if host.call_cpu_ms is not None else 0.0
            per = {}
            for hosted in (False, True):
                work = compute * threads + (self.busy[hosted] - compute) + self.waiting + calls * call_cpu
                per[hosted] = np.where(on[None, None, :] & ~bad, work, 0.0)
            service = 0.0
            if (
                types[model.ps_type].name in host.types
                and math.isfinite(model.ps_rows_per_second)
                and model.rows_per_sample > 0
            ):
                service = model.rows_per_sample * B / K / model.ps_rows_per_second * MS_PER_S
            self.hosts.append((per, host.cores - host.background_cores, service))
        self.shards = np.arange(model.ps_min_shards, int(self.cap[model.ps_type]) + 1)
        self.proof = Proof()
        self.pool: dict[tuple[int, ...], float] = {}  # assignments seen -> the most each reaches
        self._memo: tuple[float, tuple[float, list[tuple[int, ...]]]] | None = None

    # -- per level tables ----------------------------------------------------------------------

    def replicas(self, hosted: bool, target: float) -> np.ndarray:
        """k(i,j,t): fewest replicas of each segment reaching `target` as a stage (_HUGE: none).
        Sync: 1 where one replica reaches it (replicas add nothing there)."""
        tau = self.K * self.busy[hosted]
        reach = target * (1.0 - REACH_RTOL)
        if self.sync:
            theta = stage_throughput(self.B, tau, self.alpha, 1.0)
            return np.where(self.valid & (theta >= reach), 1.0, _HUGE)
        k = fewest_replicas(self.B, tau, self.alpha, reach)
        return np.where(self.valid & np.isfinite(k), np.minimum(k, _HUGE), _HUGE)

    def ps_shards(self, hosted: bool, target: float) -> int | None:
        """Shards for the level: the fewest reaching it (hosted: the fewest there are); None: none."""
        model = self.model
        if hosted or model.rows_per_sample <= 0.0:
            return int(self.shards[0])
        reach = target * (1.0 - REACH_RTOL)
        for m in self.shards:
            if model.ps_throughput(int(m)) >= reach:
                return int(m)
        return None

    def _cases(self) -> list[bool]:
        """hosted flags a plan can have: auto hosts one-replica plans, actors never."""
        return [False, True] if self.auto else [False]

    def loop_budget(self, target: float) -> float:
        """async: loop ms one DataWorker may take per micro-batch round; sync: ms per batch."""
        if self.sync:
            return MS_PER_S * self.B / target
        return MS_PER_S * self.B * self.terms.in_flight / (self.K * target)

    def host_budgets(self, hosted: bool, target: float) -> list[float]:
        return [MS_PER_S * self.B * free / (self.K * target) - (0.0 if hosted else service)
                for _, free, service in self.hosts]  # fmt: skip

    # -- lower bounds (DP) ---------------------------------------------------------------------

    def _case(self, hosted: bool, target: float) -> tuple[int, np.ndarray, np.ndarray, np.ndarray] | None:
        """(shards, limits left per type, k per segment, $/hour per segment) of one case at a level."""
        m = self.ps_shards(hosted, target)
        if m is None:
            return None
        cap = self.cap.copy()
        cap[self.ps_type] -= m
        k = self.replicas(hosted, target)
        if hosted:
            k = np.where(k <= 1.0, k, _HUGE)
        rate = np.where(k <= cap[None, None, :], k * self.price, np.inf)
        return m, cap, k, rate

    def _weights(self, hosted: bool, target: float, rate: np.ndarray) -> list[np.ndarray]:
        """Segment weights whose cheapest path through a segment bounds R from below: the counts
        alone, and (async on actor shards) per stage-0 type t0 the loop priced at p_t0 per DataWorker
        (R >= Σ_later k p + p_t0 · max(k_0, loop / c), c the loop one DataWorker may take)."""
        if self.sync or hosted:
            return [rate]
        c = self.loop_budget(target)
        loop = self.busy[hosted] + self.waiting
        out = []
        for t0 in range(self.T):
            if not np.isfinite(rate[0, :, t0]).any():
                continue
            plain = rate.copy()
            plain[0, :, :t0] = np.inf
            plain[0, :, t0 + 1 :] = np.inf
            mu = float(self.price[t0]) / c
            priced = np.where(np.isfinite(plain), plain + mu * loop, np.inf)
            priced[0, :, t0] = np.where(np.isfinite(plain[0, :, t0]), mu * loop[0, :, t0], np.inf)
            out.append((plain, priced))
        return out  # type: ignore[return-value]

    def lower_bound(self, target: float) -> tuple[float, list[tuple[int, ...]]]:
        """A lower bound on R*(target) ($/hour; inf: no plan reaches it) and the assignments of the
        relaxations' optima (candidates)."""
        if self._memo is not None and self._memo[0] == target:
            return self._memo[1]
        result = self._lower_bound(target)
        self._memo = (target, result)
        return result

    def _lower_bound(self, target: float) -> tuple[float, list[tuple[int, ...]]]:
        best, paths = math.inf, []
        for hosted in self._cases():
            case = self._case(hosted, target)
            if case is None:
                continue
            m, _, _, rate = case
            fixed = m * float(self.price[self.ps_type])
            weights = self._weights(hosted, target, rate)
            if self.sync or hosted:
                value, path = cheapest_path(rate)
                if path is not None:
                    paths.append(assignment_of(path))
                best = min(best, value + fixed)
                continue
            for plain, priced in weights:  # type: ignore[misc]
                v0, p0 = cheapest_path(plain)
                v1, p1 = cheapest_path(priced)
                paths += [assignment_of(p) for p in (p0, p1) if p is not None]
                best = min(best, max(v0, v1) + fixed)
        return best, list(dict.fromkeys(paths))

    def _through(self, hosted: bool, target: float, rate: np.ndarray) -> np.ndarray:
        """Per segment, a lower bound on the $/hour (shards excluded) of any plan using it."""
        weights = self._weights(hosted, target, rate)
        if self.sync or hosted:
            return through(rate)
        out = np.full(rate.shape, np.inf)
        for plain, priced in weights:  # type: ignore[misc]
            out = np.minimum(out, np.maximum(through(plain), through(priced)))
        return out

    def _heuristic(
        self, target: float, scale: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 64.0)
    ) -> list[tuple[int, ...]]:
        """Assignments of the DP with the loop (and the hosts' CPU) priced ever higher: plans that
        keep within the loop's budget, as upper bounds for a level's ILP."""
        out = []
        for hosted in self._cases():
            case = self._case(hosted, target)
            if case is None:
                continue
            _, _, _, rate = case
            loop = self.busy[hosted] + self.waiting
            weight = loop / self.loop_budget(target)
            for per, _, _ in self.hosts:
                weight = weight + per[hosted] / max(self.host_budgets(hosted, target)[0], 1e-12)
            unit = float(self.price.max())
            for f in scale:
                _, path = cheapest_path(np.where(np.isfinite(rate), rate + f * unit * weight, np.inf))
                if path is not None:
                    out.append(assignment_of(path))
        return list(dict.fromkeys(out))

    def remember(self, assignment: tuple[int, ...], reached: float, size: int = 24) -> None:
        """Keep an assignment as a candidate for the levels it reaches (the `size` fastest seen)."""
        self.pool[assignment] = reached
        if len(self.pool) > size:
            del self.pool[min(self.pool, key=lambda a: self.pool[a])]

    def rate_at(self, assignment: tuple[int, ...], target: float) -> tuple[float, float]:
        """(the fewest $/hour at which `assignment` reaches `target` within max_instances, the
        throughput those counts give); (inf, 0) when it never does. The walk steps to that throughput,
        not to the most the assignment reaches with more replicas: those cost more than the rate."""
        model = self.model
        reach = target * (1.0 - REACH_RTOL)
        stages = model.stage_times(list(assignment))
        best, reached = math.inf, 0.0
        m = self.ps_shards(False, target)
        if m is not None:
            tables, ceiling = model.throughput_tables(stages, [int(self.cap[s.type]) for s in stages])
            if ceiling >= reach:
                counts = [int(np.searchsorted(table, reach, side="left")) + 1 for table in tables]
                if all(k <= len(table) for k, table in zip(counts, tables, strict=True)):
                    if self.auto and all(k == 1 for k in counts):  # one more replica: the shards on actors
                        j = min(range(len(stages)), key=lambda s: float(self.price[stages[s].type]))
                        counts[j] += 1
                    ev = model.evaluate(list(assignment), counts, m)
                    if ev.available and ev.throughput >= reach:
                        best, reached = ev.cost_rate, ev.throughput
        if self.auto:
            ev = model.evaluate(list(assignment), [1] * len(stages), int(self.shards[0]))
            if ev.available and ev.throughput >= reach and ev.cost_rate < best:
                best, reached = ev.cost_rate, ev.throughput
        return best, reached

    def reachable(self, target: float) -> bool:
        """A relaxation of "some plan reaches `target`": each stage within its type's limit, the
        fewest-ms loop with the most DataWorkers any type has, each host's fewest-ms path."""
        for hosted in self._cases():
            m = self.ps_shards(hosted, target)
            if m is None:
                continue
            cap = self.cap.copy()
            cap[self.ps_type] -= m
            k = self.replicas(hosted, target)
            if hosted:
                k = np.where(k <= 1.0, k, _HUGE)
            ok = k <= cap[None, None, :]
            if not ok[0].any():
                continue
            loop = np.where(ok, self.busy[hosted] + self.waiting, np.inf)
            workers = 1.0 if (self.sync or hosted) else float(cap[np.flatnonzero(ok[0].any(axis=0))].max())
            if cheapest_path(loop)[0] > workers * self.loop_budget(target) * (1.0 + _ROW_SLACK):
                continue
            fits = True
            for (per, _, _), limit in zip(self.hosts, self.host_budgets(hosted, target), strict=True):
                if cheapest_path(np.where(ok, per[hosted], np.inf))[0] > limit * (1.0 + _ROW_SLACK):
                    fits = False
                    break
            if fits:
                return True
        return False

    # -- one level exactly (ILP) ---------------------------------------------------------------

    def solve(self, target: float, objective: bool = True) -> _Level | None:
        """The cheapest plan reaching `target` (None: none does): proven by the DP bound where a
        candidate's rate meets it, else by HiGHS over the segments the bounds cannot exclude.
        `objective` False: any plan reaching it (a feasibility check)."""
        lb, paths = self.lower_bound(target)
        if not math.isfinite(lb):
            return None
        upper, incumbent, reached = math.inf, None, 0.0
        known = [a for a, most in self.pool.items() if most >= target * (1.0 - REACH_RTOL)]
        for assignment in dict.fromkeys(paths + known):
            rate, at = self.rate_at(assignment, target)
            if rate < upper:
                upper, incumbent, reached = rate, assignment, at
        if incumbent is not None and (not objective or upper <= lb * (1.0 + 1e-12)):
            self.proof.levels_by_dp += 1
            return _Level(upper, lb if objective else upper, incumbent, reached)
        for assignment in self._heuristic(target):  # plans whose loop is priced higher: an upper bound
            rate, at = self.rate_at(assignment, target)
            if rate < upper:
                upper, incumbent, reached = rate, assignment, at
        best: _Level | None = None
        for hosted in self._cases():
            level = self._solve_case(hosted, target, objective, upper)
            if level is None:
                continue
            if best is None or level.rate < best.rate:
                best = level
            if not objective:
                break
        if incumbent is not None and (best is None or upper <= best.rate):
            # no plan below `upper` (the ILPs over every segment such a plan could use): it is optimal
            return _Level(upper, upper if best is None else min(upper, best.bound), incumbent, reached)
        if best is None:
            return None
        # the level's plan is the ILP's assignment with its counts re-provisioned: its rate and the
        # throughput it reaches at that rate belong together (the walk steps on them). Not the ILP's own
        # rate: within HiGHS' tolerances its counts may miss the level by a hair and cost less than any
        # counts that reach it, and a rate no plan pays at that throughput proves nothing about the
        # levels up to it; then the rate is above the bound and only the bound steps.
        rate, at = self.rate_at(best.assignment, target)
        return replace(best, rate=rate, throughput=at)

    def _solve_case(self, hosted: bool, target: float, objective: bool, upper: float) -> _Level | None:
        """One case's ILP over the segments through which a plan may cost less than `upper`."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        case = self._case(hosted, target)
        if case is None:
            return None
        m, cap, k, rate = case
        L, T = self.L, self.T
        loop = self.busy[hosted] + self.waiting
        budget = self.loop_budget(target)
        allowed = self.valid & np.isfinite(rate)
        if objective and math.isfinite(upper):
            fixed = m * float(self.price[self.ps_type])
            allowed &= self._through(hosted, target, rate) + fixed < upper * (1.0 - 1e-12)
        if self.sync:
            allowed &= self.K * self.busy[hosted] <= budget * (1.0 + _ROW_SLACK)
        # a first stage's DataWorkers may be raised to the limit (the loop): any count <= cap is fine
        ii, jj, tt = np.nonzero(allowed)
        if not (ii == 0).any() or not (jj == L - 1).any():
            return None
        n_seg = len(ii)
        kk = k[ii, jj, tt]
        first = ii == 0
        asynchronous = not self.sync and not hosted
        # variables: segments, then n_t (async on actor shards: DataWorkers per type), then bump y_t
        # and v (auto on actor shards: a replica beyond the minimal counts), then M (sync, K > 1)
        cols: dict[str, int] = {}
        n_var = n_seg
        if asynchronous:
            cols["n"] = n_var
            n_var += T
        bump = self.auto and not hosted
        if bump:
            cols["y"] = n_var
            n_var += T
            if asynchronous:
                cols["v"] = n_var
                n_var += 1
        if self.sync and self.K > 1:
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
            add(np.full(T, row), cols["n"] + np.arange(T), np.full(T, -budget * (1.0 + _ROW_SLACK)))
            lo.append(-np.inf)
            hi.append(0.0)
            row += 1
        else:
            # sync (or hosted: one DataWorker): the loop of one DataWorker within the budget
            add(np.full(n_seg, row), seg, loop[ii, jj, tt])
            if "M" in cols:
                add([row], [cols["M"]], [float(self.K - 1)])
            lo.append(-np.inf)
            hi.append(budget * (1.0 + _ROW_SLACK))
            row += 1
            if "M" in cols:  # M >= busy of every chosen stage
                add(row + seg, seg, self.busy[hosted][ii, jj, tt])
                add(row + seg, np.full(n_seg, cols["M"]), -np.ones(n_seg))
                lo += [-np.inf] * n_seg
                hi += [0.0] * n_seg
                row += n_seg
        for (per, _, _), limit in zip(self.hosts, self.host_budgets(hosted, target), strict=True):
            if limit < 0:
                return None
            add(np.full(n_seg, row), seg, per[hosted][ii, jj, tt])
            lo.append(-np.inf)
            hi.append(limit * (1.0 + _ROW_SLACK))
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
        price = self.price
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
        # HiGHS' presolve probing and sub-MIP heuristics cost most of the time on these programs (measured
        # 48 s -> 12 s on a 5,000-segment level); the DP gives the incumbent bound instead
        options: dict[str, Any] = {
            "mip_rel_gap": 0.0,
            "presolve": False,
            "mip_heuristic_run_rins": False,
            "mip_heuristic_run_rens": False,
            "mip_heuristic_run_root_reduced_cost": False,
        }
        left = self.deadline - time.perf_counter()
        if math.isfinite(left):
            options["time_limit"] = max(left, 0.1)
        self.proof.ilp_solves += 1
        with warnings.catch_warnings():  # scipy warns of HiGHS options it does not list, and passes them on
            warnings.simplefilter("ignore")
            result = milp(
                c=c if objective else np.zeros(n_var),
                constraints=LinearConstraint(A, np.array(lo), np.array(hi)),
                integrality=integrality,
                bounds=Bounds(var_lo, var_hi),
                options=options,
            )
        if result.status == 2:  # proven infeasible
            return None
        if result.status != 0 or result.x is None:
            self.proof.ilp_optimal = False
            self.proof.notes.append(f"ILP at {target:.6g} samples/s: {result.message}")
            if result.x is None:
                return None
        x = result.x
        chosen = np.flatnonzero(x[:n_seg] > 0.5)
        path = sorted((int(ii[s]), int(jj[s]), int(tt[s])) for s in chosen)
        if not objective:
            return _Level(math.nan, -math.inf, assignment_of(path))
        found = float(c @ np.round(x))
        fixed = m * float(price[self.ps_type])
        dual = getattr(result, "mip_dual_bound", None)
        proven = found if dual is None or not math.isfinite(dual) else min(found, float(dual))
        return _Level(found + fixed, proven + fixed, assignment_of(path))

    # -- the walk ------------------------------------------------------------------------------

    def throughput_bound(self, known: float, rtol: float = 1e-4) -> float:
        """An upper bound on every plan's throughput (no plan reaches it: `reachable` fails there),
        from a throughput `known` to be reached (> 0)."""
        lo = known
        hi = max(known, 1e-9) * 2.0
        while self.reachable(hi):
            lo, hi = hi, hi * 2.0
            if hi > 1e15:
                return math.inf
        while hi > lo * (1.0 + rtol):
            mid = math.sqrt(lo * hi) if lo > 0 else hi / 2.0
            if self.reachable(mid):
                lo = mid
            else:
                hi = mid
        return hi

    def fastest(self, known: float, bound: float) -> tuple[float, tuple[int, ...] | None]:
        """The highest throughput any plan reaches (proven to 1e-9: no plan reaches 1e-9 above it) and
        a plan reaching it; `known`: reached by some plan, `bound`: an upper bound."""
        model = self.model
        lo, best = known, None
        hi = bound
        while hi > lo * (1.0 + STEP_RTOL) and hi > 0:
            if time.perf_counter() > self.deadline:
                self.proof.stop = "time limit"
                break
            mid = math.sqrt(lo * hi) if lo > 0 else hi / 2.0
            self.proof.bisection_steps += 1
            level = self.solve(mid * (1.0 - REACH_RTOL), objective=False)
            if level is None:
                hi = mid
                continue
            reached = provision_counts(model, level.assignment).max_throughput
            if reached < mid * (1.0 - REACH_RTOL):  # within the solver's tolerance only: not reached
                hi = mid
                continue
            lo, best = max(lo, reached), level.assignment
        return lo, best

    def cheapest(
        self, floor: float, seeds: list[tuple[int, ...]]
    ) -> tuple[tuple[tuple[int, ...], Provisioned] | None, float]:
        """(the cheapest plan at or above `floor`, or None; the throughput bound used)."""
        model = self.model
        best: tuple[tuple[int, ...], Provisioned] | None = None
        known = 0.0

        def consider(assignment: tuple[int, ...] | None) -> None:
            nonlocal best, known
            if assignment is None:
                return
            counts = provision_counts(model, assignment)
            known = max(known, counts.max_throughput)
            self.remember(assignment, counts.max_throughput)
            if counts.feasible and (best is None or counts.cost < best[1].cost):
                best = (assignment, counts)

        for assignment in seeds:
            consider(assignment)
        target = max(floor * (1.0 - FLOOR_RTOL), 0.0)
        lb, paths = self.lower_bound(max(target, 1e-300))
        for assignment in paths:
            consider(assignment)
        if not math.isfinite(lb):
            self.proof.stop = "no plan reaches the floor (DP bound)"
            return best, known
        # theta_max: no plan reaches it. `reachable` relaxes every constraint of a level (each stage
        # within its own type's limit, the loop with the most DataWorkers any type has, each host's
        # least-work path) and each of them only tightens as the level rises, so it is monotone and
        # its bisection's upper end bounds every plan's throughput.
        theta_max = self.throughput_bound(max(known, target, 1e-9))
        to_cost = model.samples / S_PER_HOUR
        while target <= theta_max * (1.0 + STEP_RTOL):
            if time.perf_counter() > self.deadline:
                self.proof.stop = "time limit"
                return best, theta_max
            # lb <= R*(target) (lower_bound: every path weight it minimises is at most the plan's rate),
            # and R*(X) <= R*(X') for X <= X' (a plan reaching X' reaches X): lb bounds every plan here
            # and above
            lb, paths = self.lower_bound(max(target, 1e-300))
            if not math.isfinite(lb):
                self.proof.stop = "no plan reaches the level (DP bound)"
                break
            for assignment in paths:
                consider(assignment)
            if best is not None:
                # stop: every remaining plan costs R · N / 3600 / Θ >= lb · N / 3600 / theta_max
                if monetary_cost(lb, model.samples, theta_max) >= best[1].cost:
                    self.proof.stop = "DP bound at the level / max throughput >= cost"
                    self.proof.bound = monetary_cost(lb, model.samples, theta_max)
                    break
                # skip: a plan with target <= Θ < skip_to costs >= lb · N / 3600 / Θ > the best cost
                skip_to = lb * to_cost / best[1].cost
                if skip_to > target * (1.0 + STEP_RTOL):
                    self.proof.levels_bounded += 1
                    target = skip_to
                    continue
            level = self.solve(max(target, 1e-300))
            if level is None:
                self.proof.stop = "no plan reaches the level (ILP infeasible)"
                break
            consider(level.assignment)
            # level.bound <= R*(target): HiGHS' dual bound (or the DP bound the plan meets)
            if best is not None and monetary_cost(level.bound, model.samples, theta_max) >= best[1].cost:
                self.proof.stop = "ILP bound at the level / max throughput >= cost"
                self.proof.bound = monetary_cost(level.bound, model.samples, theta_max)
                break
            if math.isinf(level.throughput):
                self.proof.stop = "unbounded throughput"
                break
            # step to what the plan found reaches *at its rate*: when that rate is R*(target), a plan
            # with target <= Θ <= level.throughput has R >= R*(target) and Θ no higher, so it is no
            # cheaper. Not to the most its assignment reaches with more replicas (issue 26): those
            # replicas cost more than R*(target), which proves nothing about the plans in between.
            optimal = level.rate <= level.bound * (1.0 + _SOLVER_RTOL)  # else only the bound steps
            nxt = level.throughput if optimal else 0.0
            if best is not None:  # the skip above, with the ILP's bound
                nxt = max(nxt, level.bound * to_cost / best[1].cost)
            if nxt < target or (not optimal and nxt <= target):
                # the ILP's plan misses the level, or its rate is not proven, within the solver's
                # tolerances: plans with Θ in [target, target (1 + 1e-7)) are passed over (counted)
                self.proof.tolerance_steps += 1
                nxt = target * (1.0 + _SOLVER_RTOL)
            target = nxt * (1.0 + STEP_RTOL)  # plans in (nxt, nxt (1 + 1e-9)): within 1e-9 of it
        else:
            self.proof.stop = "level above the max throughput bound"
        return best, theta_max


# ---------------------------------------------------------------------------------------------
# small helpers


def runtime_level_search(
    problem: Problem, model: CostModel | None = None, time_limit_s: float | None = None
) -> tuple[tuple[int, ...], Provisioned, float | None, dict[str, Any]]:
    """The exact optimum of a problem with runtime terms: (assignment, its counts, the highest
    throughput any plan reaches when no plan meets the floor (else None), plan.extra's notes)."""
    model = model or CostModel(problem)
    search = RuntimeLevels(model, time_limit_s)
    seeds = [(t,) * model.num_layers for t in range(model.num_types) if model.runnable[:, t].all()]
    found, theta_bound = search.cheapest(model.floor, seeds)
    best_throughput = None
    if found is None:
        known, fastest = 0.0, None
        for assignment in seeds:
            most = provision_counts(model, assignment).max_throughput
            if most > known:
                known, fastest = most, assignment
        bound = search.throughput_bound(max(known, 1e-9))
        best_throughput, reaching = search.fastest(known, bound)
        chosen = reaching or fastest or tuple(int(np.argmax(r)) for r in model.runnable)
        found = (chosen, provision_counts(model, chosen))
        search.proof.stop = search.proof.stop or "no plan meets the floor; fastest plan bisected"
    extra = {
        "method": "levels+ilp",
        "levels_solved": search.proof.ilp_solves,
        "proof": search.proof.to_extra(found[1].cost if found[1].feasible else None),
    }
    return found[0], found[1], best_throughput, extra
