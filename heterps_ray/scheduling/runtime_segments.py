"""The per-segment tables of a problem with runtime terms (DESIGN.md §3b) that every level of the walk
is priced from (runtime_levels.py): for each segment i..j of layers on a type t, its compute, its busy
and waiting ms per micro-batch (with the table's rows hosted in the DataWorker or on actor shards), its
Amdahl fraction, and each shared host's CPU; and, per level, the fewest replicas and shards reaching it
and the loop's and hosts' budgets. Built once per problem, read by the bounds and by the ILP."""

from __future__ import annotations

import math

import numpy as np

from heterps_ray.costmodel import CostModel
from heterps_ray.costmodel.formulas import (
    BYTES_PER_MS_PER_GBPS,
    MS_PER_S,
    fewest_replicas,
    stage_throughput,
)
from heterps_ray.costmodel.runtime_terms import call_ms, table_rate
from heterps_ray.scheduling.levels import LevelPricing
from heterps_ray.scheduling.provisioning import REACH_RTOL

UNREACHABLE = 1e12  # replicas standing in for "no count reaches the level"


class RuntimeSegments(LevelPricing):
    """A problem's per-segment runtime tables and, per level, the counts that reach it (module docstring);
    the pricing of a level on them is RuntimeLevels' (runtime_levels.py)."""

    def __init__(self, model: CostModel, time_limit_s: float | None = None):
        problem, terms = model.problem, model.problem.runtime
        if terms is None:
            raise ValueError("RuntimeLevels needs a problem with a `runtime` section")
        super().__init__(model, time_limit_s)
        self.terms = terms
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
        for hosted in (False, True):  # a row's cost to stage 0 where the rows live (per type: its GPU's memory)
            rate = np.array([table_rate(problem, terms, r.name, hosted).ms_per_row for r in types])
            ps_wait = np.where(i == 0, rows * rate[None, None, :], 0.0)
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

    def replicas(self, hosted: bool, target: float) -> np.ndarray:
        """k(i,j,t): fewest replicas of each segment reaching `target` as a stage (UNREACHABLE: none).
        Sync: 1 where one replica reaches it (replicas add nothing there)."""
        tau = self.K * self.busy[hosted]
        reach = target * (1.0 - REACH_RTOL)
        if self.sync:
            theta = stage_throughput(self.B, tau, self.alpha, 1.0)
            return np.where(self.valid & (theta >= reach), 1.0, UNREACHABLE)
        k = fewest_replicas(self.B, tau, self.alpha, reach)
        return np.where(self.valid & np.isfinite(k), np.minimum(k, UNREACHABLE), UNREACHABLE)

    def ps_shards(self, hosted: bool, target: float) -> int | None:
        """Shards for the level: the fewest reaching it (hosted: the fewest there are); None: none."""
        model = self.model
        if hosted:  # the fewest: hosted shards take no instance and bound nothing
            return int(model.ps_min_shards)
        if model.rows_per_sample <= 0.0:
            return int(self.shards[0]) if len(self.shards) else None
        reach = target * (1.0 - REACH_RTOL)
        for m in self.shards:
            if model.ps_throughput(int(m)) >= reach:
                return int(m)
        return None

    def shard_actors(self, hosted: bool, m: int) -> int:
        """PS shard actors of a case with `m` shards: none where DataWorker 0 hosts them (they take no
        instance of the PS type, and cost nothing beyond the DataWorker)."""
        return 0 if hosted else m

    def shards_rate(self, hosted: bool, m: int) -> float:
        """$/hour of a case's shard actors."""
        return self.shard_actors(hosted, m) * float(self.price[self.ps_type])

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
