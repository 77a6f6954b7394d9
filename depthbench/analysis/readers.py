"""Readers of the result tables (results/tables/*.parquet) for figures, claims and the report.

Figures read these tables only. Every reader tolerates a table that is missing, empty, or
lacks an optional column (a stage that did not run, or a setting that leaves the column out):
figures then say what is missing instead of failing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

TABLES = ("runs", "curves", "best_lr", "dynamics", "probes", "nll", "cost")
SHAPE_KEYS = ["arch", "n_layer", "d_model", "knobs"]


def read_tables(paths: dict[str, str | Path]) -> dict[str, pd.DataFrame]:
    """{name: DataFrame} for the given table files; a file that does not exist reads as empty."""
    out = {}
    for name, path in paths.items():
        p = Path(path)
        out[name] = pd.read_parquet(p) if p.exists() and p.stat().st_size else pd.DataFrame()
    return out


def has(df: pd.DataFrame | None, *columns: str) -> bool:
    """True when df is a non-empty table with every named column."""
    return df is not None and not df.empty and all(c in df.columns for c in columns)


def unigram_floor(runs: pd.DataFrame) -> float | None:
    if not has(runs, "unigram_floor"):
        return None
    floors = runs["unigram_floor"].dropna()
    return float(floors.iloc[0]) if not floors.empty else None


def best_runs(runs: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """The runs at their group's best learning rate (every seed), from runs and best_lr."""
    if not has(runs, "run_id", *SHAPE_KEYS, "lr") or not has(best, *SHAPE_KEYS, "best_lr"):
        return pd.DataFrame(columns=list(runs.columns) if runs is not None else [])
    lr_of = dict(zip(cell_keys(best), best["best_lr"].astype(float)))
    chosen = np.array([lr_of.get(k, np.nan) for k in cell_keys(runs)], dtype=float)
    return runs[np.isclose(runs["lr"].to_numpy(float), chosen)].reset_index(drop=True)


def cell_keys(df: pd.DataFrame) -> list[tuple]:
    """Each row's (arch, n_layer, d_model, knobs) as a hashable key, shapes as floats (one table
    may read d_model as an int and another as a float; NaN as -1)."""
    d = df["d_model"].to_numpy(float)
    return list(
        zip(
            map(str, df["arch"].to_numpy()),
            df["n_layer"].to_numpy(float),
            np.where(np.isnan(d), -1.0, d),
            map(str, df["knobs"].to_numpy()),
        )
    )


def first_seed(df: pd.DataFrame) -> pd.DataFrame:
    """One run per (arch, shape, knobs): the lowest seed (probe figures show one run each)."""
    if df.empty or "seed" not in df.columns:
        return df
    lowest = df.groupby(SHAPE_KEYS)["seed"].transform("min")
    return df[df["seed"] == lowest]


def learned(final_val_loss: float, unigram_floor: float, margin: float) -> bool:
    """Whether a run learned more than unigram statistics: its final validation loss lies more
    than `margin` nats below the unigram floor. A diverged run (NaN loss) did not learn."""
    return final_val_loss is not None and bool(final_val_loss < unigram_floor - margin)


def not_learned(runs: pd.DataFrame) -> pd.Series:
    """Per run: True where runs.parquet marks it `learned` false; a table without the column
    (written before it) marks none."""
    if not has(runs, "learned"):
        return pd.Series(False, index=runs.index if runs is not None else None, dtype=bool)
    return runs["learned"].eq(False).fillna(False).astype(bool)


def not_learned_cells(runs: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """The (arch, shape, knobs) cells whose best-LR runs (every seed) did not learn, with their
    mean final validation loss."""
    chosen = best_runs(runs, best)
    if chosen.empty or "learned" not in chosen.columns:
        return pd.DataFrame(columns=[*SHAPE_KEYS, "final_val_loss"])
    flagged = chosen.assign(_not=not_learned(chosen))
    cells = flagged.groupby(SHAPE_KEYS, as_index=False).agg(
        _not=("_not", "all"), final_val_loss=("final_val_loss", "mean")
    )
    return cells[cells["_not"]].drop(columns="_not").reset_index(drop=True)


def _cell_key(arch, n_layer, d_model, knobs) -> tuple:
    # shapes as floats: one table may read d_model as an int and another as a float
    return (str(arch), float(n_layer), float(d_model), str(knobs))


def not_learned_keys(tables: dict) -> frozenset[tuple]:
    """The cells of not_learned_cells from the tables' runs and best_lr, as keys for in_cells:
    the one rule by which every figure marks a cell that did not learn. Empty where a table, or
    runs' `learned` column, is missing."""
    cells = not_learned_cells(tables.get("runs"), tables.get("best_lr"))
    return frozenset(_cell_key(*row) for row in cells[SHAPE_KEYS].itertuples(index=False))


def in_cells(df: pd.DataFrame, keys: frozenset[tuple]) -> pd.Series:
    """Per row of df: whether its (arch, n_layer, d_model, knobs) is one of `keys`
    (not_learned_keys); False everywhere for a table without those columns."""
    if not keys or not has(df, *SHAPE_KEYS):
        return pd.Series(False, index=df.index if df is not None else None, dtype=bool)
    rows = df[SHAPE_KEYS].itertuples(index=False)
    return pd.Series([_cell_key(*row) in keys for row in rows], index=df.index, dtype=bool)


def all_in_cells(df: pd.DataFrame, keys: frozenset[tuple]) -> bool:
    """Whether df holds rows and every one is of a cell in `keys`: one curve's rows (a cell's
    layers), marked as a whole."""
    return df is not None and not df.empty and bool(in_cells(df, keys).all())


INTERVAL = ("ci_low", "ci_high")  # a row's 95% interval, where the stage that wrote it has one


def removable(depth: pd.DataFrame, all_seeds: bool = False) -> pd.DataFrame:
    """Per run at its cell's best LR (the first seed unless `all_seeds`; a pretrained model's one
    run) from effective_depth.parquet: the largest fraction of layers a non-random ranking
    removes within the tolerance (`removable`; `best_ranking` names the ranking, the first by
    name among ties) and the random ranking's (`random_removable`); NaN where a run lacks them."""
    columns = ["run_id", *SHAPE_KEYS, "ratio", "status", "seed"]
    out_columns = columns + ["removable", "best_ranking", "random_removable"]
    if not has(depth, "run_id", "arch", "n_layer", "ranking", "effective_fraction"):
        return pd.DataFrame(columns=out_columns)
    if "is_best_lr" in depth.columns:
        depth = depth[depth["is_best_lr"].fillna(False).astype(bool)]
    depth = depth if all_seeds else first_seed(depth)
    rows = []
    for _, g in depth.groupby("run_id", sort=False):
        ranked = g[g["ranking"] != "random"].sort_values(
            ["effective_fraction", "ranking"], ascending=[False, True]
        )
        randoms = g[g["ranking"] == "random"]["effective_fraction"]
        first = g.iloc[0]
        rows.append(
            {
                **{c: first.get(c, np.nan) for c in columns},
                "status": first.get("status", "ok"),
                "removable": float(ranked["effective_fraction"].iloc[0]) if len(ranked) else np.nan,
                "best_ranking": str(ranked["ranking"].iloc[0]) if len(ranked) else None,
                "random_removable": float(randoms.max()) if len(randoms) else np.nan,
            }
        )
    return pd.DataFrame(rows, columns=out_columns)


def probe(
    probes: pd.DataFrame,
    name: str,
    stage: str = "trained",
    best_only: bool = True,
    all_seeds: bool = False,
) -> pd.DataFrame:
    """Rows of one probe at one stage, one run per (arch, shape, knobs): the best-LR run (first
    seed) of trained rows. At init the learning rate plays no part, and diverged runs have init
    rows too, so init stages (and best_only=False) take the lowest-LR run, first seed.
    `all_seeds`: every seed of that learning rate instead of the first."""
    if not has(probes, "probe", "stage", "value", *SHAPE_KEYS):
        return pd.DataFrame(
            columns=["run_id", "probe", "stage", "i", "j", "value", *SHAPE_KEYS, "seed", "lr"]
        )
    seeds = (lambda df: df) if all_seeds else first_seed
    sub = probes[(probes["probe"] == name) & (probes["stage"] == stage)]
    if best_only and stage == "trained" and "is_best_lr" in sub.columns:
        return seeds(sub[sub["is_best_lr"].fillna(False).astype(bool)])
    if "lr" in sub.columns and not sub.empty:
        sub = sub[sub["lr"] == sub.groupby(SHAPE_KEYS)["lr"].transform("min")]
    return seeds(sub)


def deepest(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the deepest shape present."""
    if df.empty:
        return df
    return df[df["n_layer"] == df["n_layer"].max()]


def matrix(rows: pd.DataFrame, size: tuple[int, int]) -> np.ndarray:
    """The rows' values placed at (i, j) of a NaN matrix (indices outside are dropped)."""
    M = np.full(size, np.nan)
    i, j = rows["i"].to_numpy(int), rows["j"].to_numpy(int)
    keep = (i >= 0) & (j >= 0) & (i < size[0]) & (j < size[1])
    M[i[keep], j[keep]] = rows["value"].to_numpy(float)[keep]
    return M


def shapes(df: pd.DataFrame) -> list[tuple[int, str]]:
    """One (n_layer, d_model label) per depth present, shallow to deep. At a fixed budget the
    architectures of one depth solve to different widths (their extra parameters are charged
    to them), so a shape is its depth; the label names the widths ("112", or "104-120")."""
    if not has(df, "n_layer", "d_model"):
        return []
    out = []
    for n_layer, group in df.groupby("n_layer", sort=True):
        widths = sorted(int(d) for d in group["d_model"].dropna().unique())
        out.append(
            (int(n_layer), str(widths[0]) if len(widths) == 1 else f"{widths[0]}-{widths[-1]}")
        )
    return out


def archs(df: pd.DataFrame) -> list[str]:
    """Architectures present, in the style's fixed order."""
    from depthbench.analysis.style import arch_order

    if not has(df, "arch"):
        return []
    present, order = set(df["arch"].dropna().unique()), arch_order()
    return [a for a in order if a in present] + sorted(present - set(order))


def grid_line(config: dict) -> str:
    """The config stated in every figure: budget, architectures' count, depths, LRs, seeds."""
    budget = config.get("budget", {}).get("params")
    depths = ",".join(str(s.get("n_layer")) for s in config.get("shapes", []))
    lrs = ",".join(f"{v:g}" for v in config.get("learning_rates", []))
    by_arch = config.get("learning_rates_by_arch") or {}
    if by_arch:  # several grids: their span, and that they differ (the LR table has each cell's)
        every = [float(v) for v in config.get("learning_rates", [])] + [
            float(v) for lrs_ in by_arch.values() for v in lrs_
        ]
        lrs = f"{min(every):g}..{max(every):g} per architecture"
    seeds = ",".join(str(s) for s in config.get("seeds", [0]))
    at_best = int(config.get("seeds_at_best_lr") or 0)
    if at_best > len(config.get("seeds", [0])):  # the replicates (seeds_at_best_lr)
        seeds += f" ({at_best} at each best LR)"
    parts = [
        f"budget {budget:.3g} params" if budget else "",
        f"L = {depths}" if depths else "",
        f"LR {lrs}" if lrs else "",
        f"seeds {seeds}",
    ]
    line = "; ".join(p for p in parts if p)
    pretrained = [
        p["name"] if isinstance(p, dict) else str(p) for p in config.get("pretrained") or []
    ]
    if pretrained:  # the budget, depths and LRs are the trained grid's, not the pretrained models'
        line = f"trained: {line}; pretrained: {', '.join(pretrained)}"
    return line
