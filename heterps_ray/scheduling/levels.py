"""The level walk: the exact optimum of both cost models (DESIGN.md §3 and §3b) as one search.

Cost = R · N / 3600 / Θ is not linear in a plan's choices, but at a fixed target throughput X the
cheapest cost *rate* R*(X) of the plans reaching X is a shortest path over stage segments with side
constraints (segment_paths.py). A model prices levels through a `LevelPricing` (base_levels.py: the
base model, each level a DP; runtime_levels.py: the runtime terms, each level an ILP); the walk over
the levels, its bounds and its proof are this module's, the same for both.

The walk: X_0 = floor; solve R*(X_n); its plan reaches Θ_n >= X_n at rate R_n; the next level is
X_{n+1} = Θ_n (1 + STEP_RTOL). Let P* be optimal and X_n the last level <= Θ(P*): the plan found there
costs R_n <= R(P*) and reaches Θ_n >= Θ(P*) (else X_{n+1} <= Θ(P*)), so it is at least as cheap. It
rests on R*(X) never falling as X rises (a plan reaching X' reaches every X <= X') and on these
bounds, each a lower bound for the reason its pricing states; a bound that cannot be shown to be one
is not used to skip a level:

* ``lb(X) <= R*(X)`` (`LevelPricing.lower_bound`): bounds every plan at X and, R* being monotone,
  every plan above X;
* ``Level.bound <= R*(X)`` (the DP's rate, or the ILP's dual bound, or the cutoff below which the ILP
  proved no plan: the walk asks for no plan dearer than one within CUTOFF_WIDTH above X could beat C);
* ``Θ_max >= Θ(P)`` for every plan P (`LevelPricing.throughput_bound`);
* ``ρ(X) <= R(P) / Θ(P)`` for every plan P with Θ(P) >= X (`LevelPricing.ratio_bound`).

Then: skip to ``lb(X) · N / 3600 / C`` (C the best cost found: a plan with X <= Θ below it costs
``R / Θ >= lb / Θ > C``); stop once ``lb(X) · N / 3600 / Θ_max >= C`` (every remaining plan costs at
least that), or once ``ρ(X) · N / 3600 >= C``; step from X_n past Θ_n only when R_n is proven R*(X_n) (a plan with X_n <= Θ <= Θ_n then
costs ``R / Θ >= R_n / Θ_n``). Θ_n is what the level's plan reaches *at the rate R_n*, never what its
assignment reaches with more replicas (issue 26: those cost more than R_n, which proves nothing about
the plans in between). Every plan found is re-provisioned exactly for its assignment (provisioning.py),
which can only lower its cost; the plan records the proof in ``plan.extra["proof"]``.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from heterps_ray.costmodel import CostModel
from heterps_ray.costmodel.formulas import FLOOR_RTOL, S_PER_HOUR
from heterps_ray.costmodel.pricing import monetary_cost
from heterps_ray.scheduling.provisioning import STEP_RTOL, Provisioned, provision_counts

RATIO_CHECK = 1.05  # the ratio bound's stop is tried where lb(X) N / 3600 / X is this far above the cost
# and, after it failed at X, not again below RATIO_RETRY X (it costs a bound's time; a stop not tried
# only lets the walk go on, it never proves anything)
RATIO_RETRY = 1.1
CUTOFF_WIDTH = 0.02  # a level's solve needs no plan dearer than one this far above it could beat the best
SOLVER_RTOL = 1e-7  # a level whose solver plan misses it within HiGHS' tolerances: the walk steps this far
TIME_LIMIT = "time limit"  # Proof.stop when the deadline ended the search: the plan is not proven


@dataclass(frozen=True)
class Level:
    """The cheapest plan found at one target throughput X, with a proven bound on R*(X)."""

    rate: float  # $/hour of the plan found (>= R*(X)); inf: no plan found below the walk's cutoff
    bound: float  # proven lower bound on R*(X) ($/hour); == rate where the level is solved exactly
    assignment: tuple[int, ...]  # () where no plan was found below the cutoff (the bound is the cutoff)
    throughput: float = math.nan  # samples/s the plan reaches *at that rate* (>= X; nan: not priced)


@dataclass
class Proof:
    """What the search proved, for plan.extra: the bound that ended the walk and how levels went."""

    kind: str
    solves: int = 0  # levels solved exactly (DP or ILP)
    solver_optimal: bool = True  # every ILP solved to proven optimality (or proven infeasible)
    levels_bounded: int = 0  # levels skipped by the lower bound
    levels_by_dp: int = 0  # levels solved by a DP candidate meeting the DP bound (no ILP)
    bisection_steps: int = 0  # exact feasibility checks for the fastest plan
    tolerance_steps: int = 0  # levels whose solver plan missed them within HiGHS' tolerances (stepped 1e-7)
    stop: str = ""
    bound: float | None = None  # the lower bound on any plan's cost the walk ended with ($)
    notes: list[str] = field(default_factory=list)

    def to_extra(self, cost: float | None, counters: dict[str, int]) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "proven": self.solver_optimal and self.stop != TIME_LIMIT,
            **counters,
            "ilp_all_optimal": self.solver_optimal,
            "levels_skipped_by_dp_bound": self.levels_bounded,
            "levels_proven_by_dp": self.levels_by_dp,
            "bisection_steps": self.bisection_steps,
            "tolerance_steps": self.tolerance_steps,
            "stop": self.stop,
            "bound": self.bound,
            "cost": cost,
            **({"notes": self.notes} if self.notes else {}),
        }


class LevelPricing(ABC):
    """How one cost model prices a level; the walk (`cheapest`) is the same for every model.

    Subclasses state why each bound they return is one (their docstrings)."""

    method = ""  # plan.extra["method"]
    kind = ""  # plan.extra["proof"]["kind"]

    def __init__(self, model: CostModel, time_limit_s: float | None = None):
        self.model = model
        self.deadline = math.inf if time_limit_s is None else time.perf_counter() + time_limit_s
        self.proof = Proof(self.kind)
        self.pool: dict[tuple[int, ...], float] = {}  # assignments seen -> the most each reaches

    def out_of_time(self) -> bool:
        if time.perf_counter() <= self.deadline:
            return False
        self.proof.stop = TIME_LIMIT
        return True

    def remember(self, assignment: tuple[int, ...], reached: float, size: int = 24) -> None:
        """Keep an assignment as a candidate for the levels it reaches (the `size` fastest seen)."""
        self.pool[assignment] = reached
        if len(self.pool) > size:
            del self.pool[min(self.pool, key=lambda a: self.pool[a])]

    def counters(self) -> dict[str, int]:
        """Solver counts for plan.extra (what each level cost)."""
        return {}

    @abstractmethod
    def lower_bound(self, target: float) -> tuple[float, list[tuple[int, ...]]]:
        """(lb <= R*(target), inf where no plan reaches it; assignments worth pricing as candidates)."""
        ...

    @abstractmethod
    def solve(self, target: float, objective: bool = True, cutoff: float = math.inf) -> Level | None:
        """The cheapest plan reaching `target` with a proven bound on R*(target); None only when no plan
        reaches it. objective False: any plan reaching it (a feasibility check). `cutoff`: a rate
        ($/hour) the caller needs no plan at or above; where R*(target) >= cutoff a pricing may answer
        with a dearer plan, or none (assignment ()), and the bound `cutoff` (the walk then skips on the
        bound)."""
        ...

    def ratio_bound(self, low: float, high: float) -> float:
        """A lower bound on R(P) / Θ(P) over every plan P with low <= Θ(P) <= high (high may be inf).
        This one: R(P) >= R*(low) >= lb(low) (R* never falls as X rises) and Θ(P) <= high; a pricing
        may state a tighter one."""
        return 0.0 if math.isinf(high) else self.lower_bound(low)[0] / high

    def scout(self, low: float, high: float) -> list[tuple[int, ...]]:
        """Assignments worth pricing as incumbents before the walk, from levels between `low` and `high`
        (no proof rests on them: each is provisioned exactly and only ever lowers the best cost). A
        cheap incumbent early makes every skip longer and every stop sooner. This one: none."""
        return []

    @abstractmethod
    def throughput_bound(self, known: float) -> float:
        """An upper bound on every plan's throughput, from a throughput `known` to be reached."""
        ...

    @abstractmethod
    def fastest(self, known: float) -> tuple[float, tuple[int, ...] | None]:
        """(the highest throughput any plan reaches, a plan reaching it); `known`: reached by some plan
        (0: none known). On the deadline: the fastest proven so far, with proof.stop = TIME_LIMIT."""
        ...


Found = tuple[tuple[int, ...], Provisioned]


def cheapest(pricing: LevelPricing, floor: float, seeds: list[tuple[int, ...]]) -> Found | None:
    """The cheapest plan at or above `floor` (None: no plan meets it), by the walk of the module
    docstring; `seeds` are assignments priced first as incumbents. pricing.proof says why it stopped."""
    model, proof = pricing.model, pricing.proof
    best: Found | None = None
    known = 0.0

    def consider(assignment: tuple[int, ...] | None, keep: bool = True) -> None:
        nonlocal best, known
        if not assignment:
            return
        counts = provision_counts(model, assignment)
        known = max(known, counts.max_throughput)
        if keep:
            pricing.remember(assignment, counts.max_throughput)
        if counts.feasible and (best is None or counts.cost < best[1].cost):
            best = (assignment, counts)

    for assignment in seeds:
        consider(assignment)
    target = max(floor * (1.0 - FLOOR_RTOL), 0.0)
    lb, paths = pricing.lower_bound(max(target, 1e-300))
    for assignment in paths:
        consider(assignment)
    if not math.isfinite(lb):
        proof.stop = "no plan reaches the floor (lower bound)"
        return best
    theta_max = pricing.throughput_bound(max(known, target, 1e-9))
    # the scout's many fast plans would crowd the pool of level candidates (the fastest kept): only the
    # cheapest of them joins it
    for assignment in pricing.scout(max(target, 1e-9), theta_max):
        consider(assignment, keep=False)
    if best is not None:
        pricing.remember(best[0], best[1].max_throughput)
    to_cost = model.samples / S_PER_HOUR
    ratio_failed_at = 0.0
    while target <= theta_max * (1.0 + STEP_RTOL):
        if pricing.out_of_time():
            return best
        # lb <= R*(target) <= R*(X) for every X >= target: it bounds every plan here and above
        lb, paths = pricing.lower_bound(max(target, 1e-300))
        if not math.isfinite(lb):
            proof.stop = "no plan reaches the level (lower bound)"
            break
        for assignment in paths:
            consider(assignment)
        if best is not None:
            # stop: every remaining plan costs R · N / 3600 / Θ >= lb · N / 3600 / theta_max
            if monetary_cost(lb, model.samples, theta_max) >= best[1].cost:
                proof.stop = "lower bound at the level / max throughput >= cost"
                proof.bound = monetary_cost(lb, model.samples, theta_max)
                break
            # stop: every plan at or above the level costs R / Θ · N / 3600 >= the ratio bound's
            if (
                target > 0.0
                and target >= ratio_failed_at * RATIO_RETRY
                and monetary_cost(lb, model.samples, target) >= best[1].cost * RATIO_CHECK
            ):
                ratio = pricing.ratio_bound(target, math.inf) * to_cost
                if ratio >= best[1].cost:
                    proof.stop = "ratio bound above the level >= cost"
                    proof.bound = ratio
                    break
                ratio_failed_at = target  # not tried again until the level is RATIO_RETRY above
            # skip: a plan with target <= Θ < skip_to costs >= lb · N / 3600 / Θ > the best cost
            skip_to = lb * to_cost / best[1].cost
            if skip_to > target * (1.0 + STEP_RTOL):
                proof.levels_bounded += 1
                target = skip_to
                continue
        # a plan with target <= Θ <= target (1 + CUTOFF_WIDTH) cheaper than the best costs R < C Θ / (N /
        # 3600) <= cutoff: the level needs no plan at or above it; where R*(target) >= cutoff its bound
        # skips the walk past that interval (the skip below), and its solver prunes by it
        cutoff = math.inf if best is None else best[1].cost * target * (1.0 + CUTOFF_WIDTH) / to_cost
        level = pricing.solve(max(target, 1e-300), cutoff=cutoff)
        if level is None:
            proof.stop = "no plan reaches the level"
            break
        consider(level.assignment)
        # level.bound <= R*(target): the same stop with the level's own bound
        if best is not None and monetary_cost(level.bound, model.samples, theta_max) >= best[1].cost:
            proof.stop = "level bound / max throughput >= cost"
            proof.bound = monetary_cost(level.bound, model.samples, theta_max)
            break
        if math.isinf(level.throughput):
            proof.stop = "unbounded throughput"
            break
        optimal = level.rate <= level.bound * (1.0 + SOLVER_RTOL)
        # step past what the level's plan reaches at its rate, only when that rate is R*(target)
        nxt = max(level.throughput, target) if optimal else 0.0
        if best is not None:  # the skip above, with the level's bound
            nxt = max(nxt, level.bound * to_cost / best[1].cost)
        if nxt <= target and not optimal:
            # the solver's plan is not proven R*(target) within its tolerances and the bound does not
            # move: plans with Θ in [target, target (1 + 1e-7)) are passed over (counted in the proof)
            proof.tolerance_steps += 1
            nxt = target * (1.0 + SOLVER_RTOL)
        target = nxt * (1.0 + STEP_RTOL)  # plans in (nxt, nxt (1 + 1e-9)): within 1e-9 of it
    else:
        proof.stop = "level above the max throughput bound"
    return best
