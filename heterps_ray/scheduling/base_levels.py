"""The base model's levels (DESIGN.md §3): each level of the walk (levels.py) solved by a DP.

For a target X a stage (segment i..j on type t) needs k(i,j,t,X) replicas (formulas.fewest_replicas,
the one replica rule) and costs k · price_t an hour; the shards need their fewest count m(X) reaching X.
R*(X) is then a shortest path over stage boundaries (segment_paths.cheapest_path) with the per-type
max_instances as side constraints. When the free path breaks them, a Lagrangian relaxation of the
limits often finds a path within them that meets its bound (then optimal); else its bound drops the
segments no cheaper path can use, and a DP that also counts the instances of the offending types
solves the rest exactly (types are added until the path keeps every limit: the untracked limits only
relax it), or, when that state space is too large, an ILP over the same segments
(scipy.optimize.milp / HiGHS, no MIP gap). Every level is solved exactly, so a level's bound is its
rate.

The bounds the walk uses, each a lower bound for the reason given:

* `lower_bound(X)`: the relaxed DP's rate, each stage within its own type's limit, not their sum: every
  plan reaching X is a path of that DP at its own rate (its counts are at least the fewest, each within
  its type's limit), so the relaxed optimum is at most R*(X);
* `throughput_bound`: the relaxed max_throughput, >= every plan's throughput: a plan's throughput is
  one of the candidates {theta_s(k)} U {theta_ps(m)}, and the first candidate the relaxation rejects no
  plan reaches (a plan reaching it would be a path of the relaxed DP there).
"""

from __future__ import annotations

import math

import numpy as np

from heterps_ray.costmodel import CostModel
from heterps_ray.costmodel.formulas import fewest_replicas, stage_throughput
from heterps_ray.scheduling.highs import solve_milp
from heterps_ray.scheduling.levels import Level, LevelPricing
from heterps_ray.scheduling.provisioning import REACH_RTOL, STEP_RTOL, provision_counts
from heterps_ray.scheduling.segment_paths import (
    TOO_MANY_STATES,
    chain_rows,
    cheapest_path,
    counted_cheapest_path,
    through,
)

# one level's PS shards, replicas k[i, j, t], per-type limits left beside the shards, segment rates
# and the relaxed DP's path (segments (first layer, last layer, type))
_Tables = tuple[int, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int, int]]]

DP_STATE_LIMIT = 20_000  # instance-count states of the counting DP; above it: Lagrangian + ILP


class BaseLevels(LevelPricing):
    """The base model's pricing of a level: DP, counting DP, or Lagrangian + ILP (module docstring)."""

    method = "levels"
    kind = "level walk, levels solved by DP"

    def __init__(
        self, model: CostModel, state_limit: int = DP_STATE_LIMIT, time_limit_s: float | None = None
    ):
        super().__init__(model, time_limit_s)
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
        self._bound: float | None = None
        self._last: tuple[float, _Tables | None] | None = None  # the last target's tables

    def counters(self) -> dict[str, int]:
        return {
            "levels_solved": self.solves,
            "counting_dp_solves": self.counting_solves,
            "ilp_solves": self.ilp_solves,
        }

    # -- the walk's interface ------------------------------------------------------------------

    def lower_bound(self, target: float) -> tuple[float, list[tuple[int, ...]]]:
        """The relaxed DP's rate (module docstring: why it is <= R*(target)) and its assignment."""
        level = self.solve_level(target, relaxed=True)
        return (math.inf, []) if level is None else (level.rate, [level.assignment])

    def solve(self, target: float, objective: bool = True, cutoff: float = math.inf) -> Level | None:
        """The level solved exactly (`objective` False: any plan within the limits; the DP needs no
        cutoff)."""
        self.proof.solves += 1
        return self.solve_level(target, objective=objective)

    def throughput_bound(self, known: float) -> float:
        if self._bound is None:
            self._bound = self.max_throughput(relaxed=True)
        return self._bound

    def fastest(self, known: float) -> tuple[float, tuple[int, ...] | None]:
        bound = self.max_throughput(relaxed=True, known=known)
        theta_max = self.max_throughput(known=known, bound=bound) if bound > 0.0 else 0.0
        level = self.solve_level(theta_max) if theta_max > 0.0 and not self.out_of_time() else None
        return theta_max, None if level is None else tuple(int(t) for t in level.assignment)

    # -- one level -----------------------------------------------------------------------------

    def replicas_needed(self, target: float) -> np.ndarray:
        """k(i,j,t): fewest replicas of segment (i,j,t) reaching `target` samples/s (huge if none)."""
        k = fewest_replicas(self.model.batch_size, self.tau, self.alpha, target)
        return np.minimum(np.where(self.valid, k, np.inf), 1e12)

    def solve_level(
        self, target: float, relaxed: bool = False, quick: bool = False, objective: bool = True
    ) -> Level | None:
        """Cheapest cost rate over plans reaching `target` within max_instances; None if none does.

        relaxed: each stage within its type's limit, but not their sum (a bound, no ILP).
        objective False: any plan within the limits, not the cheapest (a feasibility check: where the
        ILP decides, one without an objective, which HiGHS answers far sooner at size).
        quick: a plan within the limits, cheaply and without proof (`_quick_path`); for heuristics
        that try many levels (rl/level_plans.py), never for the walk. The level's tables are kept,
        so the same target solved relaxed and then quick builds them once."""
        self.solves += 1
        tables = self._tables(target)
        if tables is None:
            return None
        m, k, cap, seg_rate, path = tables
        if relaxed or (self._usage(path, k) <= cap).all():
            return self._level(path, k, m)
        if quick:
            within = self._quick_path(seg_rate, k, cap, path)
        elif objective:
            within = self._constrained_path(seg_rate, k, cap, path)
        else:
            within = self._any_path(seg_rate, k, cap, path)
        return None if within is None else self._level(within, k, m)

    def _tables(self, target: float) -> _Tables | None:
        """(shards, k, per-type limits left beside the shards, segment rates, the relaxed DP's path)
        at `target`, or None when no plan reaches it; the last target's are kept."""
        if self._last is not None and self._last[0] == target:
            return self._last[1]
        model = self.model
        reach = target * (1.0 - REACH_RTOL)
        tables = None
        if model.rows_per_sample > 0.0:
            idx = int(np.searchsorted(self.ps_table, reach, side="left"))
        else:
            idx = 0
        if idx < len(self.shards):
            m = int(self.shards[idx])
            cap = self.cap.copy()
            cap[model.ps_type] -= m
            k = self.replicas_needed(reach)
            seg_ok = k <= cap[None, None, :]
            seg_rate = np.where(seg_ok, k * model.price[None, None, :], np.inf)
            path = cheapest_path(seg_rate)[1]
            if path is not None:
                tables = (m, k, cap, seg_rate, path)
        self._last = (target, tables)
        return tables

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

        First a Lagrangian relaxation of the limits (`_lagrangian`): often a path within them that
        meets its lower bound, which is then optimal. Else the segments its bound excludes are dropped
        and the counting DP (`_counted_path`) solves the rest. When that state space is too large: the
        ILP over the same segments."""
        incumbent, kept = self._lagrangian(seg_rate, k, cap, path)
        if incumbent is not None and kept is None:
            return incumbent  # proven optimal by the Lagrangian bound
        rates = seg_rate if kept is None else np.where(kept, seg_rate, np.inf)
        counted = self._counted_path(rates, k, cap, path)
        if counted is TOO_MANY_STATES:
            return self._ilp(rates, k, cap)
        if counted is None:
            return incumbent  # no path among the kept segments beats it (None: no path at all)
        assert isinstance(counted, list)
        return counted

    def _any_path(
        self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, path: list[tuple[int, int, int]]
    ) -> list[tuple[int, int, int]] | None:
        """A path within max_instances, None only when none exists: the counting DP's (exact), else the
        ILP's with no objective."""
        counted = self._counted_path(seg_rate, k, cap, path)
        if counted is TOO_MANY_STATES:
            return self._ilp(seg_rate, k, cap, objective=False)
        assert counted is None or isinstance(counted, list)
        return counted

    def _quick_path(
        self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, path: list[tuple[int, int, int]]
    ) -> list[tuple[int, int, int]] | None:
        """A path within max_instances without the Lagrangian or the ILP: the counting DP's
        (`_counted_path`: the cheapest, when its states stay within state_limit), else the
        Lagrangian's best path met (or None). No proof either way."""
        counted = self._counted_path(seg_rate, k, cap, path)
        if counted is TOO_MANY_STATES:
            return self._lagrangian(seg_rate, k, cap, path)[0]
        assert counted is None or isinstance(counted, list)
        return counted

    def _counted_path(
        self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, path: list[tuple[int, int, int]]
    ) -> list[tuple[int, int, int]] | None | object:
        """The cheapest path of `seg_rate` within max_instances by the DP that also counts the
        instances of the types whose limits the free `path` breaks, adding types until its path keeps
        every limit (exact: the untracked limits only relax it). None: no path keeps them;
        TOO_MANY_STATES: more than state_limit count states."""
        tracked = sorted(int(t) for t in np.flatnonzero(self._usage(path, k) > cap))
        while True:
            counted = counted_cheapest_path(seg_rate, k, cap, tracked, self.state_limit)
            if counted is TOO_MANY_STATES:
                return counted
            self.counting_solves += 1
            if counted is None:
                return None
            assert isinstance(counted, list)
            over = np.flatnonzero(self._usage(counted, k) > cap)
            if len(over) == 0:
                return counted
            tracked = sorted(set(tracked) | {int(t) for t in over})

    def _lagrangian(
        self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, path: list[tuple[int, int, int]]
    ) -> tuple[list[tuple[int, int, int]] | None, np.ndarray | None]:
        """Lagrangian relaxation of the limits (subgradient on lambda >= 0): (the cheapest path within
        the limits it met, or None; the segments a path cheaper than that one can use, or None when
        that path is proven optimal or none was met).

        Why a lower bound: for lambda >= 0 and a path P within the limits, rate(P) >= rate(P) +
        lambda · (usage(P) - cap) = (rate + lambda k)(P) - lambda · cap, and the cheapest path of the
        weights rate + lambda k is at most the first term. The same weights' cheapest path *through*
        a segment, less lambda · cap, bounds every path within the limits using it: above the
        incumbent's rate, no optimal path uses it."""
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
                return incumbent, None
            violation = (usage - cap).astype(np.float64)
            lam = np.maximum(0.0, lam + step * violation / max(float(np.abs(violation).sum()), 1.0))
            step *= 0.8
        if incumbent is None:
            return None, None
        priced = seg_rate + k * lam[None, None, :]
        bound = through(priced) - float(lam @ cap)
        return incumbent, np.isfinite(seg_rate) & (bound <= upper * (1.0 + 1e-9))

    def _ilp(
        self, seg_rate: np.ndarray, k: np.ndarray, cap: np.ndarray, objective: bool = True
    ) -> list[tuple[int, int, int]] | None:
        """The same shortest path with the per-type instance limits, as a 0/1 program (`objective`
        False: any path within them)."""
        from scipy.optimize import Bounds, LinearConstraint
        from scipy.sparse import coo_matrix

        self.ilp_solves += 1
        L, T = self.L, self.T
        ii, jj, tt = np.nonzero(np.isfinite(seg_rate))
        n = len(ii)
        if n == 0:
            return None
        rows, cols, vals, lo, hi = chain_rows(ii, jj, tt, L, T)
        n_rows = len(lo)  # then max_instances per type
        A = coo_matrix(
            (
                np.concatenate([vals, k[ii, jj, tt]]),
                (np.concatenate([rows, n_rows + tt]), np.concatenate([cols, np.arange(n)])),
            ),
            shape=(n_rows + T, n),
        ).tocsr()
        result = solve_milp(
            c=seg_rate[ii, jj, tt] if objective else np.zeros(n),
            constraints=LinearConstraint(
                A, np.concatenate([lo, np.full(T, -np.inf)]), np.concatenate([hi, cap.astype(np.float64)])
            ),
            integrality=np.ones(n),
            bounds=Bounds(0, 1),
            # the walk steps past every level up to this plan's throughput on the claim that its rate
            # is R*(X): HiGHS' default gap (1e-4) would let a plan 0.01% dearer stand for R*(X)
            # presolve: most of an infeasible level's time at size, for no gain (120 x 8: 1 s -> 0.35 s)
            options={"mip_rel_gap": 0.0, "presolve": False},
        )
        if result.x is None:
            return None
        return sorted((int(ii[v]), int(jj[v]), int(tt[v])) for v in np.flatnonzero(result.x > 0.5))

    def _level(self, path: list[tuple[int, int, int]], k: np.ndarray, m: int) -> Level:
        model = self.model
        assignment: list[int] = []
        throughput = model.ps_throughput(m)
        rate = m * float(model.price[model.ps_type])
        for i, j, t in path:
            assignment += [t] * (j - i + 1)
            kk = int(k[i, j, t])
            rate += kk * float(model.price[t])
            tau, alpha = float(self.tau[i, j, t]), float(self.alpha[i, j, t])
            throughput = min(throughput, stage_throughput(model.batch_size, tau, alpha, kk))
        return Level(rate, rate, tuple(assignment), throughput)

    # -- the fastest plan ----------------------------------------------------------------------

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
            if self.solve_level(float(candidates[0]), relaxed) is None:
                return 0.0
            lo = 0
        while lo < hi:
            if not relaxed and self.out_of_time():
                break  # candidates[lo] is reached; no faster plan was proven not to exist
            mid = (lo + hi + 1) // 2
            target = float(candidates[mid])
            level = self.solve_level(target, relaxed=True)
            reached = 0.0
            if level is not None and not relaxed:
                # cheap first: the relaxed plan's assignment, provisioned exactly, often reaches the
                # level; only when it does not is the level solved exactly (reaching it is all the
                # search needs). The plan found reaches what its assignment provisioned reaches, often
                # beyond the level: the search jumps there
                reached = provision_counts(self.model, level.assignment).max_throughput
                if reached < target * (1.0 - REACH_RTOL):
                    level = self.solve_level(target, objective=False)
                    reached = (
                        0.0
                        if level is None
                        else provision_counts(self.model, level.assignment).max_throughput
                    )
            if level is None:
                hi = mid - 1
            else:
                lo = max(
                    mid, int(np.searchsorted(candidates, reached * (1.0 + REACH_RTOL), side="right")) - 1
                )
        return float(candidates[lo])
