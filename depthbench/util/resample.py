"""Bootstrap resampling of the units a number is pooled over (probe sequences, NLL documents),
for the stages that write a 95% interval beside each number.

A number of the whole sample (a mean over units, a ratio of two sums, a share of such ratios
above a threshold) is recomputed on each of B resamples of the units, drawn with replacement;
its interval is the 2.5% and 97.5% quantiles of the B values (the percentile interval). A
resample is given by its counts, counts[b, i] = how often unit i was drawn in resample b, so a
resampled sum is counts @ x and a number that is a function of per-unit sums needs no second
pass over the data. The draws are numpy's default_rng(seed).integers(0, n, (B, n)).
depthbench.analysis.intervals.bootstrap_mean resamples through these functions too, so a mean's
interval there is the one a stage's table holds for the same values and seed.
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
SAMPLES = 1000


def resample_counts(n: int, seed: int, samples: int = SAMPLES) -> np.ndarray:
    """(samples, n) float64: how often each of the n units is drawn in each resample. With fewer
    than 2 units there is no spread to resample: (0, n), and every interval from it is NaN."""
    if n < 2:
        return np.zeros((0, max(n, 0)))
    draws = np.random.default_rng(seed).integers(0, n, size=(samples, n))
    rows = np.arange(samples)[:, None] * n
    counts = np.bincount((rows + draws).ravel(), minlength=samples * n)
    return counts.reshape(samples, n).astype(np.float64)


def resampled_sums(values, counts: np.ndarray) -> np.ndarray:
    """(..., B): the sum of `values` (..., n), one value per unit on the last axis, over each
    resample (NaN stays NaN)."""
    return np.asarray(values, dtype=np.float64) @ counts.T


def percentile_interval(stats, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """The 2.5% and 97.5% quantiles of resampled values along `axis` (the resamples' axis); NaN
    where there are no resamples or a resampled value is NaN (an undefined matrix entry)."""
    stats = np.asarray(stats, dtype=np.float64)
    if stats.shape[axis] == 0:
        shape = np.delete(np.array(stats.shape), axis % stats.ndim)
        return np.full(tuple(shape), np.nan), np.full(tuple(shape), np.nan)
    low, high = np.quantile(stats, [(1 - LEVEL) / 2, (1 + LEVEL) / 2], axis=axis)
    return low, high
