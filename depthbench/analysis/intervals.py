"""95% intervals for the numbers a figure compares or a claim reads, and the comparison of two.

Two sources of uncertainty, as the tables carry them:
- within a run, a seeded bootstrap over the units a number averages (probe sequences, NLL
  documents): `bootstrap_mean` resamples the units with replacement B times and takes the 2.5%
  and 97.5% quantiles of the resampled means (the percentile interval);
- over seeds, where a cell has n >= 2 of them: the t interval mean +- t(0.975, n-1) s / sqrt(n)
  of the per-seed values (`seed_interval`). A seed's value already carries its own sampling
  noise, so with several seeds their spread is the cell's interval; with one seed, the cell
  keeps that run's bootstrap interval (`cell_interval`) and says so through n = 1.

The bootstrap's generator is seeded from the caller's seed, so a table is the same bit for bit
on every rerun.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# the stages' resampling and resample count, so that a table's interval and one computed here agree
from depthbench.util.resample import SAMPLES as BOOTSTRAP_SAMPLES
from depthbench.util.resample import percentile_interval, resample_counts, resampled_sums

# t(0.975, df) for df = 1..30; above 30 the normal quantile is within 2% of it.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with df degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.959964


@dataclass(frozen=True)
class Estimate:
    """A number with its 95% interval and the count of seeds behind it (NaN bounds: no interval)."""

    value: float
    low: float = math.nan
    high: float = math.nan
    n: int = 1

    @property
    def has_interval(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))

    def text(self, digits: int = 3) -> str:
        if not self.has_interval:
            return f"{self.value:.{digits}g} (n={self.n}, no interval)"
        return (
            f"{self.value:.{digits}g} [{self.low:.{digits}g}, {self.high:.{digits}g}] (n={self.n})"
        )


def bootstrap_mean(values, seed: int, samples: int = BOOTSTRAP_SAMPLES) -> Estimate:
    """The mean of `values` (one per unit) with its percentile bootstrap interval."""
    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return Estimate(math.nan)
    if x.size == 1:
        return Estimate(float(x[0]))
    # the stages' resampling (util.resample), so that this interval is the one a table holds
    low, high = percentile_interval(
        resampled_sums(x, resample_counts(x.size, seed, samples)) / x.size
    )
    return Estimate(float(x.mean()), float(low), float(high))


def seed_interval(values) -> Estimate:
    """Mean of per-seed values with the t interval; n = 1 gives no interval."""
    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return Estimate(math.nan, n=0)
    if x.size == 1:
        return Estimate(float(x[0]), n=1)
    half = t975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    mean = float(x.mean())
    return Estimate(mean, mean - half, mean + half, n=int(x.size))


def cell_interval(values, lows=None, highs=None) -> Estimate:
    """A cell's estimate from its seeds' values: the t interval over seeds when there are several,
    otherwise the single run's own (bootstrap) interval, given as `lows`/`highs`."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if np.isfinite(x).sum() >= 2:
        return seed_interval(x)
    keep = np.flatnonzero(np.isfinite(x))
    if keep.size == 0:
        return Estimate(math.nan, n=0)
    i = int(keep[0])
    low = math.nan if lows is None else float(np.asarray(lows, dtype=np.float64).ravel()[i])
    high = math.nan if highs is None else float(np.asarray(highs, dtype=np.float64).ravel()[i])
    return Estimate(float(x[i]), low, high, n=1)


def separated(a: Estimate, b: Estimate) -> int:
    """+1 when a's interval lies wholly above b's, -1 wholly below, 0 when they overlap or either
    has no interval (then no difference can be seen)."""
    if not (a.has_interval and b.has_interval):
        return 0
    if a.low > b.high:
        return 1
    if a.high < b.low:
        return -1
    return 0
