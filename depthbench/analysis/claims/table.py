"""The claims table (results/tables/claims.parquet): each claim of config/claims.yaml with its
effect, 95% interval, test, p-value and degrees of freedom, the cells it compares, the scale they
were measured at and a verdict at the 5% level (depthbench.analysis.claims.verdict says what each
outcome means and how it is reached; depthbench.analysis.stats the model behind the tests).

Claims read the trained grid only: pretrained models' rows are dropped. A claim on trained
models leaves out every cell whose best-LR run did not learn (runs.parquet `learned` false:
its final validation loss within analysis.learned_margin of the unigram floor), and its row
says how many it left out (`excluded_cells`) and which (the note).

Columns beside the verdict: `ours` (a short summary); the decisive effect (`effect`: what it
is, `estimate`, its 95% interval `ci_low` / `ci_high`, `effect_p` its own two-sided p, `df` and
`test`: how it was tested); `p_value`, the claim's, that of its verdict's test (for holds the
largest of its strict effects' p, 1 where one goes the opposite way; for contradicted the
Bonferroni-corrected one); `variance`, the pooled seed variance behind the tests; `contrasts`
(every effect the claim states, with interval, df and p); `estimates` (every cell compared, as
"label value [low, high] (n=seeds)", the interval from the pooled variance, within the
quantity's range); the two cells the decisive effect reads (`lhs*`, `rhs*`: label, value, low,
high, n); and `single_seed` (some cell compared rests on one seed).
A row without a test (not testable) has NaN numbers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import yaml

from depthbench.analysis import readers as R
from depthbench.analysis.claims import cost_nll, depth, dynamics, representations  # noqa: F401
from depthbench.analysis.claims.verdict import CLAIMS, Result
from depthbench.util.errors import DepthBenchError

SIDES = [
    f"{side}{part}" for side in ("lhs", "rhs") for part in ("", "_value", "_low", "_high", "_n")
]
COLUMNS = [
    "claim_id",
    "claim",
    "source",
    "paper",
    "ours",
    "effect",
    "estimate",
    "ci_low",
    "ci_high",
    "effect_p",
    "p_value",
    "df",
    "test",
    "variance",
    "contrasts",
    "estimates",
    *SIDES,
    "single_seed",
    "excluded_cells",
    "method",
    "scale",
    "verdict",
    "note",
]


def load_claims(path: str | Path) -> list[dict]:
    """The claim rows of the data file, each with a registered claim function."""
    rows = yaml.safe_load(Path(path).read_text()) or []
    for n, row in enumerate(rows):
        missing = {"id", "claim", "source", "paper", "method"} - set(row)
        if missing:
            raise DepthBenchError(f"{path}: claim {n} lacks {sorted(missing)}")
        if row["id"] not in CLAIMS:
            raise DepthBenchError(
                f"{path}: claim id {row['id']!r} has no function; valid: {sorted(CLAIMS)}"
            )
    return rows


def trained_grid(tables: dict) -> dict:
    """The tables without pretrained models' rows."""
    return {
        name: df[df["status"] != "pretrained"] if R.has(df, "status") else df
        for name, df in tables.items()
    }


def _cell_keys(df: pd.DataFrame) -> pd.Series:
    def key(r) -> tuple:
        d = r["d_model"]
        return (str(r["arch"]), int(r["n_layer"]), int(d) if d == d else -1, str(r["knobs"]))

    return df.apply(key, axis=1) if not df.empty else pd.Series([], dtype=object)


def without_cells(tables: dict, cells: pd.DataFrame) -> dict:
    """The tables without the rows of `cells` (SHAPE_KEYS), dynamics by the cells' runs."""
    if cells.empty:
        return tables
    drop = set(_cell_keys(cells))
    out = {}
    for name, df in tables.items():
        if R.has(df, *R.SHAPE_KEYS):
            df = df[~_cell_keys(df).isin(drop)]
        out[name] = df
    runs = tables.get("runs", pd.DataFrame())
    if R.has(runs, *R.SHAPE_KEYS, "run_id") and R.has(out.get("dynamics"), "run_id"):
        gone = set(runs.loc[_cell_keys(runs).isin(drop), "run_id"])
        out["dynamics"] = out["dynamics"][~out["dynamics"]["run_id"].isin(gone)]
    return out


def scale(t: dict) -> str:
    """The scale at which our numbers were measured: parameters, depths, tokens per run."""
    runs = t.get("runs", pd.DataFrame())
    if not R.has(runs, "params", "n_layer"):
        return "no runs"
    tokens = f", {runs['tokens_seen'].max():.3g} tokens per run" if "tokens_seen" in runs else ""
    depths = ",".join(str(L) for L in sorted(runs["n_layer"].unique()))
    return f"{runs['params'].median():.3g} params, L = {depths}{tokens}"


def _sides(result: Result) -> dict:
    step = result.decisive
    out = {c: math.nan for c in SIDES} | {"lhs": "", "rhs": ""}
    out |= {"effect": "", "estimate": math.nan, "ci_low": math.nan, "ci_high": math.nan}
    out |= {"effect_p": math.nan, "p_value": math.nan, "df": math.nan, "test": ""}
    if step is not None:
        for side, label, e in (("lhs", step.lhs, step.a), ("rhs", step.rhs, step.b)):
            out |= {side: label, f"{side}_value": e.value, f"{side}_low": e.low}
            out |= {f"{side}_high": e.high, f"{side}_n": e.n}
        c = step.contrast
        out |= {"effect": step.label, "estimate": c.estimate, "ci_low": c.low}
        out |= {"ci_high": c.high, "effect_p": c.p, "p_value": result.p, "df": c.df}
        out |= {"test": c.method}
    return out


def _exclusion_note(cells: pd.DataFrame, tables: dict, settings: dict) -> str:
    from depthbench.spec.schema import with_defaults

    margin = with_defaults("analysis", settings.get("analysis", {}))["learned_margin"]
    floor = R.unigram_floor(tables.get("runs", pd.DataFrame()))
    named = [f"{r.arch} L={r.n_layer}" for r in cells.itertuples()]
    shown = ", ".join(named[:6]) + (f" and {len(named) - 6} more" if len(named) > 6 else "")
    at = f" {floor:.2f}" if floor is not None else ""
    return (
        f"left out {len(cells)} cell(s) whose best-LR run did not learn (final validation loss "
        f"not {margin:g} nats below the unigram floor{at}): {shown}"
    )


def claims_table(rows: list[dict], tables: dict, settings: dict) -> pd.DataFrame:
    """One row per claim of `rows` (load_claims), from the result tables and the figure settings
    (arch_options for the block part of (c), analysis.learned_margin); the module docstring
    gives the columns."""
    grid = trained_grid(tables)
    gone = R.not_learned_cells(
        grid.get("runs", pd.DataFrame()), grid.get("best_lr", pd.DataFrame())
    )
    learned = without_cells(grid, gone)
    excluded = _exclusion_note(gone, grid, settings) if not gone.empty else ""
    measured = scale(grid)
    out = []
    for row in rows:
        c = CLAIMS[row["id"]]
        result = c.fn(learned if c.trained else grid, settings)
        note = "; ".join(n for n in (result.note, excluded if c.trained else "") if n)
        out.append(
            {
                "claim_id": row["id"],
                "claim": row["claim"],
                "source": row["source"],
                "paper": row["paper"],
                "ours": result.ours,
                "variance": result.variance,
                "contrasts": result.contrasts_text(),
                "estimates": result.estimates_text(),
                **_sides(result),
                "single_seed": result.single_seed,
                "excluded_cells": len(gone) if c.trained else 0,
                "method": row["method"],
                "scale": measured,
                "verdict": result.verdict,
                "note": note,
            }
        )
    table = pd.DataFrame(out, columns=COLUMNS)
    return table.astype(
        {"single_seed": bool, "excluded_cells": int, "lhs_n": "Int64", "rhs_n": "Int64"}
        | {c: float for c in ("estimate", "ci_low", "ci_high", "effect_p", "p_value", "df")}
    )
