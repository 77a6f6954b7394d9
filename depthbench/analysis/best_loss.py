"""The best-LR validation loss of each cell as the claims and the headline read it: a cell-means
model (depthbench.analysis.stats.CellModel) of every seed at the cell's best LR, the seed
variance pooled over the cells whose best-LR runs learned, plus the variance of the LR choice.

Why the choice's variance: the best LR is the one whose loss on the sweep's seeds is lowest, and
those losses are noisy, so a cell may land one LR off its optimum. That shifts every seed at the
chosen LR alike: an error of the cell's mean that the seeds' spread does not see. Without it the
tests of differences between cells reject a true null more often than 5%
(tests/unit/test_verdict_calibration.py simulates grids with the default's seed noise and
loss-against-LR curvature). Its variance tau_c^2 comes from a parametric bootstrap of the
choice (`lr_choice_variance`): the cell's sweep losses v_k (mean over the sweep's seeds at each
finished LR k) each plus N(0, s^2 / n_k) again, s the pooled seed SD and n_k the seeds behind
v_k, `DRAWS` times with a fixed generator; tau_c^2 is the variance over the draws of the penalty
v_k* - min_k v_k of the LR k* each draw picks. A cell with one finished LR has none. The cell
mean's variance is s^2 / n_c + tau_c^2, tau taken as known in the degrees of freedom.

The sweep's seeds of a cell are those of its runs at the LRs other than the best: replicates
(seeds_at_best_lr) train at the best LR only.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis.cell_model import CellModel

DRAWS = 400


def lr_choice_variance(sweep: np.ndarray, counts: np.ndarray, sd: float, seed: int = 0) -> float:
    """tau^2 of one cell: its sweep losses `sweep` (one per finished LR), the seeds behind each
    (`counts`) and the pooled seed SD (the module docstring)."""
    if sweep.size < 2 or not sd == sd:
        return 0.0
    noise = np.random.default_rng(seed).standard_normal((DRAWS, sweep.size))
    picked = (sweep + noise * sd / np.sqrt(counts)).argmin(axis=1)
    return float((sweep[picked] - sweep.min()).var())


def _sweeps(runs: pd.DataFrame, best: pd.DataFrame, keys: list[str]) -> dict:
    """{cell: (loss per finished LR on the sweep's seeds, seeds per LR)}."""
    at = runs[(runs["status"] == "ok") & runs["final_val_loss"].notna()]
    lr_of = dict(zip(R.cell_keys(best), best["best_lr"].astype(float)))
    top = np.array([lr_of.get(k, np.nan) for k in R.cell_keys(at)], dtype=float)
    cols = [at[k].to_numpy() for k in keys]
    lr, seed, loss = (
        at["lr"].to_numpy(float),
        at["seed"].to_numpy(),
        at["final_val_loss"].to_numpy(float),
    )
    runs_of: dict = {}
    for i, key in enumerate(zip(*cols)):
        if top[i] == top[i]:  # a cell of best_lr
            runs_of.setdefault(key if len(keys) > 1 else key[0], []).append(i)
    out = {}
    for key, idx in runs_of.items():
        idx = np.asarray(idx)
        sweep_seeds = set(seed[idx[~np.isclose(lr[idx], top[idx])]])
        idx = idx[[s in sweep_seeds for s in seed[idx]]]
        lrs, where = np.unique(lr[idx], return_inverse=True)
        counts = np.bincount(where, minlength=lrs.size).astype(float)
        means = np.bincount(where, weights=loss[idx], minlength=lrs.size) / np.maximum(counts, 1)
        out[key] = (means, counts)
    return out


def loss_model(runs: pd.DataFrame, best: pd.DataFrame, keys=("arch", "n_layer")) -> CellModel:
    """The best-LR loss model of best_lr's cells, by `keys`: every seed at the cell's best LR,
    the seed variance pooled over the cells whose best-LR runs learned (all where none did),
    each cell's LR-choice variance added."""
    keys = list(keys)
    chosen = R.best_runs(runs, best)
    if "status" in chosen.columns:
        chosen = chosen[chosen["status"] == "ok"]
    rows = chosen.rename(columns={"final_val_loss": "value"})
    if "n_layer" in rows:
        rows = rows.astype({"n_layer": int})
    learned = None
    if R.not_learned(chosen).any():
        gone = R.not_learned_cells(runs, best)
        flat = {k if len(keys) > 1 else k[0] for k in gone[keys].itertuples(index=False, name=None)}
        cells = {
            k if len(keys) > 1 else k[0] for k in rows[keys].itertuples(index=False, name=None)
        }
        learned = (cells - flat) or None
    model = CellModel(rows, keys, bounds=(0.0, math.inf), pool_cells=learned)
    if runs.empty or best.empty:
        return model
    for key, (sweep, counts) in _sweeps(runs, best, keys).items():
        if key in model:
            model.extra[key] = lr_choice_variance(sweep, counts, model.pool_of(key).sd)
    return model


def with_intervals(best: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """best_lr's rows with each cell's 95% interval from the loss model of its experiment
    (`ci_low`, `ci_high`, `ci_df`), the seeds behind it (`n`), the pooled seed SD and its
    degrees of freedom (`pooled_sd`, `pooled_df`) and the LR choice's SD (`lr_choice_sd`)."""
    parts = []
    for experiment, b in best.groupby("experiment", sort=False):
        r = runs[runs["experiment"] == experiment] if "experiment" in runs else runs
        model = loss_model(r, b, R.SHAPE_KEYS)
        found = [
            model[k] if k in model else None
            for k in b[R.SHAPE_KEYS].itertuples(index=False, name=None)
        ]
        pools = [
            model.pool_of(k) if k in model else None
            for k in b[R.SHAPE_KEYS].itertuples(index=False, name=None)
        ]
        nan = math.nan
        parts.append(
            b.assign(
                ci_low=[e.low if e else nan for e in found],
                ci_high=[e.high if e else nan for e in found],
                ci_df=[e.df if e else nan for e in found],
                n=[e.n if e else 0 for e in found],
                pooled_sd=[p.sd if p else nan for p in pools],
                pooled_df=[p.df if p else 0 for p in pools],
                lr_choice_sd=[
                    math.sqrt(model.extra[k]) if k in model else nan
                    for k in b[R.SHAPE_KEYS].itertuples(index=False, name=None)
                ],
            )
        )
    return (
        pd.concat(parts, ignore_index=True)
        if parts
        else best.assign(
            ci_low=math.nan,
            ci_high=math.nan,
            ci_df=math.nan,
            n=0,
            pooled_sd=math.nan,
            pooled_df=0,
            lr_choice_sd=math.nan,
        )
    )
