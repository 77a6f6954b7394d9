"""Cell-means models with a pooled seed variance: the estimates, 95% intervals and t tests behind
the claims' verdicts and the headline's bars.

A *cell* is one configuration (an architecture at a shape, say); each of its runs (seeds) gives
one value y of a quantity. The model is y_cs = mu_c + e_cs with independent normal errors whose
variance belongs to the cell's group (its architecture): one seed-to-seed variance shared by
many cells, so that 18 cells of two seeds give 18 degrees of freedom instead of one each.

- **Pooling** (`pool`): s^2 = sum_c sum_s (y_cs - ybar_c)^2 / sum_c (n_c - 1) over the cells of
  two or more seeds. A group (architecture) whose own cells give at least `MIN_GROUP_DF` degrees
  of freedom keeps its own variance; every other group uses the variance pooled over the whole
  model (every cell of every group). `Pool.scope` says which ("architecture" or "grid").
  Whether the cells' spreads are compatible with one variance is checked by Bartlett's test
  (scipy.stats.bartlett) over the cells with a non-zero spread (`Pool.bartlett_p`; cells whose
  seeds agree exactly, as a count may, cannot enter it and are counted in `Pool.tied`). Where
  it rejects one variance for the grid at 5%, every architecture uses its own (fewer degrees of
  freedom, but no architecture's noise is lent to another's cells); one without any keeps the
  grid's.
- **Contrasts** (depthbench.analysis.cell_model.CellModel.contrast): a claim's effect is a
  linear combination theta = sum_c k_c mu_c of cell means: a difference of two cells, or the
  least-squares slope of the values on a covariate over every run of some cells
  (`CellModel.slope`, the slope scipy.stats.linregress fits through the runs). Its estimate is
  sum_c k_c ybar_c, its variance sum_c k_c^2 s^2_g(c) / n_c, its degrees of freedom the pool's
  (Welch-Satterthwaite where the cells draw on different pools), its test the two-sided t
  test of theta = 0 (scipy.stats.t) and its interval theta_hat +- t(0.975, df) se.
- **No seed variance** (one seed in every cell: df 0): where each cell's single run carries its
  own 95% bootstrap interval (a probe or NLL row's ci_low / ci_high, over probe sequences or
  documents) the contrast takes se_c = (high - low) / (2 z(0.975)) and a z test (df = inf);
  otherwise it has no test (p NaN). A pool of variance zero (every seed of every cell agrees,
  as a layer count may) takes the runs' bootstrap intervals the same way where they have them;
  otherwise the comparison is exact, as the t test's limit at zero spread is (p 0 for a
  non-zero difference, 1 for none), and says so ("exact: identical in every seed").
- **Ranges** (`bounds`): a quantity that lives in [lo, hi] (a share in [0, 1], a layer count in
  [0, L], a rank in [1, n]) gets each cell's interval intersected with its range, and a
  contrast's with the range the contrast can take (a difference of two shares: [-1, 1]). The
  true value lies in the range, so the intersection covers it whenever the interval does: the
  coverage stays 95% and no bound leaves the range. A cell whose seeds all gave the same value
  says so (`Estimate.identical`) rather than showing a width-zero interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable

import numpy as np

from depthbench.analysis.intervals import t_quantile

ALPHA = 0.05  # the level of every test
MIN_GROUP_DF = 10  # an architecture's own variance needs this many degrees of freedom
Z975 = 1.959963984540054  # the normal 97.5% quantile: a bootstrap interval's half-width in se


@dataclass(frozen=True)
class Pool:
    """A pooled seed variance: `variance` with `df` degrees of freedom from `cells` cells;
    `scope` "architecture" (the group's own) or "grid" (every cell of the model); Bartlett's p
    over the cells with a non-zero spread, and how many cells had none (`tied`)."""

    variance: float
    df: int
    scope: str
    cells: int
    tied: int = 0
    spread: tuple = field(default=(), repr=False, compare=False)  # the cells Bartlett's test reads

    @property
    def bartlett_p(self) -> float:
        if len(self.spread) < 2:
            return math.nan
        from scipy import stats

        return float(stats.bartlett(*self.spread).pvalue)

    @property
    def sd(self) -> float:
        return math.sqrt(self.variance) if self.df > 0 else math.nan

    def text(self) -> str:
        if self.df == 0:
            return "no seed variance (one seed per cell)"
        p = self.bartlett_p
        check = f"; Bartlett p = {p:.2g} over {self.cells - self.tied} cells" if p == p else ""
        ties = f", {self.tied} with identical seeds" if self.tied else ""
        pooled = f"pooled over {self.cells} cells ({self.scope}{ties}), {self.df} df"
        return f"seed SD {self.sd:.3g} {pooled}{check}"


def pool_of_cells(groups: list[np.ndarray], scope: str) -> Pool:
    several = [g for g in groups if g.size >= 2]
    df = int(sum(g.size - 1 for g in several))
    if df == 0:
        return Pool(math.nan, 0, scope, len(groups))
    ss = float(sum(((g - g.mean()) ** 2).sum() for g in several))
    spread = tuple(g for g in several if np.ptp(g) > 0)
    return Pool(ss / df, df, scope, len(several), len(several) - len(spread), spread)


def pool(
    values: dict[Hashable, np.ndarray],
    group_of: Callable[[Hashable], str],
    min_df: int = MIN_GROUP_DF,
) -> dict[str, Pool]:
    """{group: Pool} for cells `values` ({cell: its runs' values}): a group's own variance where
    its cells give `min_df` degrees of freedom or more, or where Bartlett's test rejects one
    variance for the grid at 5% (and the group has any), else the grid's (the module
    docstring)."""
    by_group: dict[str, list[np.ndarray]] = {}
    for k, v in values.items():
        by_group.setdefault(group_of(k), []).append(v)
    grid = pool_of_cells(list(values.values()), "grid")
    if len(by_group) == 1:
        return {g: grid for g in by_group}
    split = grid.bartlett_p < ALPHA  # NaN (no check possible) is not a rejection
    out = {}
    for g, vs in by_group.items():
        own = pool_of_cells(vs, "architecture")
        out[g] = own if own.df >= min_df or (split and own.df > 0) else grid
    return out


@dataclass(frozen=True)
class Test:
    """A contrast's estimate, standard error, degrees of freedom, 95% interval (within the
    contrast's range), two-sided p-value and how it was tested."""

    estimate: float
    se: float
    df: float
    low: float
    high: float
    p: float
    method: str

    @property
    def tested(self) -> bool:
        return self.p == self.p

    def text(self, digits: int = 3) -> str:
        if self.se == 0 and self.method.startswith("exact"):
            return f"{self.estimate:.{digits}g} ({self.method})"
        if not self.tested:
            return f"{self.estimate:.{digits}g} (no test: {self.method})"
        df = "inf" if math.isinf(self.df) else f"{self.df:.3g}"
        return (
            f"{self.estimate:.{digits}g} [{self.low:.{digits}g}, {self.high:.{digits}g}], "
            f"df {df}, p = {self.p:.2g}"
        )


def exact_test(estimate: float) -> Test:
    """A difference of analytic numbers: no sampling error; p 0 unless they are equal."""
    return Test(
        estimate, 0.0, math.inf, estimate, estimate, float(estimate == 0), "exact (analytic)"
    )


def t_test(estimate: float, se: float, df: float, bounds=(-math.inf, math.inf), method="") -> Test:
    """The two-sided t test of a contrast (z where df is infinite) and its 95% interval, within
    `bounds`. No test (p NaN) where se is NaN or zero, or df is zero."""
    if not (se == se and se > 0 and df > 0):
        why = (
            "no seed variance" if se == se and se == 0 else method or "no variance to test against"
        )
        return Test(estimate, se, df, math.nan, math.nan, math.nan, why)
    from scipy import stats

    half = t_quantile(df) * se
    p = float(2 * stats.t.sf(abs(estimate) / se, df))
    low, high = max(estimate - half, bounds[0]), min(estimate + half, bounds[1])
    return Test(estimate, se, df, low, high, p, method)


def satterthwaite(parts: list[tuple[float, float]]) -> float:
    """Degrees of freedom of a sum of independent variance estimates (value, df; a known
    variance has df = inf)."""
    total = sum(v for v, _ in parts)
    denom = sum(v * v / d for v, d in parts if 0 < d < math.inf and v > 0)
    return total * total / denom if denom > 0 else math.inf
