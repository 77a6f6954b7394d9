"""Cell estimates with 95% intervals for the figures, from the tables' per-run rows.

A cell is an (architecture, shape, knobs) group; its runs are its seeds. Per cell (and per
index: layer i, pair (i, j), domain) the estimate is intervals.cell_interval of the runs'
values: the t interval over seeds when the cell has two or more, else the single run's own
bootstrap interval from its `ci_low`/`ci_high` columns (over probe sequences or NLL documents),
with n = 1. `interval_text` says which of the two a figure draws. A table without the interval
columns (written before them) reads as rows without intervals.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis.intervals import cell_interval

CELL_KEYS = ["arch", "n_layer", "d_model", "knobs"]
NLL_INTERVAL_COLUMNS = ("ci_low", "ci_high", "nats_per_token_ci_low", "nats_per_token_ci_high")
ESTIMATE_COLUMNS = ["value", "ci_low", "ci_high", "n"]


def with_interval_columns(table: pd.DataFrame, columns) -> pd.DataFrame:
    """`table` with each interval column present (NaN where a file was written without it)."""
    return table.assign(**{c: table[c].astype(float) if c in table else math.nan for c in columns})


def cells(
    rows: pd.DataFrame,
    keys: list[str],
    value: str = "value",
    bounds: tuple[str, str] = ("ci_low", "ci_high"),
    carry: tuple[str, ...] = ("ratio",),
) -> pd.DataFrame:
    """One row per group of `keys` (one row per run in each group): `value`, `ci_low`,
    `ci_high` and `n` from intervals.cell_interval, and the first value of each `carry` column
    present (the same within a cell: its d_model / n_layer)."""
    keep = [c for c in carry if c in rows.columns and c not in keys]
    if rows.empty or not all(k in rows.columns for k in keys):
        return pd.DataFrame(columns=keys + ESTIMATE_COLUMNS + keep)
    out = []
    for key, g in rows.groupby(keys, sort=True):
        lows, highs = (g[b].to_numpy(float) if b in g.columns else None for b in bounds)
        e = cell_interval(g[value].to_numpy(float), lows, highs)
        out.append(
            {
                **dict(zip(keys, key)),
                "value": e.value,
                "ci_low": e.low,
                "ci_high": e.high,
                "n": e.n,
                **{c: g[c].iloc[0] for c in keep},
            }
        )
    return pd.DataFrame(out, columns=keys + ESTIMATE_COLUMNS + keep)


def probe_runs(probes: pd.DataFrame, name: str, stage: str = "trained") -> pd.DataFrame:
    """Rows of one probe at one stage, every seed of each cell: trained rows of the cell's
    best-LR runs; at init (where the LR plays no part, and diverged runs have rows too) and
    without an is_best_lr column, the cell's lowest LR (readers.probe's choice, all seeds)."""
    if not R.has(probes, "probe", "stage", "value", *CELL_KEYS):
        return pd.DataFrame(columns=["run_id", "probe", "stage", "i", "j", "value", *CELL_KEYS])
    sub = probes[(probes["probe"] == name) & (probes["stage"] == stage)]
    if stage == "trained" and "is_best_lr" in sub.columns:
        return sub[sub["is_best_lr"].fillna(False).astype(bool)]
    if "lr" in sub.columns and not sub.empty:
        sub = sub[sub["lr"] == sub.groupby(CELL_KEYS)["lr"].transform("min")]
    return sub


def probe_cells(
    probes: pd.DataFrame, name: str, stage: str = "trained", index: tuple[str, ...] = ("i", "j")
) -> pd.DataFrame:
    """probe_runs combined per cell and index (layer i, pair (i, j)): `cells`."""
    return cells(probe_runs(probes, name, stage), CELL_KEYS + list(index))


def interval_text(estimates: pd.DataFrame, unit: str) -> str:
    """What the drawn intervals are: the bootstrap over `unit` within a run (cells of one seed)
    and / or the t interval over seeds, as the cells' n say."""
    n = estimates["n"] if "n" in estimates.columns else pd.Series(dtype=int)
    has = np.isfinite(estimates["ci_low"]) if "ci_low" in estimates.columns else n.astype(bool)
    parts = []
    if (has & (n == 1)).any():
        parts.append(f"bootstrap over {unit} (one seed)")
    if (has & (n >= 2)).any():
        seeds = sorted(set(n[n >= 2].astype(int)))
        parts.append("t interval over " + "/".join(map(str, seeds)) + " seeds")
    return "95% interval: " + "; ".join(parts) if parts else "no intervals in the table"


# -- drawing ---------------------------------------------------------------------------------------
# A t interval over two seeds is mean +- 12.7 s / sqrt(2): for a share or a cosine it can reach
# past the values the quantity can take, so a figure may draw it within that range (`within`)
# and say so (`within_text`).
def _bounds(low, high, within: tuple[float, float] | None):
    low, high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
    if within is not None:
        low, high = np.clip(low, *within), np.clip(high, *within)
    return low, high, np.isfinite(low) & np.isfinite(high)


def within_text(within: tuple[float, float]) -> str:
    return f" (drawn within [{within[0]:g}, {within[1]:g}], the quantity's range)"


def band(ax, x, low, high, color, within: tuple[float, float] | None = None) -> None:
    """The interval as a shaded band under a line (nothing where a bound is NaN)."""
    low, high, ok = _bounds(low, high, within)
    if ok.any():
        ax.fill_between(
            np.asarray(x, dtype=float), low, high, where=ok, color=color, alpha=0.18, lw=0
        )


def error_bars(
    ax, x, low, high, color, within: tuple[float, float] | None = None, skip=None
) -> None:
    """The interval as a vertical bar with caps at each point that has one (a bar from low to
    high: a point estimate need not sit at its percentile interval's centre), except where
    `skip` is True (a cell that did not learn: its cross stands alone, style.trend)."""
    x = np.asarray(x, dtype=float)
    low, high, ok = _bounds(low, high, within)
    if skip is not None:
        ok &= ~np.asarray(skip, dtype=bool)
    if ok.any():
        ax.vlines(x[ok], low[ok], high[ok], colors=[color], linewidth=1)
        for end in (low[ok], high[ok]):
            ax.scatter(x[ok], end, marker="_", s=30, color=color, linewidths=1)


def dodge(x, k: int, count: int, step: float = 0.012, log: bool = True) -> np.ndarray:
    """x moved a little for the k-th of `count` series, so that bars at one x do not hide each
    other: to x * (1 + step (k - (count - 1) / 2)) on a log axis, x + step (...) on a linear one."""
    offset = step * (k - (count - 1) / 2)
    x = np.asarray(x, dtype=float)
    return x * (1 + offset) if log else x + offset
