"""`heterps data synth`: Criteo-like data drawn from a known hidden model, so the best
possible AUC is known.

The hidden model (all of it drawn from ``seed``):

* slot ``s`` has ``V_s`` values (log-uniform in [vocab_min, vocab_max]); value of rank ``r``
  is drawn with probability proportional to ``(r + 1) ** -a_s`` (Zipf, ``a_s`` in
  [zipf_min, zipf_max]); a few slots are missing in 20-45% of rows, as in Criteo. Values are
  written as distinct 8-hex strings, so the same hashing path serves real and synthetic data.
* every value (and a slot's missing value) has a logit effect ``~ N(0, sigma_s^2)``, shrunk by
  ``1/sqrt(1 + r/tail_rank)`` for the value of rank ``r`` (rare values matter less, as in real
  logs, so one epoch over 1M rows can learn what matters); a third of the slots carry no
  signal (``sigma_s = 0``).
* dense features are integer counts ``floor(exp(N(mu_j, s_j)))``, some missing; with
  ``z = log1p(x)`` (missing -> 0, the transform the models see) four of them add
  ``w_j * tanh(z_j - c_j)``.
* ``logit = bias + scale * (sum of slot effects + dense effect)``; ``scale`` and ``bias`` are
  solved on a calibration sample so the expected AUC of the true probabilities is
  ``target_auc`` and the mean CTR is ``base_ctr``. ``label ~ Bernoulli(sigmoid(logit))``.

``achievable_auc`` in _meta.json is the AUC of the true probabilities against the drawn labels
of the eval split: no model can expect more on it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from heterps_ray.data import DEFAULT_EVAL_FRACTION, DEFAULT_ROWS_PER_PART
from heterps_ray.data.criteo import NUM_DENSE, NUM_SLOTS, RAW_SCHEMA
from heterps_ray.data.writer import DatasetWriter, eval_every
from heterps_ray.errors import ConfigError

_CALIBRATION_ROWS = 50_000
_CHUNK_ROWS = 100_000  # rows drawn at once; chunk c uses its own random stream (seed, c)


@dataclass(frozen=True)
class SynthSpec:
    """Knobs of the hidden model (the defaults aim at the models' reach: dim-9 embeddings + MLP)."""

    vocab_min: int = 100
    """fewest distinct values of a slot"""
    vocab_max: int = 10_000
    """most distinct values of a slot"""
    zipf_min: float = 1.1
    """smallest Zipf exponent of a slot's value frequencies"""
    zipf_max: float = 1.4
    """largest Zipf exponent"""
    target_auc: float = 0.78
    """expected AUC of the true probabilities"""
    base_ctr: float = 0.25
    """mean click probability"""
    tail_rank: float = 100.0
    """value effects shrink as 1/sqrt(1 + rank/tail_rank): rare values matter less (0: no shrink)"""

    def check(self) -> None:
        if not 2 <= self.vocab_min <= self.vocab_max:
            raise ConfigError(None, "vocab_min/vocab_max", "2 <= vocab_min <= vocab_max", self)
        if not 0 < self.zipf_min <= self.zipf_max:
            raise ConfigError(None, "zipf_min/zipf_max", "0 < zipf_min <= zipf_max", self)
        if not 0.55 <= self.target_auc <= 0.95:
            raise ConfigError(None, "target_auc", "a number in [0.55, 0.95]", self.target_auc)
        if self.tail_rank < 0:
            raise ConfigError(None, "tail_rank", "a number >= 0", self.tail_rank)
        if not 0.01 <= self.base_ctr <= 0.99:
            raise ConfigError(None, "base_ctr", "a number in [0.01, 0.99]", self.base_ctr)


class HiddenModel:
    """The truth behind a synthetic dataset: draws rows and their click probabilities."""

    def __init__(self, seed: int, spec: SynthSpec = SynthSpec()):
        spec.check()
        self.seed, self.spec = seed, spec
        rng = np.random.default_rng([seed, 0])
        self.vocab_sizes = np.round(
            np.exp(rng.uniform(np.log(spec.vocab_min), np.log(spec.vocab_max), NUM_SLOTS))
        ).astype(np.int64)
        self.zipf = rng.uniform(spec.zipf_min, spec.zipf_max, NUM_SLOTS)
        self.slot_missing = np.zeros(NUM_SLOTS)
        self.slot_missing[rng.choice(NUM_SLOTS, 6, replace=False)] = rng.uniform(0.2, 0.45, 6)
        self.slot_sigma = rng.uniform(0.2, 0.6, NUM_SLOTS)
        self.slot_sigma[rng.choice(NUM_SLOTS, NUM_SLOTS // 3, replace=False)] = 0.0
        self._cdf = []
        self._effects = []  # per slot: effects of ranks 0..V-1, then of the missing value
        self._values = []  # per slot: the distinct 8-hex strings
        for s in range(NUM_SLOTS):
            weights = (np.arange(self.vocab_sizes[s]) + 1.0) ** -self.zipf[s]
            self._cdf.append(np.cumsum(weights) / weights.sum())
            effects = rng.normal(0.0, self.slot_sigma[s], self.vocab_sizes[s] + 1)
            if spec.tail_rank > 0:
                effects[:-1] /= np.sqrt(1.0 + np.arange(self.vocab_sizes[s]) / spec.tail_rank)
            self._effects.append(effects)
            self._values.append(pa.array(_distinct_hex(rng, int(self.vocab_sizes[s]))))
        self.dense_mu = rng.uniform(0.0, 4.0, NUM_DENSE)
        self.dense_sd = rng.uniform(0.5, 1.5, NUM_DENSE)
        self.dense_missing = np.where(rng.random(NUM_DENSE) < 0.6, rng.uniform(0.0, 0.4, NUM_DENSE), 0.0)
        self.dense_weight = np.zeros(NUM_DENSE)
        informative = rng.choice(NUM_DENSE, 4, replace=False)
        self.dense_weight[informative] = rng.choice([-1.0, 1.0], 4) * rng.uniform(0.3, 0.6, 4)
        self.dense_center = np.log1p(np.exp(self.dense_mu))  # about the median of z
        self.scale, self.bias = 1.0, 0.0
        signal, _, _ = self._features(np.random.default_rng([seed, 1]), _CALIBRATION_ROWS)
        self.scale, self.bias = _calibrate(signal, spec.target_auc, spec.base_ctr)

    def draw(self, rng: np.random.Generator, n: int) -> tuple[pa.Table, np.ndarray]:
        """``n`` raw-form rows with labels drawn, and their true logits."""
        signal, dense, ranks = self._features(rng, n)
        logit = self.bias + self.scale * signal
        label = (rng.random(n) < _sigmoid(logit)).astype(np.int8)
        sparse = [self._values[s].take(rank) for s, rank in enumerate(ranks)]
        table = pa.Table.from_arrays([pa.array(label), *dense, *sparse], schema=RAW_SCHEMA)
        return table, logit

    def _features(
        self, rng: np.random.Generator, n: int
    ) -> tuple[np.ndarray, list[pa.Array], list[pa.Array]]:
        """The signal (logit before scale and bias), the dense columns, the value ranks (null: missing)."""
        signal = np.zeros(n)
        dense = []
        for j in range(NUM_DENSE):
            x = np.floor(np.exp(rng.normal(self.dense_mu[j], self.dense_sd[j], n)))
            missing = rng.random(n) < self.dense_missing[j]
            z = np.where(missing, 0.0, np.log1p(x))
            signal += self.dense_weight[j] * np.tanh(z - self.dense_center[j])
            dense.append(pa.array(x, mask=missing))
        ranks = []
        for s in range(NUM_SLOTS):
            rank = np.minimum(np.searchsorted(self._cdf[s], rng.random(n)), self.vocab_sizes[s] - 1)
            missing = rng.random(n) < self.slot_missing[s]
            signal += self._effects[s][np.where(missing, self.vocab_sizes[s], rank)]
            ranks.append(pa.array(rank, mask=missing))
        return signal, dense, ranks

    def describe(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "spec": asdict(self.spec),
            "scale": self.scale,
            "bias": self.bias,
            "vocab_sizes": self.vocab_sizes.tolist(),
            "zipf_exponents": np.round(self.zipf, 4).tolist(),
            "slot_effect_sigma": np.round(self.slot_sigma, 4).tolist(),
            "slot_missing": np.round(self.slot_missing, 4).tolist(),
            "dense_weight": np.round(self.dense_weight, 4).tolist(),
        }


def synthesize(
    output: str | Path,
    rows: int,
    *,
    seed: int = 0,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    rows_per_part: int = DEFAULT_ROWS_PER_PART,
    spec: SynthSpec = SynthSpec(),
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``rows`` synthetic rows as a dataset directory; returns its meta (with achievable_auc)."""
    if rows < 1:
        raise ConfigError(None, "rows", "a positive integer", rows)
    start = time.perf_counter()
    every = eval_every(eval_fraction)
    truth = HiddenModel(seed, spec)
    eval_logits, eval_labels, ctr_sum = [], [], 0.0
    with DatasetWriter(output, rows_per_part=rows_per_part, eval_every=every, overwrite=overwrite) as writer:
        for chunk, first in enumerate(range(0, rows, _CHUNK_ROWS)):
            n = min(_CHUNK_ROWS, rows - first)
            table, logit = truth.draw(np.random.default_rng([seed, 2, chunk]), n)
            label = table.column("label").to_numpy()
            ctr_sum += float(label.sum())
            if every:
                to_eval = np.arange(first, first + n) % every == every - 1
                eval_logits.append(logit[to_eval])
                eval_labels.append(label[to_eval])
            writer.write(table)
        achievable = _auc(np.concatenate(eval_logits), np.concatenate(eval_labels)) if every else None
        return writer.close(
            {
                "kind": "synthetic",
                "source": "heterps data synth",
                "created_by": "heterps data synth",
                "eval_fraction": eval_fraction,
                "achievable_auc": achievable,
                "expected_auc": spec.target_auc,
                "ctr": ctr_sum / rows,
                "truth": truth.describe(),
                "seconds": round(time.perf_counter() - start, 3),
            }
        )


def _distinct_hex(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` distinct 8-hex strings, like Criteo's hashed categorical values."""
    ids = np.unique(rng.integers(0, 2**32, 2 * n + 16, dtype=np.uint64))
    ids = rng.permutation(ids)[:n]
    return np.char.mod("%08x", ids).astype(object)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _calibrate(signal: np.ndarray, target_auc: float, base_ctr: float) -> tuple[float, float]:
    """(scale, bias) with mean sigmoid(bias + scale*signal) = base_ctr and expected AUC = target."""
    order = np.argsort(signal, kind="stable")
    signal = signal[order]

    def bias_for(scale: float) -> float:
        # Newton on mean(sigmoid(b + scale*signal)) = base_ctr: increasing and smooth in b.
        b = float(np.log(base_ctr / (1 - base_ctr)))
        for _ in range(30):
            p = _sigmoid(b + scale * signal)
            gap = p.mean() - base_ctr
            if abs(gap) < 1e-9:
                break
            b = float(np.clip(b - gap / max(float((p * (1 - p)).mean()), 1e-12), -50.0, 50.0))
        return b

    def expected_auc(scale: float) -> float:
        p = _sigmoid(bias_for(scale) + scale * signal)
        negatives_below = np.cumsum(1.0 - p) - (1.0 - p)  # signal is sorted ascending
        return float((p * negatives_below).sum() / (p.sum() * (1.0 - p).sum()))

    lo, hi = 1e-3, 20.0
    for _ in range(25):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_auc(mid) < target_auc else (lo, mid)
    scale = (lo + hi) / 2
    return scale, bias_for(scale)


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula (ties get their average rank)."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based rank of each distinct score
    positive = labels.astype(bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    rank_sum = float(average_rank[inverse][positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)
