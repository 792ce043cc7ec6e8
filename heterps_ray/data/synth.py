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

Shapes (``heterps data synth --shape``): ``default`` is the above. ``criteo-kaggle`` gives slot
``s`` the number of distinct values Criteo Kaggle has over its 45,840,617 rows
(:data:`CRITEO_KAGGLE_DISTINCT`, 33.8M in all): its ranks follow the continuous power law of
density ``x ** -a_s`` on ``[1, V_s + 1)`` (rank ``floor(x) - 1``, ``a_s`` in [0.8, 0.95]: tails
heavy enough that, as in Criteo, most values are rare), and ``V_s`` is solved so that the expected
number of distinct values in 45.8M rows equals Criteo's count. A smaller draw sees fewer values, as
a part of Criteo would. Values and their effects are computed from the rank (a hash), not stored,
so a 30M-value vocabulary costs no memory: value = 8 hex digits of ``(rank * m_s + c_s) mod 2^32``
(``m_s`` odd: distinct ranks give distinct values), effect = ``sigma_s`` times a normal drawn from
``splitmix64(rank XOR salt_s)``, shrunk as above.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from heterps_ray.data import DEFAULT_EVAL_FRACTION, DEFAULT_ROWS_PER_PART
from heterps_ray.data.criteo import NUM_DENSE, NUM_SLOTS, RAW_SCHEMA, splitmix64
from heterps_ray.data.writer import DatasetWriter, eval_every
from heterps_ray.errors import ConfigError

# Criteo Kaggle (Display Advertising Challenge, 2014): distinct values of each categorical slot
# C1..C26 over its 45,840,617 training rows, as published with DLRM's Kaggle preprocessing
# (facebookresearch/dlrm, the per-slot counts of the processed day) and repeated by TorchRec and
# many papers' embedding-table sizes; 33,762,577 in all.
CRITEO_KAGGLE_ROWS = 45_840_617
CRITEO_KAGGLE_DISTINCT = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

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
    distinct_values: tuple[int, ...] | None = None
    """per slot: distinct values expected in `reference_rows` rows (None: vocab_min..vocab_max)"""
    reference_rows: int = CRITEO_KAGGLE_ROWS
    """the row count `distinct_values` are counted over"""

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
        if self.distinct_values is not None and (
            len(self.distinct_values) != NUM_SLOTS or min(self.distinct_values) < 1
        ):
            raise ConfigError(None, "distinct_values", f"{NUM_SLOTS} positive counts", self.distinct_values)


# Shapes of `heterps data synth --shape`: SynthSpec fields (target_auc and base_ctr come from flags).
SHAPES: dict[str, dict[str, Any]] = {
    "default": {},
    "criteo-kaggle": {"distinct_values": CRITEO_KAGGLE_DISTINCT, "zipf_min": 0.8, "zipf_max": 0.95},
}


class HiddenModel:
    """The truth behind a synthetic dataset: draws rows and their click probabilities."""

    def __init__(self, seed: int, spec: SynthSpec = SynthSpec()):
        spec.check()
        self.seed, self.spec = seed, spec
        rng = np.random.default_rng([seed, 0])
        self.computed = spec.distinct_values is not None  # values and effects from the rank
        if not self.computed:
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
        if self.computed:
            assert spec.distinct_values is not None
            self.vocab_sizes = np.array(
                [
                    vocab_for_distinct(target, a, spec.reference_rows * (1.0 - missing))
                    for target, a, missing in zip(
                        spec.distinct_values, self.zipf, self.slot_missing, strict=True
                    )
                ],
                dtype=np.int64,
            )
            self._salt = rng.integers(0, 2**63, NUM_SLOTS, dtype=np.int64).view(np.uint64)
            self._multiplier = rng.integers(0, 2**31, NUM_SLOTS, dtype=np.int64) * 2 + 1  # odd
            self._offset = rng.integers(0, 2**32, NUM_SLOTS, dtype=np.int64)
            self._missing_effect = rng.normal(0.0, 1.0, NUM_SLOTS) * self.slot_sigma
        for s in range(NUM_SLOTS if not self.computed else 0):
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
        if self.computed:
            sparse = [self._value_strings(s, rank) for s, rank in enumerate(ranks)]
        else:
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
            if self.computed:
                rank = power_law_ranks(rng.random(n), int(self.vocab_sizes[s]), float(self.zipf[s]))
                missing = rng.random(n) < self.slot_missing[s]
                signal += np.where(missing, self._missing_effect[s], self._computed_effects(s, rank))
            else:
                rank = np.minimum(np.searchsorted(self._cdf[s], rng.random(n)), self.vocab_sizes[s] - 1)
                missing = rng.random(n) < self.slot_missing[s]
                signal += self._effects[s][np.where(missing, self.vocab_sizes[s], rank)]
            ranks.append(pa.array(rank, mask=missing))
        return signal, dense, ranks

    def _computed_effects(self, s: int, rank: np.ndarray) -> np.ndarray:
        """Effects of ranks of slot `s` from a hash of the rank (Box-Muller on two hashed uniforms)."""
        h1 = splitmix64(rank.astype(np.uint64) ^ self._salt[s])
        h2 = splitmix64(h1)
        u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        u2 = (h2 >> np.uint64(11)).astype(np.float64) * 2.0**-53
        effect = self.slot_sigma[s] * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        if self.spec.tail_rank > 0:
            effect /= np.sqrt(1.0 + rank / self.spec.tail_rank)
        return effect

    def _value_strings(self, s: int, rank: pa.Array) -> pa.Array:
        """The 8-hex value of each rank of slot `s` (null where the rank is null)."""
        r = pc.fill_null(rank, 0).to_numpy().astype(np.uint64)
        v = (r * np.uint64(self._multiplier[s]) + np.uint64(self._offset[s])) & np.uint64(0xFFFFFFFF)
        digits = (v[:, None] >> np.arange(28, -1, -4, dtype=np.uint64)[None, :]) & np.uint64(15)
        data = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)[digits.astype(np.intp)]
        offsets = np.arange(0, 8 * len(r) + 1, 8, dtype=np.int32)
        validity = rank.buffers()[0] if rank.null_count else None
        return pa.Array.from_buffers(
            pa.string(),
            len(r),
            [validity, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(data))],
            null_count=rank.null_count,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "spec": asdict(self.spec),
            "scale": self.scale,
            "bias": self.bias,
            "vocab_sizes": self.vocab_sizes.tolist(),
            **(
                {
                    "expected_distinct_at_reference_rows": [
                        round(expected_distinct(int(v), float(a), self.spec.reference_rows * (1.0 - m)))
                        for v, a, m in zip(self.vocab_sizes, self.zipf, self.slot_missing, strict=True)
                    ]
                }
                if self.computed
                else {}
            ),
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


def power_law_ranks(u: np.ndarray, vocab: int, a: float) -> np.ndarray:
    """Ranks in [0, vocab) for uniforms `u`: ``floor(x) - 1`` with x of density ``x ** -a`` on
    [1, vocab + 1) (inverse CDF)."""
    b = 1.0 - a
    if abs(b) < 1e-9:
        x = (vocab + 1.0) ** u
    else:
        x = (1.0 + u * ((vocab + 1.0) ** b - 1.0)) ** (1.0 / b)
    return np.minimum(np.floor(x).astype(np.int64) - 1, vocab - 1)


def expected_distinct(vocab: int, a: float, rows: float) -> float:
    """Expected distinct ranks among `rows` draws of :func:`power_law_ranks`: the sum over ranks of
    ``1 - (1 - p_r) ** rows``, exact for the first 65,536 ranks, a log-grid integral beyond."""
    b = 1.0 - a

    def cdf(x: np.ndarray | float) -> Any:  # unnormalised
        return np.log(x) if abs(b) < 1e-9 else (np.power(x, b) - 1.0) / b

    total = float(cdf(vocab + 1.0))
    head = min(vocab, 1 << 16)
    r = np.arange(head, dtype=np.float64)
    p = np.minimum((cdf(r + 2.0) - cdf(r + 1.0)) / total, 1.0 - 1e-16)
    seen = float(np.sum(-np.expm1(rows * np.log1p(-p))))
    if vocab > head:
        x = np.geomspace(head + 1.0, vocab + 1.0, 2049)
        seen += float(np.trapezoid(-np.expm1(-rows * np.power(x, -a) / total), x))
    return seen


def vocab_for_distinct(target: int, a: float, rows: float) -> int:
    """The vocabulary whose :func:`expected_distinct` in `rows` draws is `target` (bisection on its
    log; at most 1000x the target, where a tail this light cannot reach the target)."""
    if expected_distinct(target, a, rows) >= target - 0.5:
        return int(target)
    lo, hi = float(target), 1000.0 * target
    for _ in range(25):  # to a factor 1000 ** 2 ** -25 = 1 + 2e-7
        mid = float(np.sqrt(lo * hi))
        lo, hi = (mid, hi) if expected_distinct(int(mid), a, rows) < target else (lo, mid)
    return int(round(hi))


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
