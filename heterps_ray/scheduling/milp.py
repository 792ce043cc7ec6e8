"""A second formulation of the optimum, independent of the level walk (issue 26): one mixed-integer
program over every throughput level at once, solved by HiGHS (scipy.optimize.milp).

The level walk (levels.py) fixes a target throughput X, solves the cheapest cost
rate there and steps X upwards, skipping levels by bounds. Here the throughput is a variable instead:
``z = 1000 · B / Θ``, the ms per batch the plan takes, and the cost ``R · N / Θ / 3600`` is
``N / (3600 · 1000 · B) · Σ price · count · z``, a sum of products of an integer count and ``z``.
Each count is chosen by binaries ``y[s, k]`` (segment s, layers i..j on type t, with k replicas),
so each product is a binary times ``z``, linearised exactly (McCormick, ``w = y · z``):

    w >= z - Z (1 - y),  w >= e[s, k] y,  (and w <= z, w <= Z y where w must equal y · z)

with ``Z`` an upper bound on z and ``e[s, k]`` the ms per batch the stage takes with k replicas.
The rest is linear in z:

* a stage: ``z >= Σ_k e[s, k] y[s, k]`` (DESIGN.md §3: ``e = τ ((1 - α) + α / k)``);
* the PS tier: shards chosen by binaries v[m], ``z >= Σ_m 1000 B / θ_ps(m) v[m]``;
* a chain of segments covering every layer, neighbours on different types (else one stage);
* max_instances per type: ``Σ k y + m v <= cap``;
* the floor: ``z <= 1000 B / Θmin``.

With runtime terms (DESIGN.md §3b, runtime_terms.py), per micro-batch busy times replace τ, and:

* async: the loop of ``k_0`` DataWorkers (stage 0's replicas), ``k_0 · z >= (K / q) · Σ loop_s``, where
  ``k_0 · z = Σ_{first s, k} k · w[s, k]`` (exact with both McCormick sides);
* sync: replicas add nothing (k = 1), ``z >= Σ loop_s + (K - 1) · M`` with ``M >= busy_s``;
* a shared host: ``z >= K · (Σ cpu_s + shard service) / free cores``.

What it cannot express it refuses, with the reason (`unsupported_reason`): ``ps_hosting: auto``
prices a plan of one replica everywhere with other busy times (the shards in the DataWorker's
process), which needs a second copy of every table behind an indicator.

It shares no search code with the walk (only the per-segment tables of the cost model: τ, α, and
the runtime's busy times), so agreement of the two is a check of the walk's proof. It is slower than
the walk on large problems (the big-M relaxation is weak); tests/test_milp.py uses it on small and
medium ones.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from heterps_ray.costmodel import CostModel, Problem
from heterps_ray.costmodel.formulas import FLOOR_RTOL, MS_PER_S, S_PER_HOUR
from heterps_ray.scheduling.highs import solve_milp
from heterps_ray.scheduling.segment_paths import assignment_of, cheapest_path


@dataclass(frozen=True)
class MilpResult:
    """The program's answer. `objective` is the cost ($) or, for "fastest", the throughput (samples/s)
    of the MILP's own solution; the plan (assignment, counts) is to be re-priced by the cost model."""

    status: Literal["optimal", "infeasible", "time limit"]
    objective: float  # $ (cost) or samples/s (fastest); inf / 0 when infeasible
    bound: float  # HiGHS' dual bound in the same unit (== objective when proven optimal)
    assignment: tuple[int, ...] | None
    replicas: tuple[int, ...]
    ps_shards: int
    throughput: float  # samples/s of the solution's z
    seconds: float
    variables: int


def unsupported_reason(problem: Problem) -> str | None:
    """Why the program cannot express `problem`, or None."""
    terms = problem.runtime
    if terms is not None and terms.ps_hosting == "auto":
        return (
            "runtime.ps_hosting: auto hosts the shards in the DataWorker's process when every count is "
            "1, with other busy times than on shard actors; the MILP has one busy time per segment "
            "(set ps_hosting: actors to compare)"
        )
    return None


def milp_optimum(
    problem: Problem,
    objective: Literal["cost", "fastest"] = "cost",
    time_limit_s: float | None = None,
    model: CostModel | None = None,
) -> MilpResult:
    """The cheapest plan meeting the floor ("cost"), or the fastest plan ("fastest", the floor
    ignored), of `problem` in one MILP. Raises ValueError naming the reason when the program
    cannot express the problem (`unsupported_reason`)."""
    reason = unsupported_reason(problem)
    if reason is not None:
        raise ValueError(f"problem {problem.name!r}: {reason}")
    started = time.perf_counter()
    program = _Program(model or CostModel(problem), objective)
    return program.solve(time_limit_s, started)


class _Program:
    def __init__(self, model: CostModel, objective: str):
        self.model, self.objective = model, objective
        problem = model.problem
        L, T, B = model.num_layers, model.num_types, model.batch_size
        self.L, self.T, self.B = L, T, B
        terms = problem.runtime
        self.runtime = terms is not None
        self.sync = terms is not None and terms.mode == "sync"
        self.K = terms.micro_batches if terms is not None else 1
        cap = model.max_instances.astype(np.int64)
        self.cap = cap
        tau, alpha = model.segment_tables()  # the base model's stage times; runtime terms replace them
        if terms is None:
            self.loop = self.busy = None
        else:
            from heterps_ray.scheduling.runtime_levels import RuntimeLevels

            tables = RuntimeLevels(model)  # the per-segment runtime tables only (no search)
            busy = tables.busy[False]  # shards on actors
            tau = self.K * busy
            self.busy = busy
            self.loop = busy + tables.waiting
            self.hosts = [(per[False], free, service) for per, free, service in tables.hosts]
            self.in_flight = terms.in_flight
        valid = np.isfinite(tau)
        m_min = model.ps_min_shards
        # segments and their counts: e[s, k] = tau ((1 - alpha) + alpha / k), ms per batch
        ii, jj, tt = np.nonzero(valid)
        self.shards = np.arange(m_min, int(cap[model.ps_type]) + 1)
        theta_ps = np.array([model.ps_throughput(int(m)) for m in self.shards])
        with np.errstate(divide="ignore"):
            self.e_ps = np.where(np.isinf(theta_ps), 0.0, MS_PER_S * B / theta_ps)
        k_max = cap[tt] - np.where(tt == model.ps_type, m_min, 0)
        if self.sync:
            k_max = np.minimum(k_max, 1)  # sync: replicas add nothing, so the cheapest plan has none
        fastest_e = tau[ii, jj, tt] * ((1.0 - alpha[ii, jj, tt]) + alpha[ii, jj, tt] / np.maximum(k_max, 1))
        fastest_e = np.where(k_max >= 1, fastest_e, np.inf)
        # z_lo: every plan has a stage over each layer, no faster than that segment's most replicas
        e_min = np.full((L, L, T), np.inf)
        e_min[ii, jj, tt] = fastest_e
        z_lo = float(self.e_ps[-1]) if len(self.e_ps) else 0.0
        for layer in range(L):
            z_lo = max(z_lo, float(e_min[: layer + 1, layer:, :].min()))
        self.z_lo = z_lo
        asynchronous = self.runtime and not self.sync
        seg_of, count_of, e_of = [], [], []
        for s, (i, j, t) in enumerate(zip(ii, jj, tt, strict=True)):
            a, base = float(alpha[i, j, t]), float(tau[i, j, t])
            last = math.inf
            for k in range(1, int(k_max[s]) + 1):
                e = base * ((1.0 - a) + a / k)
                loop_workers = asynchronous and i == 0  # more DataWorkers also shorten the loop
                if k > 1 and not loop_workers and (e >= last * (1.0 - 1e-12) or last <= z_lo):
                    break  # no faster, or the count below already meets every z a plan can have
                seg_of.append(s)
                count_of.append(k)
                e_of.append(e)
                last = e
        self.ii, self.jj, self.tt = ii, jj, tt
        self.seg_of = np.array(seg_of, dtype=np.int64)
        self.count = np.array(count_of, dtype=np.float64)
        self.e = np.array(e_of, dtype=np.float64)
        self.z_hi = self._slowest(valid)
        if objective == "cost" and model.floor > 0.0:
            self.z_hi = min(self.z_hi, MS_PER_S * B / (model.floor * (1.0 - FLOOR_RTOL)))

    def _slowest(self, valid: np.ndarray) -> float:
        """An upper bound on any plan's z: the slowest term of the slowest chain."""

        def longest(weights: np.ndarray) -> float:
            value, _ = cheapest_path(np.where(valid, -weights, np.inf))
            return -value if math.isfinite(value) else 0.0

        z = max(float(self.e.max(initial=0.0)), float(self.e_ps.max(initial=0.0)))
        if self.loop is not None:
            assert self.busy is not None
            if self.sync:
                z = max(z, longest(self.loop) + (self.K - 1) * float(self.busy[valid].max(initial=0.0)))
            else:
                z = max(z, self.K / self.in_flight * longest(self.loop))
            for per, free, service in self.hosts:
                z = max(z, self.K * (longest(per) + service) / free)
        return z * (1.0 + 1e-9) + 1e-12

    def solve(self, time_limit_s: float | None, started: float) -> MilpResult:
        from scipy.optimize import Bounds, LinearConstraint
        from scipy.sparse import coo_matrix

        model, L, T = self.model, self.L, self.T
        if len(self.seg_of) == 0 or self.z_lo > self.z_hi:
            return self._infeasible(started, 0)
        ny, nm = len(self.seg_of), len(self.shards)
        Y, W, V, U, Z = 0, ny, 2 * ny, 2 * ny + nm, 2 * ny + 2 * nm
        n = Z + 1
        has_m = self.sync and self.K > 1
        Mcol = n
        n += int(has_m)
        s_of = self.seg_of
        i_of, j_of, t_of = self.ii[s_of], self.jj[s_of], self.tt[s_of]
        first = i_of == 0
        yv = np.arange(ny)
        rows_i: list[np.ndarray] = []
        rows_j: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        lo: list[float] = []
        hi: list[float] = []
        r = 0

        def add(ri: Any, cj: Any, v: Any) -> None:
            ri, cj = np.asarray(ri, dtype=np.int64), np.asarray(cj, dtype=np.int64)
            rows_i.append(ri)
            rows_j.append(cj)
            vals.append(np.broadcast_to(np.asarray(v, dtype=np.float64), ri.shape).copy())

        def rows(count: int, low: float, high: float) -> int:
            nonlocal r
            start = r
            lo.extend([low] * count)
            hi.extend([high] * count)
            r += count
            return start

        # a chain: one stage starts at layer 0; what ends at b - 1 starts at b; neighbours differ in type
        add(np.full(int(first.sum()), rows(1, 1.0, 1.0)), Y + yv[first], 1.0)
        if L > 1:
            flow = rows(L - 1, 0.0, 0.0)
            ends = j_of < L - 1
            add(flow + j_of[ends], Y + yv[ends], 1.0)
            starts = i_of > 0
            add(flow + i_of[starts] - 1, Y + yv[starts], -1.0)
            differ = rows((L - 1) * T, -np.inf, 1.0)
            add(differ + j_of[ends] * T + t_of[ends], Y + yv[ends], 1.0)
            add(differ + (i_of[starts] - 1) * T + t_of[starts], Y + yv[starts], 1.0)
        # max_instances
        caps = rows(T, -np.inf, 0.0)
        hi[caps : caps + T] = [float(c) for c in self.cap]
        add(caps + t_of, Y + yv, self.count)
        mv = np.arange(nm)
        add(np.full(nm, caps + model.ps_type), V + mv, self.shards.astype(np.float64))
        # stages: z >= e[s, k] y[s, k] summed over the segment's counts
        stage = rows(len(self.ii), 0.0, np.inf)
        add(stage + s_of, Y + yv, -self.e)
        add(stage + np.arange(len(self.ii)), np.full(len(self.ii), Z), 1.0)
        # the PS tier
        add(np.full(nm, rows(1, 1.0, 1.0)), V + mv, 1.0)
        ps = rows(1, 0.0, np.inf)
        add(np.full(nm, ps), V + mv, -self.e_ps)
        add([ps], [Z], 1.0)
        # w = y z, u = v z (lower sides: what the cost needs)
        zb = self.z_hi
        for var, prod, e, count in ((Y, W, self.e, ny), (V, U, self.e_ps, nm)):
            idx = np.arange(count)
            mc = rows(count, -zb, np.inf)  # w - z - Z y >= -Z
            add(mc + idx, prod + idx, 1.0)
            add(mc + idx, np.full(count, Z), -1.0)
            add(mc + idx, var + idx, -zb)
            tight = rows(count, 0.0, np.inf)  # w - e y >= 0
            add(tight + idx, prod + idx, 1.0)
            add(tight + idx, var + idx, -e)
        if self.loop is not None:
            loop = self.loop[i_of, j_of, t_of]
            if self.sync:
                row = rows(1, 0.0, np.inf)  # z - Σ loop y - (K - 1) M >= 0
                add([row], [Z], 1.0)
                add(np.full(ny, row), Y + yv, -loop)
                if has_m:
                    add([row], [Mcol], -(self.K - 1.0))
                    assert self.busy is not None
                    mrow = rows(ny, 0.0, np.inf)  # M >= busy_s y
                    add(mrow + yv, np.full(ny, Mcol), 1.0)
                    add(mrow + yv, Y + yv, -self.busy[i_of, j_of, t_of])
            else:
                f = yv[first]
                row = rows(1, 0.0, np.inf)  # Σ_first k w - (K / q) Σ loop y >= 0
                add(np.full(len(f), row), W + f, self.count[f])
                add(np.full(ny, row), Y + yv, -self.K / self.in_flight * loop)
                upper = rows(len(f), -np.inf, 0.0)  # w <= z and w <= Z y: w is exactly y z
                add(upper + np.arange(len(f)), W + f, 1.0)
                add(upper + np.arange(len(f)), np.full(len(f), Z), -1.0)
                upper = rows(len(f), -np.inf, 0.0)
                add(upper + np.arange(len(f)), W + f, 1.0)
                add(upper + np.arange(len(f)), Y + f, -zb)
            for per, free, service in self.hosts:
                row = rows(1, self.K * service / free, np.inf)  # z - K Σ cpu y / free >= K service / free
                add([row], [Z], 1.0)
                add(np.full(ny, row), Y + yv, -self.K / free * per[i_of, j_of, t_of])
        A = coo_matrix((np.concatenate(vals), (np.concatenate(rows_i), np.concatenate(rows_j))), shape=(r, n))
        c = np.zeros(n)
        price = model.price
        if self.objective == "cost":
            c[W : W + ny] = price[t_of] * self.count
            c[U : U + nm] = price[model.ps_type] * self.shards
        else:
            c[Z] = 1.0
        integrality = np.zeros(n)
        integrality[Y : Y + ny] = 1
        integrality[V : V + nm] = 1
        var_lo, var_hi = np.zeros(n), np.full(n, np.inf)
        var_hi[Y : Y + ny] = 1.0
        var_hi[V : V + nm] = 1.0
        var_hi[W : W + ny] = zb
        var_hi[U : U + nm] = zb
        var_lo[Z], var_hi[Z] = self.z_lo, zb
        options: dict[str, Any] = {"mip_rel_gap": 0.0, "mip_abs_gap": 0.0}
        if time_limit_s is not None:
            options["time_limit"] = float(time_limit_s)
        result = solve_milp(
            c=c,
            constraints=LinearConstraint(A.tocsr(), np.array(lo), np.array(hi)),
            integrality=integrality,
            bounds=Bounds(var_lo, var_hi),
            options=options,
        )
        if result.status == 2:
            return self._infeasible(started, n)
        if result.x is None:
            status: Any = "time limit" if result.status == 1 else "infeasible"
            if status == "infeasible":
                raise RuntimeError(f"HiGHS: {result.message}")
            return MilpResult(status, math.inf, -math.inf, None, (), 0, 0.0, time.perf_counter() - started, n)
        x = result.x
        chosen = np.flatnonzero(x[Y : Y + ny] > 0.5)
        path = sorted((int(i_of[v]), int(j_of[v]), int(t_of[v]), int(self.count[v])) for v in chosen)
        m = int(self.shards[int(np.argmax(x[V : V + nm]))])
        z = float(x[Z])
        to_cost = model.samples / (S_PER_HOUR * MS_PER_S * self.B)
        dual = getattr(result, "mip_dual_bound", None)
        dual = float(result.fun) if dual is None or not math.isfinite(dual) else float(dual)
        if self.objective == "cost":
            value, bound = float(result.fun) * to_cost, dual * to_cost
        else:
            value, bound = MS_PER_S * self.B / z, MS_PER_S * self.B / dual if dual > 0 else math.inf
        return MilpResult(
            "optimal" if result.status == 0 else "time limit",
            value,
            bound,
            assignment_of([(i, j, t) for i, j, t, _ in path]),
            tuple(k for *_, k in path),
            m,
            MS_PER_S * self.B / z if z > 0 else math.inf,
            time.perf_counter() - started,
            n,
        )

    def _infeasible(self, started: float, n: int) -> MilpResult:
        worst = math.inf if self.objective == "cost" else 0.0
        return MilpResult("infeasible", worst, worst, None, (), 0, 0.0, time.perf_counter() - started, n)
