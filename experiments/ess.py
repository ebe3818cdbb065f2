"""When the ESS of the lag ratio crosses a threshold, measured and as a Gaussian (log-normal) model predicts.

If the per-token log lag ratio log w = delta_lag were Gaussian N(mu, s^2), the normalized ESS of
w = exp(delta_lag) over many tokens would be E[w]^2 / E[w^2] = exp(2 mu + s^2) / exp(2 mu + 2 s^2) =
exp(-s^2), whatever mu. It falls below a threshold h when s^2 > -ln h (ln 2 = 0.693 for h = 0.5).

The prediction, exactly:
1. Take the first stale segment of a run: its steps from the start while the lag (trainer steps since the
   sampled version was published, `staleness_steps_max`) keeps growing, i.e. until the first sync.
2. Points (k_t, s^2_t) with k_t >= 1: the lag of step t's batch and the measured variance of delta_lag over
   its tokens (`delta_lag_std`^2, population variance).
3. Fit s^2(k) = a k^p by least squares on (log k, log s^2) (`fit_lag_variance`), with p kept in [1, 2]:
   p = 1 is lag increments that add up like independent steps, p = 2 a drift in a constant direction; a
   fitted p outside that range (a few noisy points) is clamped and a refitted for it. One point: p = 1.
4. k* = (-ln h / a)^(1/p) is the lag at which exp(-s^2(k)) = h; the predicted crossing step is the first
   step whose lag exceeds k*: step(lag 0) + floor(k*) + 1.
`gaussian_direct_cross_step` skips the fit: the first step of the segment with exp(-s^2_t) < h.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "LagVarianceFit",
    "first_segment_length",
    "first_step_below",
    "fit_lag_variance",
    "gaussian_crossing",
    "gaussian_ess",
    "predicted_crossing_lag",
]


def gaussian_ess(log_ratio_variance: float) -> float:
    """exp(-s^2): the normalized ESS of a log-normal ratio whose log has variance s^2."""
    if log_ratio_variance < 0:
        raise ValueError(f"a variance must be >= 0, got {log_ratio_variance}")
    return math.exp(-log_ratio_variance)


def first_step_below(steps: Sequence[int], values: Sequence[float | None], threshold: float) -> int | None:
    """The first step whose value is below `threshold` (None/NaN values are skipped), or None."""
    if len(steps) != len(values):
        raise ValueError(f"{len(steps)} steps for {len(values)} values")
    for step, value in zip(steps, values, strict=True):
        if value is not None and not math.isnan(value) and value < threshold:
            return int(step)
    return None


def first_segment_length(lags: Sequence[int]) -> int:
    """Number of leading steps before the lag first stops growing (the first sync resets it)."""
    for i in range(1, len(lags)):
        if lags[i] <= lags[i - 1]:
            return i
    return len(lags)


@dataclass(frozen=True)
class LagVarianceFit:
    """s^2(k) = scale * k ** exponent, fitted on `num_points` (lag, variance) points."""

    scale: float
    exponent: float
    num_points: int

    def variance(self, lag: float) -> float:
        return self.scale * lag**self.exponent


def fit_lag_variance(
    lags: Sequence[float], variances: Sequence[float], *, exponent_range: tuple[float, float] = (1.0, 2.0)
) -> LagVarianceFit | None:
    """Least-squares fit of log s^2 = log a + p log k over points with k >= 1 and s^2 > 0, p in `exponent_range`.

    A fitted p outside the range is clamped to it and log a refitted (the mean of log s^2 - p log k). One
    usable point (or one distinct lag) fixes p = 1 (clamped to the range); no usable point returns None.
    """
    if len(lags) != len(variances):
        raise ValueError(f"{len(lags)} lags for {len(variances)} variances")
    low, high = exponent_range
    if not 0 < low <= high:
        raise ValueError(f"exponent_range must satisfy 0 < low <= high, got {exponent_range}")
    points = [(math.log(k), math.log(v)) for k, v in zip(lags, variances, strict=True) if k >= 1 and v > 0]
    if not points:
        return None
    xs, ys = zip(*points, strict=True)
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    exponent = 1.0 if spread == 0 else sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    exponent = min(max(exponent, low), high)
    log_scale = mean_y - exponent * mean_x
    return LagVarianceFit(scale=math.exp(log_scale), exponent=exponent, num_points=len(points))


def predicted_crossing_lag(fit: LagVarianceFit, threshold: float) -> float | None:
    """The lag k* at which exp(-a k*^p) = threshold, or None when the fitted variance does not grow."""
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    if fit.scale <= 0 or fit.exponent <= 0:
        return None
    return (-math.log(threshold) / fit.scale) ** (1.0 / fit.exponent)


@dataclass(frozen=True)
class GaussianCrossing:
    fit: LagVarianceFit | None
    crossing_lag: float | None
    """k* of the fit (None without a fit or a growing variance)."""
    predicted_step: int | None
    """First step whose lag exceeds k* (may lie beyond the run)."""
    direct_step: int | None
    """First step of the first segment with exp(-s^2_t) < threshold."""


def gaussian_crossing(
    *, steps: Sequence[int], lags: Sequence[int], lag_stds: Sequence[float], threshold: float
) -> GaussianCrossing:
    """The Gaussian model's crossing of `threshold` for one run (see the module docstring)."""
    if not (len(steps) == len(lags) == len(lag_stds)):
        raise ValueError("steps, lags and lag_stds must have the same length")
    length = first_segment_length(lags)
    seg_steps, seg_lags, seg_vars = steps[:length], lags[:length], [s * s for s in lag_stds[:length]]
    direct = first_step_below(seg_steps, [gaussian_ess(v) for v in seg_vars], threshold)
    fit = fit_lag_variance(seg_lags, seg_vars)
    crossing_lag = predicted_crossing_lag(fit, threshold) if fit is not None else None
    predicted = None
    if crossing_lag is not None and seg_steps:
        start_step = seg_steps[0] - seg_lags[0]  # the step whose batch has lag 0
        predicted = int(start_step + math.floor(crossing_lag) + 1)
    return GaussianCrossing(fit=fit, crossing_lag=crossing_lag, predicted_step=predicted, direct_step=direct)
