"""What the pipeline simulation (sim_pipeline.py) takes and gives: a stage and the PS tier in the
per-batch times the simulator (simulator.py) derived, and the simulated run's throughput, utilisation
and timelines."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class StageModel:
    """One stage as the simulator sees it: ms per micro-batch of `b` samples (one replica, alone)."""

    resource: str
    replicas: int
    forward_ms: float  # compute only
    backward_ms: float  # compute only (with the optimizer step)
    recv_forward_ms: float = 0.0  # one side of the activation message from the previous stage
    send_forward_ms: float = 0.0  # one side of the activation message to the next stage
    recv_backward_ms: float = 0.0  # one side of the gradient message from the next stage
    send_backward_ms: float = 0.0  # one side of the gradient message to the previous stage
    input_ms: float = 0.0  # first stage: reading one micro-batch worth of input
    parallel_fraction: float = 1.0
    dense_push_ms: float = 0.0  # async: PS service time of one push of this stage's dense gradients
    threads: int = 1  # cores a busy replica keeps busy (its weight on a shared host)
    host: int | None = None  # index of the shared host it runs on (None: cores of its own)
    call_cpu_ms: float = 0.0  # shared host: CPU of Ray's own processes per call on a replica
    in_flight_ms: float = 0.0  # a message's latency at this end, spent in flight (not on the actor)
    call_ms: float = 0.0  # a StageWorker's own time per call it receives (Ray's argument/result work)


@dataclass(frozen=True)
class PSModel:
    """The PS tier: `shards` FIFO servers; a micro-batch pulls and pushes `rows` rows."""

    shards: int
    rows: float  # sparse rows per micro-batch (before de-duplication, as the rate is measured)
    rows_per_second_per_shard: float  # of pull + push together, as the problem file gives it
    pull_share: float = 0.5  # fraction of a row's service time spent on its pull
    push_client_share: float = 0.0  # fraction of a push done by the DataWorker itself (summing gradients)
    threads: int = 1
    host: int | None = None  # shared host of the PS type
    call_cpu_ms: float = 0.0  # shared host: CPU of Ray's own processes per request to a shard

    def service_ms(self, rows: float, pull: bool) -> float:
        """One shard's time for its part (1/shards) of a request of `rows` rows."""
        share = self.pull_share if pull else (1.0 - self.pull_share) * (1.0 - self.push_client_share)
        return rows / self.shards * share / self.rows_per_second_per_shard * 1000.0

    def client_ms(self, rows: float) -> float:
        """The DataWorker's own work for a push of `rows` rows (before it goes to the shards)."""
        return (
            rows * (1.0 - self.pull_share) * self.push_client_share / self.rows_per_second_per_shard * 1000.0
        )


@dataclass
class SimResult:
    """Throughput (samples/s: all samples over the whole run, as the runtime measures it),
    per-stage utilisation and the timelines."""

    throughput: float
    utilisation: list[float]  # per stage: busy time / (replicas · makespan)
    ps_utilisation: float
    makespan_ms: float
    samples: int
    spans: pd.DataFrame  # start_ms, end_ms, stage (-1: PS), replica, kind, batch, micro_batch
    queues: pd.DataFrame  # time_ms, stage, queued (calls waiting at the stage), in_flight (DataWorkers')
    stages: list[StageModel] = field(default_factory=list)

    def summary(self) -> pd.DataFrame:
        """Per-stage table: type, replicas, utilisation, time-averaged and peak queue depth."""
        rows = []
        for s, stage in enumerate(self.stages):
            q = self.queues[self.queues["stage"] == s]
            rows.append(
                {
                    "stage": s,
                    "type": stage.resource,
                    "replicas": stage.replicas,
                    "utilisation": self.utilisation[s],
                    "mean_queue": _time_average(q, "queued", self.makespan_ms),
                    "max_queue": int(q["queued"].max()) if len(q) else 0,
                    "max_in_flight": int(q["in_flight"].max()) if len(q) else 0,
                }
            )
        return pd.DataFrame(rows)


def _time_average(q: pd.DataFrame, column: str, horizon: float) -> float:
    """Time-weighted mean of a step function logged at its change points."""
    if q.empty or horizon <= 0:
        return 0.0
    t = q["time_ms"].to_numpy()
    v = q[column].to_numpy(dtype=float)
    widths = np.diff(np.append(t, max(horizon, t[-1])))
    return float(np.sum(v * widths) / max(horizon - t[0], 1e-12))
