"""The levels of a problem with runtime terms (DESIGN.md §3b): each level of the walk (levels.py)
solved as a 0/1 program over stages (scipy.optimize.milp, HiGHS; runtime_ilp.py).

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
differently, and without shard actors: no PS instance to pay or to fit in max_instances): a level is the cheaper of the hosted program (every count 1) and the program on
actor shards with at least one count of 2 (a replica added where the minimal counts are all 1).

The walk over the levels is levels.py's, the same as the base model's; this module prices a level
on the per-segment tables of runtime_segments.py.
The bounds it gives the walk, each a lower bound for the reason given:

* the DP bound ``lb(X) <= R*(X)`` (`lower_bound`): every segment weight is at most what a plan using
  the segment pays (its fewest counts at X, within its own type's limit, at their prices; async:
  the loop needs ``k_0 >= loop / c`` DataWorkers, so pricing the loop at ``p_t0 / c`` a ms gives a
  second weight no plan with its first stage on t0 pays less than; such a plan pays at least each
  of the two, so at least any mix ``(1 - λ) · first + λ · second``, and the bound is the best mix
  `path_bounds.best_mixes` finds), and the shards' fewest count; then the per-type limits, which
  the DP keeps only stage by stage, by a Lagrangian relaxation of their sum
  (`path_bounds.relax_limits`: a plan within them pays at least its weight plus ``Σ_t μ_t (use_t - cap_t)`` for any μ >= 0), which closes most of
  the gap to R*(X) at size (120 layers x 8 types: from 2-3% to under 1%);
* the level bound: HiGHS' dual bound over the segments a plan cheaper than the incumbent can use
  (`_through`, the same weights through each segment, excludes the others); plans using the others
  cost at least the incumbent, so min(incumbent, dual bound) <= R*(X). HiGHS gets the incumbent as
  its objective bound (it prunes what cannot beat it): "infeasible" then proves the incumbent R*(X);
  with the walk's cutoff below the incumbent (`solve`), "infeasible" proves R*(X) >= the cutoff;
* the ratio bound (`ratio_bound`): per segment its fewest counts at X priced per unit of the most
  throughput they reach, a lower bound on R / Θ of every plan at or above X (a count is never used
  better than fully), which the walk stops on;
* ``Θ_max`` (`throughput_bound`): a level `reachable` rejects no plan reaches (it checks each stage
  within its own type's limit, the cheapest loop with the most DataWorkers any type has, each host's
  cheapest CPU), and no plan reaching more reaches less, so every plan's Θ is below it.

A level's rate and throughput are one plan's (its assignment re-provisioned, `rate_at`), so the walk's
step from X_n to Θ_n is sound when the rate is proven R*(X_n) (to the solver's 1e-7). The ILP itself:
runtime_ilp.py. scheduling/milp.py checks the optimum by a second formulation (tests/test_milp.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from heterps_ray.costmodel import CostModel
from heterps_ray.costmodel.formulas import S_PER_HOUR, stage_throughput
from heterps_ray.scheduling.levels import Level
from heterps_ray.scheduling.path_bounds import best_mixes, mixed_weights, relax_limits, with_limits
from heterps_ray.scheduling.provisioning import REACH_RTOL, STEP_RTOL, provision_counts
from heterps_ray.scheduling.runtime_ilp import ROW_SLACK, solve_case
from heterps_ray.scheduling.runtime_segments import UNREACHABLE, RuntimeSegments
from heterps_ray.scheduling.segment_paths import assignment_of, cheapest_path, through

SCOUT_POINTS = 20  # levels `scout` prices between the floor and the throughput bound
SCOUT_REFINE = 8  # more levels between the neighbours of the most promising of them
SCOUT_STOP = 1.25  # `scout` stops rising where the level's bound per sample/s is this far above a plan met


class RuntimeLevels(RuntimeSegments):
    """The pricing of a level of one problem (module docstring), on its per-segment runtime tables
    (RuntimeSegments, runtime_segments.py)."""

    method = "levels+ilp"
    kind = "level walk, levels solved by ILP (HiGHS)"

    def __init__(self, model: CostModel, time_limit_s: float | None = None):
        super().__init__(model, time_limit_s)
        self.ilp_solves = 0  # counted by runtime_ilp.solve_case
        self._memo: tuple[float, tuple[float, list[tuple[int, ...]]]] | None = None
        self._mix: dict[tuple[bool, float, int], float] = {}  # (case, level, weights) -> the best lam
        # the limits' multipliers: per (case, weights) the last found (a warm start for the next
        # level), per (case, level, weights) the weight, multipliers and limits of `_through`
        self._mu: dict[tuple[bool, bool, int], np.ndarray] = {}
        self._limits: dict[tuple[bool, float, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._hosted_fits: dict[float, bool] = {}  # the last level's `_hosted_loop_fits`

    def counters(self) -> dict[str, int]:
        return {"levels_solved": self.ilp_solves, "ilp_solves": self.ilp_solves}

    # -- lower bounds (DP) ---------------------------------------------------------------------

    def _case(self, hosted: bool, target: float) -> tuple[int, np.ndarray, np.ndarray, np.ndarray] | None:
        """(shards, limits left per type, k per segment, $/hour per segment) of one case at a level."""
        m = self.ps_shards(hosted, target)
        if m is None:
            return None
        cap = self.cap.copy()
        cap[self.ps_type] -= self.shard_actors(hosted, m)
        k = self.replicas(hosted, target)
        if hosted:
            k = np.where(k <= 1.0, k, UNREACHABLE)
        rate = np.where(k <= cap[None, None, :], k * self.price, np.inf)
        if hosted and not self._hosted_loop_fits(target, rate):
            return None
        return m, cap, k, rate

    def _hosted_loop_fits(self, target: float, rate: np.ndarray) -> bool:
        """Whether one DataWorker's loop, at its fewest ms through the segments `rate` allows, fits the
        level: a hosted plan has one DataWorker, so no hosted plan reaches a level this fails (the same
        relaxation as `reachable`). Without it the hosted case, which pays no shard actors, bounds every
        level below the actor-shard plans and takes an ILP of its own at each (issue 50: a 87 x 7 GPU-cloud
        problem, 29 ILPs -> 72)."""
        if target not in self._hosted_fits:
            loop = np.where(np.isfinite(rate), self.busy[True] + self.waiting, np.inf)
            fits = cheapest_path(loop)[0] <= self.loop_budget(target) * (1.0 + ROW_SLACK)
            self._hosted_fits = {target: fits}  # levels move on: the last one's answer alone is kept
        return self._hosted_fits[target]

    def _weights(
        self, hosted: bool, target: float, rate: np.ndarray, per_throughput: bool = False
    ) -> list[np.ndarray]:
        """Segment weights whose cheapest path through a segment bounds R from below: the counts
        alone, and (async on actor shards) per stage-0 type t0 the loop priced at p_t0 per DataWorker
        (R >= Σ_later k p + p_t0 · max(k_0, loop / c), c the loop one DataWorker may take).
        per_throughput: `rate` bounds R / Θ (`ratio_bound`), and the loop is priced per unit of Θ:
        n / Θ >= loop / c1, c1 = c · target the loop budget at 1 sample/s."""
        if self.sync or hosted:
            return [rate]
        c = self.loop_budget(target) * (target if per_throughput else 1.0)
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
        self._limits = {}
        result = self._lower_bound(target)
        self._memo = (target, result)
        return result

    def ratio_bound(self, low: float, high: float) -> float:
        """A lower bound on R(P) / Θ(P) ($/hour per sample/s) over every plan P with low <= Θ(P) <= high
        (high may be inf); inf: no plan in that range. Why: a plan reaching Θ has on each stage at
        least k(Θ) replicas (`replicas`), and k(X) / X >= k(low) / min(high, X_k(low)) for every X in
        [low, high], X_k the most a count k reaches (θ(k) / (1 - REACH_RTOL), θ Amdahl's): X <= high,
        k(X) >= k(low), and where X > X_k(low) the count is k' > k(low) with X <= X_k', and k / θ(k)
        never falls as k rises (θ(k) / k = c / (k (1 - α) + α)). So p k_s / Θ >= p · that per stage; the
        shards alike (θ_ps linear in m); the DataWorkers n >= loop Θ / c1 (`_weights`); the limits
        relaxed as in `lower_bound` (use_t >= Σ k(low) for a plan at or above low). The minimum over
        the cases of the cheapest path of these weights is then below every such plan's R / Θ."""
        return self._lower_bound(low, high)[0]

    def _ratio_weights(
        self, hosted: bool, target: float, high: float, m: int, k: np.ndarray, rate: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """`ratio_bound`'s weights over [target, high]: (the shards' m p / min(high, X_m), per segment
        `rate` (k(target) p) divided by min(high, X_k)). Hosted shards neither limit Θ nor cost: 0."""
        tau = self.K * self.busy[hosted]
        most = stage_throughput(self.B, tau, self.alpha, np.where(k < UNREACHABLE, k, 1.0))
        reach = np.minimum(high, most / (1.0 - REACH_RTOL) * (1.0 + 1e-12))
        most_ps = math.inf if hosted else self.model.ps_throughput(m) / (1.0 - REACH_RTOL) * (1.0 + 1e-12)
        fixed = self.shards_rate(hosted, m) / max(min(high, most_ps), target)
        return fixed, np.where(np.isfinite(rate), rate / np.maximum(reach, target), np.inf)

    def _lower_bound(self, target: float, high: float | None = None) -> tuple[float, list[tuple[int, ...]]]:
        """lower_bound's work; with `high`, ratio_bound's (per unit of throughput, over target..high)."""
        best, paths = math.inf, []
        ratio = high is not None
        if not ratio:
            self._mix = {}
        found: list[tuple[float, float, bool, int, np.ndarray, np.ndarray, np.ndarray]] = []
        for hosted in self._cases():
            case = self._case(hosted, target)
            if case is None:
                continue
            m, cap, k, rate = case
            fixed = self.shards_rate(hosted, m)
            if ratio:
                assert high is not None
                fixed, rate = self._ratio_weights(hosted, target, high, m, k, rate)
            weights = self._weights(hosted, target, rate, ratio)
            if self.sync or hosted:
                value, path = cheapest_path(rate)
                if path is not None:
                    paths.append(assignment_of(path))
                found.append((value + fixed, fixed, hosted, 0, rate, k, cap))
                continue
            mixes = best_mixes(weights)  # type: ignore[arg-type]
            for n, ((plain, priced), (value, lam, met)) in enumerate(zip(weights, mixes, strict=True)):  # type: ignore[misc]
                if not ratio:
                    self._mix[(hosted, target, n)] = lam
                paths += [assignment_of(p) for p in met]
                mixed = mixed_weights(plain, priced, lam) if 0.0 < lam < 1.0 else (plain if lam == 0.0 else priced)
                found.append((value + fixed, fixed, hosted, n, mixed, k, cap))
        # the limits: raise the weights' bounds from the lowest up while one is below the others (the
        # bound is their minimum, so a weight above it needs no work)
        found.sort(key=lambda f: f[0])
        unit = float(self.price.max()) / (target if ratio else 1.0)
        for value, fixed, hosted, n, weight, k, cap in found:
            if value >= best:
                break
            raised, mu, met = relax_limits(weight, k, cap, unit, self._mu.get((ratio, hosted, n)))
            self._mu[(ratio, hosted, n)] = mu
            if not ratio:
                self._limits[(hosted, target, n)] = (weight, mu, cap)
            paths += [assignment_of(p) for p in met]
            best = min(best, max(value, raised + fixed))
        return best, list(dict.fromkeys(paths))

    def _through(self, hosted: bool, target: float, rate: np.ndarray) -> np.ndarray:
        """Per segment, a lower bound on the $/hour (shards excluded) of any plan using it: the
        cheapest path through it of each weight `lower_bound` minimises (each at most the rate of any
        plan using the segment), the largest of them; with the limits' multipliers where
        `lower_bound` found them (`relax_limits`: through the weight plus mu k, less mu cap)."""
        weights = self._weights(hosted, target, rate)
        self.lower_bound(target)  # the mixes' lambdas and the limits' multipliers at this level
        if self.sync or hosted:
            return self._limited(through(rate), hosted, target, 0)
        out = np.full(rate.shape, np.inf)
        for n, (plain, priced) in enumerate(weights):  # type: ignore[misc]
            bound = np.maximum(through(plain), through(priced))
            lam = self._mix.get((hosted, target, n), 0.0)
            if 0.0 < lam < 1.0:
                bound = np.maximum(bound, through(mixed_weights(plain, priced, lam)))
            out = np.minimum(out, self._limited(bound, hosted, target, n))
        return out

    def _limited(self, bound: np.ndarray, hosted: bool, target: float, n: int) -> np.ndarray:
        """`bound`, raised by the limits' relaxation of weight n where `lower_bound` made one."""
        limits = self._limits.get((hosted, target, n))
        if limits is None:
            return bound
        weight, mu, cap = limits
        if not mu.any():
            return bound
        k = self._case(hosted, target)[2]  # type: ignore[index]
        return np.maximum(bound, through(with_limits(weight, k, mu)) - float(mu @ cap))

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

    def scout(self, low: float, high: float) -> list[tuple[int, ...]]:
        """Incumbents for the walk (no proof rests on them): the relaxations' optima and `_heuristic`'s
        plans at SCOUT_POINTS levels spread geometrically over [low, high], then SCOUT_REFINE more
        between the neighbours of the level whose plans were cheapest. At size the cheapest plan can
        sit far above the floor (120 layers x 8 types: at 4-5x it), where the walk arrives late; a
        cost near the optimum from the start lengthens every skip (issue 26: 120x8 seed 1 went from
        unproven at 60 s to proven). About 0.15 s a level at 120 x 8. The limits' warm starts are put
        back as they were: the walk's bounds do not depend on the scouting."""
        if not (math.isfinite(high) and high > low > 0.0):
            return []
        saved = {key: mu.copy() for key, mu in self._mu.items()}
        found: list[tuple[int, ...]] = []
        seen: list[tuple[float, float, float]] = []  # (level, its bound per sample/s, its cheapest plan)

        def visit(target: float) -> bool:
            if self.out_of_time():
                return False
            lb, paths = self.lower_bound(target)
            if not math.isfinite(lb):  # no plan reaches it, nor any level above it
                return False
            plans = list(dict.fromkeys(paths + self._heuristic(target)))
            found.extend(plans)
            priced = (provision_counts(self.model, a) for a in plans)
            seen.append((target, lb / target, min((p.cost for p in priced if p.feasible), default=math.inf)))
            return True

        to_cost = self.model.samples / S_PER_HOUR
        for target in np.geomspace(low, high, SCOUT_POINTS):
            if not visit(float(target)):
                break
            rising = len(seen) > 1 and seen[-1][1] > seen[-2][1]
            if rising and seen[-1][1] * to_cost >= SCOUT_STOP * min(c for _, _, c in seen):
                # the bound per sample/s rises and is dearer than plans already met: not worth going
                # higher. Where it still falls (a floor far below the optimum: issue 40, seed 16, the
                # optimum at 10x the floor), the levels above are where the cheap plans are.
                break
        # refine around the level with the lowest bound per sample/s (where cheap plans can be) and
        # around the one whose plans were cheapest
        levels = [x for x, _, _ in seen]
        bound_at = min(range(len(seen)), key=lambda i: seen[i][1], default=None)
        cheapest_at = min(range(len(seen)), key=lambda i: seen[i][2], default=None)
        for i in sorted({i for i in (bound_at, cheapest_at) if i is not None}):
            near = np.geomspace(levels[max(i - 1, 0)], levels[min(i + 1, len(levels) - 1)], SCOUT_REFINE + 2)
            for target in near[1:-1]:
                if not visit(float(target)):
                    break
        self._mu, self._memo = saved, None
        return list(dict.fromkeys(found))

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
            ev = model.evaluate(list(assignment), [1] * len(stages), int(model.ps_min_shards))
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
            cap[self.ps_type] -= self.shard_actors(hosted, m)
            k = self.replicas(hosted, target)
            if hosted:
                k = np.where(k <= 1.0, k, UNREACHABLE)
            ok = k <= cap[None, None, :]
            if not ok[0].any():
                continue
            loop = np.where(ok, self.busy[hosted] + self.waiting, np.inf)
            workers = 1.0 if (self.sync or hosted) else float(cap[np.flatnonzero(ok[0].any(axis=0))].max())
            if cheapest_path(loop)[0] > workers * self.loop_budget(target) * (1.0 + ROW_SLACK):
                continue
            fits = True
            for (per, _, _), limit in zip(self.hosts, self.host_budgets(hosted, target), strict=True):
                if cheapest_path(np.where(ok, per[hosted], np.inf))[0] > limit * (1.0 + ROW_SLACK):
                    fits = False
                    break
            if fits:
                return True
        return False

    # -- one level exactly (ILP) ---------------------------------------------------------------

    def solve(self, target: float, objective: bool = True, cutoff: float = math.inf) -> Level | None:
        """The cheapest plan reaching `target` (None: none does): proven by the DP bound where a
        candidate's rate meets it, else by HiGHS over the segments the bounds cannot exclude.
        `objective` False: any plan reaching it (a feasibility check). With an incumbent (a plan reaching
        `target` at rate `upper`) HiGHS looks only below min(upper, cutoff): "infeasible" then proves
        R*(target) >= that limit (plans through the segments `_through` excludes cost at least it, the
        rest are the ILP's), the level answers with the incumbent and that bound; with none, HiGHS looks
        below the cutoff alone, and finding nothing there answers with no plan and the bound."""
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
            return Level(upper, lb if objective else upper, incumbent, reached)
        for assignment in self._heuristic(target):  # plans whose loop is priced higher: an upper bound
            rate, at = self.rate_at(assignment, target)
            if rate < upper:
                upper, incumbent, reached = rate, assignment, at
        # with no plan known at the level the cutoff still bounds the ILP: at the top of a problem whose
        # cheapest plan is its fastest, no known plan reaches the levels, and their ILPs over every
        # segment (12,000 at 110 x 8) took 1-3 s each where R*(target) was above the cutoff anyway
        limit = min(upper, cutoff)
        best: Level | None = None
        for hosted in self._cases():
            level = solve_case(self, hosted, target, objective, limit)
            if level is None:
                continue
            if best is None or level.rate < best.rate:
                best = level
            if not objective:
                break
        if incumbent is not None and (best is None or upper <= best.rate):
            # no plan below `limit` (the ILPs over every segment such a plan could use): the incumbent is
            # optimal where limit is upper, else R*(target) >= limit, the bound
            return Level(upper, limit if best is None else min(limit, best.bound), incumbent, reached)
        if best is None:
            # no plan below the cutoff (if finite): R*(target) >= cutoff, a bound without a plan
            return Level(math.inf, cutoff, ()) if objective and math.isfinite(cutoff) else None
        # the level's plan is the ILP's assignment with its counts re-provisioned: its rate and the
        # throughput it reaches at that rate belong together (the walk steps on them). Not the ILP's own
        # rate: within HiGHS' tolerances its counts may miss the level by a hair and cost less than any
        # counts that reach it, and a rate no plan pays at that throughput proves nothing about the
        # levels up to it; then the rate is above the bound and only the bound steps.
        rate, at = self.rate_at(best.assignment, target)
        return replace(best, rate=rate, throughput=at)

    # -- the fastest plan ----------------------------------------------------------------------

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

    def fastest(self, known: float) -> tuple[float, tuple[int, ...] | None]:
        """The highest throughput any plan reaches (proven to 1e-9: `solve` finds no plan 1e-9 above it)
        and a plan reaching it, by bisection between `known` and `throughput_bound`."""
        model = self.model
        best = None
        if known <= 0.0:  # any plan at all: the lowest level
            level = self.solve(1e-9, objective=False)
            if level is None:
                return 0.0, None
            best = level.assignment
            known = provision_counts(model, best).max_throughput
            if known <= 0.0:
                return 0.0, None
        lo, hi = known, self.throughput_bound(known)
        # after a bisection step finds a plan, the level just above what that plan reaches comes next:
        # near the top the plan found is often the fastest, and one level no plan reaches then proves
        # it, where halving the interval down to STEP_RTOL took ~20 more ILPs (issue 40: a 110 x 8
        # refusal, 21 of its 32 ILPs)
        just_above = False
        while hi > lo * (1.0 + STEP_RTOL) and hi > 0:
            if self.out_of_time():
                break
            probe = just_above
            mid = lo * (1.0 + STEP_RTOL) if probe else (math.sqrt(lo * hi) if lo > 0 else hi / 2.0)
            just_above = False
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
            just_above = not probe
        return lo, best
