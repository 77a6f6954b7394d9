"""Effective depth from a run's layer-removal rows (depthbench.probes.removal_run writes them).

Effective depth (`effective_fraction`): the largest fraction k / L such that removing k layers,
and every smaller k of the same ranking, raises the validation loss by at most `tolerance`
(relative). Pandas only, no torch: the removal_table job computes it from the rows, and torch's
import would be most of that job's time.
"""

from __future__ import annotations

import math

import pandas as pd

# The columns of a run's removal rows (after run_id; status last).
COLUMNS = ["ranking", "draw", "k", "fraction", "removed", "domain", "loss", "full_loss", "change"]


def effective_fraction(
    curve: dict[int, float], full: float, n_layer: int, tolerance: float
) -> float:
    """The largest k / L such that the loss with k layers removed, and with every smaller k of
    the curve, is at most (1 + tolerance) times the full model's; 0 when even the smallest k
    exceeds it. `curve`: k -> loss (for `random`, the mean over draws)."""
    best = 0
    for k in sorted(curve):
        if not math.isfinite(curve[k]) or curve[k] > (1 + tolerance) * full:
            break
        best = k
    return best / n_layer


def effective_depth(removal: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """Per run and ranking: the largest fraction of layers removable with the validation loss at
    most (1 + tolerance) times the full model's (`effective_fraction`; `random`: the mean loss
    over its draws), and the layers that must stay."""
    val = removal[removal["domain"] == "val"]
    rows = []
    for (run_id, ranking), g in val.groupby(["run_id", "ranking"], sort=True):
        curve = g.groupby("k")["loss"].mean()
        if "n_layer" in g.columns:  # merged with the runs' columns
            n_layer = int(g["n_layer"].iloc[0])
        elif g["fraction"].max() > 0:
            n_layer = int(round(g["k"].max() / g["fraction"].max()))
        else:
            continue
        full = float(g["full_loss"].iloc[0])
        fraction = effective_fraction(
            {int(k): float(v) for k, v in curve.items() if k > 0}, full, n_layer, tolerance
        )
        rows.append(
            {
                "run_id": run_id,
                "ranking": ranking,
                "tolerance": tolerance,
                "effective_fraction": fraction,
                "layers_needed": n_layer - round(fraction * n_layer),
            }
        )
    return pd.DataFrame(
        rows, columns=["run_id", "ranking", "tolerance", "effective_fraction", "layers_needed"]
    )
