"""95% intervals for the numbers a figure compares or a claim reads.

Two sources of uncertainty, as the tables carry them:
- within a run, a seeded bootstrap over the units a number averages (probe sequences, NLL
  documents): `bootstrap_mean` resamples the units with replacement B times and takes the 2.5%
  and 97.5% quantiles of the resampled means (the percentile interval);
- over seeds, where a cell has n >= 2 of them: the t interval mean +- t(0.975, n-1) s / sqrt(n)
  of the per-seed values (`seed_interval`), which the figures other than the headline draw;
  with one seed, the cell keeps that run's bootstrap interval (`cell_interval`) and says so
  through n = 1. The claims and the headline pool the seed variance over many cells instead
  (depthbench.analysis.stats).

Student's t quantiles come from scipy.stats. The bootstrap's generator is seeded from the
caller's seed, so a table is the same bit for bit on every rerun.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# the stages' resampling and resample count, so that a table's interval and one computed here agree
from depthbench.util.resample import SAMPLES as BOOTSTRAP_SAMPLES
from depthbench.util.resample import percentile_interval, resample_counts, resampled_sums


def t_quantile(df: float, level: float = 0.95) -> float:
    """The two-sided `level` quantile of Student's t with df degrees of freedom (scipy.stats;
    the normal quantile for df = inf)."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    from scipy import stats

    q = 0.5 + level / 2
    return float(stats.norm.ppf(q) if math.isinf(df) else stats.t.ppf(q, df))


@dataclass(frozen=True)
class Estimate:
    """A number with its 95% interval and the count of seeds behind it (NaN bounds: no interval);
    `df` the degrees of freedom of the variance behind the interval, `identical` whether its n
    seeds all gave the same value (a count often does), which its text says."""

    value: float
    low: float = math.nan
    high: float = math.nan
    n: int = 1
    df: float = math.nan
    identical: bool = False

    @property
    def has_interval(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))

    def text(self, digits: int = 3) -> str:
        same = f", identical in all {self.n} seeds" if self.identical else ""
        if not self.has_interval or self.low == self.high:  # no width: no interval to show
            return f"{self.value:.{digits}g} (n={self.n}{same or ', no interval'})"
        return (
            f"{self.value:.{digits}g} [{self.low:.{digits}g}, {self.high:.{digits}g}] "
            f"(n={self.n}{same})"
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
    half = t_quantile(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    mean = float(x.mean())
    same = bool(np.ptp(x) == 0)
    return Estimate(mean, mean - half, mean + half, int(x.size), x.size - 1, same)


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
