"""The line fits behind a profile's coefficients (``y = intercept + slope · x`` by least squares), the
parallel fraction from a 2-replica speedup, and the row of the fit-quality table each fit becomes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from heterps_ray.errors import DataError

R2_POOR = 0.9  # below this a fit is flagged as poor (issue 5)


@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope · x`` by least squares, with its quality."""

    intercept: float
    slope: float
    r2: float
    residuals: tuple[float, ...]  # y - fitted, at each x (same order as the input points)
    x: tuple[float, ...]
    y: tuple[float, ...]

    @property
    def max_rel_residual(self) -> float:
        """Largest |residual| / y over the points: how far off the line the worst point is."""
        y = np.asarray(self.y)
        return float(np.max(np.abs(self.residuals) / np.maximum(np.abs(y), 1e-12))) if len(y) else 0.0

    @property
    def negative(self) -> bool:
        return self.intercept < 0 or self.slope < 0


def fit_line(x: Sequence[float], y: Sequence[float]) -> LinearFit:
    """Ordinary least squares of y on x; R² is 1 - SS_res / SS_tot (1.0 when y is constant and fit)."""
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    if len(xs) < 2 or len(np.unique(xs)) < 2:
        raise DataError(f"a line needs at least two distinct x values (got {xs.tolist()})")
    design = np.stack([np.ones_like(xs), xs], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design, ys, rcond=None)
    fitted = intercept + slope * xs
    residuals = ys - fitted
    ss_res = float(np.sum(residuals**2))
    ss_tot = float(np.sum((ys - ys.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res < 1e-18 else 0.0)
    return LinearFit(
        float(intercept), float(slope), r2, tuple(residuals.tolist()), tuple(xs.tolist()), tuple(ys.tolist())
    )


def clamp_non_negative(fit: LinearFit) -> tuple[float, float]:
    """Coefficients usable in a problem file: a negative one is set to 0 and the other refitted
    (the fit stays flagged; this only keeps the cost model physical)."""
    if not fit.negative:
        return fit.intercept, fit.slope
    x, y = np.asarray(fit.x), np.asarray(fit.y)
    slope_through_origin = float(np.dot(x, y) / np.dot(x, x))
    if fit.intercept < 0 and slope_through_origin >= 0:
        return 0.0, slope_through_origin
    return max(float(np.mean(y)), 0.0), 0.0


def parallel_fraction(speedup: float) -> float:
    """Amdahl's parallel fraction from the speedup of 2 replicas over 1, clipped to [0, 1]:
    ``s = 1 / ((1-α) + α/2)``  ⇒  ``α = (1 - 1/s) / (1 - 1/2)``."""
    if speedup <= 0:
        return 0.0
    return float(min(max((1.0 - 1.0 / speedup) / 0.5, 0.0), 1.0))


def quality_row(
    what: str, layer: str, resource: str, fit: LinearFit, a: float, b: float, unit: str
) -> dict[str, Any]:
    problems = []
    if fit.r2 < R2_POOR:
        problems.append(f"R² {fit.r2:.3f} < {R2_POOR}")
    if fit.negative:
        problems.append(
            f"negative coefficient ({fit.intercept:.4g}, {fit.slope:.4g}) clamped to ({a:.4g}, {b:.4g})"
        )
    return {
        "what": what,
        "layer": layer,
        "resource": resource,
        "r2": fit.r2,
        "fixed_ms": a,
        "slope_ms": b,
        "slope_per": unit,
        "raw_intercept": fit.intercept,
        "raw_slope": fit.slope,
        "max_rel_residual": fit.max_rel_residual,
        "residuals_ms": " ".join(f"{r:+.4f}" for r in fit.residuals),
        "flags": "; ".join(problems),
    }


def round6(value: float) -> float:
    """Six significant digits keep the YAML readable without losing anything measurable."""
    return float(f"{value:.6g}")
