"""The cell-means model of one quantity (`CellModel`): its cells' means, their 95% intervals and
the tests of contrasts between them, with the seed variance pooled over the cells as
depthbench.analysis.stats describes."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from depthbench.analysis.intervals import Estimate, t_quantile
from depthbench.analysis.stats import ALPHA, MIN_GROUP_DF, Z975, Pool, Test, pool, pool_of_cells
from depthbench.analysis.stats import satterthwaite, t_test


class CellModel:
    """One quantity's cell means and pooled seed variance, from one row per run.

    `rows` has the `keys` columns (a cell is one combination of them), the run's `value` and,
    optionally, its own bootstrap interval `ci_low` / `ci_high`. The cells' group (whose
    variance they share) is their `group` column where `keys` has it (the architecture), else
    one group for all. `bounds` is the quantity's range: (lo, hi), or a function of the cell's
    key giving it (a layer count's [0, L]). `extra` ({cell: variance}) is a variance a cell's
    mean has beside its seeds' (the LR choice's, depthbench.analysis.best_loss), known (df
    inf); `pool_cells` limits the pooled variance to those cells (all by default)."""

    def __init__(self, rows: pd.DataFrame, keys: list[str], value: str = "value", bounds=None,
                 group: str = "arch", min_df: int = MIN_GROUP_DF, extra=None,
                 pool_cells=None):  # fmt: skip
        self.keys = list(keys)
        self._bounds = bounds
        self.values: dict = {}
        self.boot: dict = {}
        at = self.keys.index(group) if group in self.keys else None
        self._group = (
            (lambda k: str(k[at] if len(self.keys) > 1 else k))
            if at is not None
            else (lambda k: "all")
        )
        if len(rows):
            y = rows[value].to_numpy(float)
            keep = np.isfinite(y)
            ids = zip(*(rows[k].to_numpy()[keep] for k in self.keys))
            lists: dict = {}
            for i, key in zip(np.flatnonzero(keep), ids):
                lists.setdefault(key if len(self.keys) > 1 else key[0], []).append(i)
            ci = [rows[c].to_numpy(float) for c in ("ci_low", "ci_high") if c in rows.columns]
            for key in sorted(lists):
                self.values[key] = y[lists[key]]
                if len(ci) == 2:
                    first = lists[key][0]
                    self.boot[key] = (float(ci[0][first]), float(ci[1][first]))
        pooled = {k: v for k, v in self.values.items() if pool_cells is None or k in pool_cells}
        self.pools = pool(pooled, self._group, min_df)
        missing = {self._group(k) for k in self.values} - set(self.pools)
        if missing:  # a group none of whose cells is pooled takes the pooled cells' variance
            grid = pool_of_cells(list(pooled.values()), "grid")
            self.pools.update({g: grid for g in missing})
        # a variance each cell's mean has beside its seeds' (the LR choice's: best_loss)
        self.extra = {k: float((extra or {}).get(k, 0.0)) for k in self.values}

    def __contains__(self, key) -> bool:
        return key in self.values

    def __iter__(self):
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def bounds(self, key) -> tuple[float, float]:
        b = self._bounds(key) if callable(self._bounds) else self._bounds
        return (-math.inf, math.inf) if b is None else (float(b[0]), float(b[1]))

    def pool_of(self, key) -> Pool:
        return self.pools[self._group(key)]

    def pool_text(self) -> str:
        """The variance the model's tests use: the grid's, or each architecture's."""
        unique = {id(p): p for p in self.pools.values()}
        if len(unique) == 1:
            return next(iter(unique.values())).text()
        every = pool_of_cells(list(self.values.values()), "grid")
        why = (
            f"Bartlett p = {every.bartlett_p:.2g} rejects one variance for the {every.cells} cells"
        )
        why = why if every.bartlett_p < ALPHA else f"{MIN_GROUP_DF}+ df"
        return f"per architecture ({why}): " + "; ".join(
            f"{g}: {p.text()}" for g, p in sorted(self.pools.items())
        )

    def _single_se(self, key) -> float:
        low, high = self.boot.get(key, (math.nan, math.nan))
        return (high - low) / (2 * Z975) if high == high and low == low else math.nan

    def cell(self, key) -> Estimate:
        """The cell's mean with its 95% interval from the pooled variance (within the range)."""
        x = self.values[key]
        n, mean = int(x.size), float(x.mean())
        identical = n >= 2 and bool(np.ptp(x) == 0)
        p = self.pool_of(key)
        se, df = self._single_se(key), math.inf
        if p.df > 0 and p.variance + self.extra[key] > 0:
            v, tau = p.variance / n, self.extra[key]
            se, df = math.sqrt(v + tau), satterthwaite([(v, p.df), (tau, math.inf)])
        lo, hi = self.bounds(key)
        if not (se == se and se > 0):
            return Estimate(mean, n=n, df=df if se == se else math.nan, identical=identical)
        half = t_quantile(df) * se
        return Estimate(mean, max(mean - half, lo), min(mean + half, hi), n, df, identical)

    def __getitem__(self, key) -> Estimate:
        return self.cell(key)

    def estimates(self) -> dict:
        return {k: self.cell(k) for k in self.values}

    def contrast(self, weights: dict, minus: float = 0.0) -> Test:
        """sum_c k_c mu_c - `minus` for weights {cell: k_c}: estimate, interval and t test."""
        weights = {k: float(w) for k, w in weights.items() if w != 0}
        estimate = sum(w * self.values[k].mean() for k, w in weights.items()) - minus
        lo = sum(min(w * self.bounds(k)[0], w * self.bounds(k)[1]) for k, w in weights.items())
        hi = sum(max(w * self.bounds(k)[0], w * self.bounds(k)[1]) for k, w in weights.items())
        bounds = (lo - minus, hi - minus) if lo == lo and hi == hi else (-math.inf, math.inf)
        parts: dict[int, list] = {}
        for k, w in weights.items():
            p = self.pool_of(k)
            parts.setdefault(id(p), [p, 0.0])[1] += w * w / self.values[k].size
        pools = [(p, c) for p, c in parts.values()]
        seeded = all(p.df > 0 for p, _ in pools)
        if seeded:
            tau = sum(w * w * self.extra[k] for k, w in weights.items())
            var = sum(p.variance * c for p, c in pools) + tau
            if var > 0:
                df = satterthwaite([(p.variance * c, p.df) for p, c in pools] + [(tau, math.inf)])
                scopes = sorted({p.scope for p, _ in pools})
                method = f"t test, {'/'.join(scopes)} pooled seed variance"
                return t_test(float(estimate), math.sqrt(var), df, bounds, method)
        ses = [self._single_se(k) for k in weights]
        se = math.sqrt(sum((w * s) ** 2 for w, s in zip(weights.values(), ses)))
        if (seeded or all(self.values[k].size == 1 for k in weights)) and se > 0:
            why = "seeds identical" if seeded else "one seed"
            return t_test(float(estimate), se, math.inf, bounds, f"z test, runs' bootstrap ({why})")
        if seeded:  # every seed of every cell agrees, and no run has an interval of its own
            e = float(estimate)
            return Test(e, 0.0, math.inf, e, e, float(e == 0), "exact: identical in every seed")
        return t_test(float(estimate), math.nan, 0, bounds, "one seed and no bootstrap interval")

    def difference(self, a, b) -> Test:
        """mu_a - mu_b."""
        return self.contrast({a: 1.0, b: -1.0})

    def versus(self, key, value: float) -> Test:
        """mu_key - value, against an exact number."""
        return self.contrast({key: 1.0}, minus=value)

    def slope(self, x: dict) -> Test:
        """The least-squares slope of the runs' values on x_c ({cell: x}) over every run of those
        cells, as a contrast of their means (k_c = n_c (x_c - xbar) / Sxx)."""
        n = {k: self.values[k].size for k in x}
        xbar = sum(n[k] * x[k] for k in x) / sum(n.values())
        sxx = sum(n[k] * (x[k] - xbar) ** 2 for k in x)
        if sxx == 0:
            return t_test(math.nan, math.nan, 0, method="one value of the covariate")
        return self.contrast({k: n[k] * (x[k] - xbar) / sxx for k in x})
