"""Parquet tables built from run outputs only (summary.json, metrics.jsonl, shard meta.json).

Everything needed is inside results/, so the tables (and the figures made from them) can be
rebuilt on a machine that has only a copy of another machine's results/ folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from depthbench.util.io import atomic_write
from depthbench.train.runcheck import read_summary

GROUP_COLUMNS = ["experiment", "arch", "n_layer", "d_model", "knobs"]


def _read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def run_rows(
    summary_paths: Iterable[str],
    unigram_floor: float,
    experiment: str,
    budget_params: float | None = None,
    expected: dict[str, str] | None = None,
    learned_margin: float | None = None,
) -> pd.DataFrame:
    """One row per run. `budget_params` is the config's budget.params (None: no budget, so
    `params_vs_budget`, the relative deviation of the built model from it, is NaN); `expected`:
    the grid's spec hash per run id (see read_summary). `learned` is false for a run whose
    final validation loss is not `learned_margin` nats (analysis.learned_margin; None: the
    schema's default) below the unigram floor (depthbench.analysis.readers.learned)."""
    from depthbench.analysis.readers import learned
    from depthbench.spec.schema import schema_defaults

    if learned_margin is None:
        learned_margin = schema_defaults("analysis")["learned_margin"]
    rows = []
    for path in summary_paths:
        s = read_summary(path, expected)
        spec = s["spec"]
        shape = spec["shape"]
        rows.append(
            {
                "run_id": s["run_id"],
                "experiment": experiment,
                "arch": spec["arch"],
                "n_layer": shape["n_layer"],
                "d_model": shape["d_model"],
                "ratio": shape["d_model"] / shape["n_layer"],
                "d_ff": shape["d_ff"],
                "n_head": shape["n_head"],
                "n_kv_head": shape["n_kv_head"],
                "params": s["n_params"],
                "budget_params": float(budget_params) if budget_params else math.nan,
                "params_vs_budget": s["n_params"] / budget_params - 1
                if budget_params
                else math.nan,
                "lr": spec["lr"],
                "seed": spec["seed"],
                "knobs": json.dumps(spec["knobs"], sort_keys=True),
                # one column per sweep axis; as text, since an axis may mix numbers and rules
                **{
                    f"knob_{k.replace('.', '_')}": json.dumps(v) if not isinstance(v, str) else v
                    for k, v in spec["knobs"].items()
                },
                "weight_decay": spec["train"]["weight_decay"],
                "seq_len": spec["train"]["seq_len"],
                "global_batch_size": spec["train"]["global_batch_size"],
                "status": s["status"],
                "final_val_loss": s["final_val_loss"],
                "steps": s["steps"],
                "total_steps": s["total_steps"],
                "tokens_seen": s["tokens_seen"],
                "wall_seconds": s["wall_seconds"],
                "tokens_per_s": s["tokens_per_s"],
                "peak_memory_bytes": s.get("peak_memory_bytes"),
                "device": s.get("device"),
                "data_id": spec["data_id"],
                "unigram_floor": unigram_floor,
                "learned": learned(s["final_val_loss"], unigram_floor, learned_margin),
            }
        )
    if not rows:  # an empty grid (or none of it trained): the columns every reader selects
        return pd.DataFrame(columns=RUN_CONFIG_COLUMNS + ["unigram_floor", "learned"])
    return pd.DataFrame(rows).sort_values(["arch", "n_layer", "lr", "seed"], ignore_index=True)


def curve_rows(run_ids: Iterable[str], metric_paths: Iterable[str]) -> pd.DataFrame:
    frames = []
    for run_id, path in zip(run_ids, metric_paths):
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        records = [{k: v for k, v in r.items() if k != "dynamics"} for r in records]
        if records:
            df = pd.DataFrame.from_records(records)
            df.insert(0, "run_id", run_id)
            frames.append(df)
    columns = [
        "run_id",
        "step",
        "tokens",
        "train_loss",
        "val_loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
    ]
    if not frames:
        return pd.DataFrame(columns=columns)
    out = pd.concat(frames, ignore_index=True)
    for c in columns:
        if c not in out:
            out[c] = math.nan
    return out


BEST_LR_COLUMNS = GROUP_COLUMNS + [
    "ratio",
    "params",
    "params_vs_budget",
    "best_lr",
    "final_val_loss",
    "final_val_loss_std",
    "n_seeds",
    "ci_low",
    "ci_high",
    "n",
    "ci_df",
    "pooled_sd",
    "pooled_df",
    "lr_choice_sd",
    "n_lrs_tried",
    "n_diverged",
    "lr_at_edge",
]


def best_learning_rates(
    runs: pd.DataFrame, sweep_seeds: Iterable[int] | None = None, intervals: bool = True
) -> pd.DataFrame:
    """Per (architecture, shape, knobs): the LR with the lowest final validation loss among runs
    that did not diverge (seeds are averaged first, so a lucky seed does not pick the LR).

    With `sweep_seeds` (the grid's `seeds` when `seeds_at_best_lr` adds replicates at the best
    LR) the LR is chosen on the mean over those seeds only, and the statistics below are then
    over every seed at that LR: choosing on the replicates too would favour the one LR that has
    them, and reporting only the sweep's seeds would discard them.

    `final_val_loss` is that LR's mean over seeds, `final_val_loss_std` the sample standard
    deviation (ddof 1; NaN for one seed) and `n_seeds` their count. `intervals` adds the mean's
    95% interval (best_loss.with_intervals: `ci_low`, `ci_high`, `ci_df`, `n`, `pooled_sd`,
    `pooled_df`, `lr_choice_sd`) from the best-LR loss model, the seed variance pooled over the
    cells of the experiment plus the LR choice's; without them those columns are NaN (what the
    LR sweep's checkpoint needs is the choice alone). `lr_at_edge` is true when the best LR is
    the smallest or the largest LR tried for the cell (diverged runs count as tried: an LR that
    diverged bounds the grid from above), so the optimum may lie outside it.
    """
    from depthbench.analysis.best_loss import with_intervals

    ok = runs[(runs["status"] == "ok") & runs["final_val_loss"].notna()]
    if ok.empty:
        return pd.DataFrame(columns=BEST_LR_COLUMNS)
    if "params_vs_budget" not in ok:  # a runs table written before the budget columns
        ok = ok.assign(params_vs_budget=math.nan)
    per_lr = ok.groupby(GROUP_COLUMNS + ["lr"], as_index=False).agg(
        final_val_loss=("final_val_loss", "mean"),
        final_val_loss_std=("final_val_loss", "std"),
        n_seeds=("seed", "nunique"),
        ratio=("ratio", "first"),
        params=("params", "first"),
        params_vs_budget=("params_vs_budget", "first"),
    )
    choice = ok if sweep_seeds is None else ok[ok["seed"].isin(list(sweep_seeds))]
    chosen = choice.groupby(GROUP_COLUMNS + ["lr"], as_index=False)["final_val_loss"].mean()
    chosen = chosen.loc[chosen.groupby(GROUP_COLUMNS)["final_val_loss"].idxmin()]
    best = per_lr.merge(chosen[GROUP_COLUMNS + ["lr"]], on=GROUP_COLUMNS + ["lr"]).rename(
        columns={"lr": "best_lr"}
    )
    tried = (
        runs.groupby(GROUP_COLUMNS)
        .agg(
            n_lrs_tried=("lr", "nunique"),
            n_diverged=("status", lambda s: int((s == "diverged").sum())),
            lr_min=("lr", "min"),
            lr_max=("lr", "max"),
        )
        .reset_index()
    )
    out = best.merge(tried, on=GROUP_COLUMNS)
    out["lr_at_edge"] = (out["best_lr"] == out["lr_min"]) | (out["best_lr"] == out["lr_max"])
    out = with_intervals(out, runs) if intervals else out.reindex(columns=BEST_LR_COLUMNS)
    return out[BEST_LR_COLUMNS].sort_values(["arch", "ratio"], ignore_index=True)


def best_lr_run_ids(runs: pd.DataFrame, best: pd.DataFrame, run_ids: Iterable[str]) -> list[str]:
    """The grid's runs that `probes.runs: best_lr` / `nll.runs: best_lr` evaluate: every seed of
    each (arch, shape, knobs) cell at the cell's best learning rate (`best_learning_rates`), that
    finished (status ok), in the grid's order. The figures and claims read only these runs' probe
    and NLL rows, so the other learning rates' evaluation jobs would be work nobody reads."""
    keys = ["arch", "n_layer", "d_model", "knobs"]
    if runs.empty or best.empty:
        return []
    chosen = runs[runs["status"] == "ok"].merge(best[keys + ["best_lr"]], on=keys)
    picked = set(chosen.loc[np.isclose(chosen["lr"], chosen["best_lr"]), "run_id"])
    return [run_id for run_id in run_ids if run_id in picked]


def replicate_run_ids(
    runs: pd.DataFrame, best: pd.DataFrame, replicates: dict[str, dict[str, object]]
) -> list[str]:
    """The replicate runs (`seeds_at_best_lr`) that exist once the LR sweep is done: those of the
    sweep runs at each cell's best LR, `replicates` mapping a sweep run id at the first seed to
    its replicates' ids (depthbench.grid.expand.replicate_runs), in the grid's order."""
    keys = ["arch", "n_layer", "d_model", "knobs"]
    if runs.empty or best.empty:
        return []
    chosen = runs.merge(best[keys + ["best_lr"]], on=keys)
    at_best = set(chosen.loc[np.isclose(chosen["lr"], chosen["best_lr"]), "run_id"])
    return [rid for sweep_id, ids in replicates.items() if sweep_id in at_best for rid in ids]


def lr_sweep_run_ids(path: str | Path, columns: Iterable[str]) -> set[str]:
    """The run ids that the lr_sweep checkpoint's table at `path` lists under `columns`
    (`sweep_run_ids`: the sweep's runs at each cell's best LR; `replicate_run_ids`: the
    replicates those call for)."""
    table = pd.read_parquet(path, columns=list(columns))
    return {run_id for column in table for ids in table[column] for run_id in ids}


def write_parquet(df: pd.DataFrame, path: str | Path) -> None:
    atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


RUN_CONFIG_COLUMNS = [
    "run_id",
    "experiment",
    "arch",
    "n_layer",
    "d_model",
    "ratio",
    "params",
    "lr",
    "seed",
    "knobs",
    "final_val_loss",
    "status",
]


def dynamics_rows(run_ids: Iterable[str], metric_paths: Iterable[str]) -> pd.DataFrame:
    """Tidy rows (run_id, step, quantity, index, name, value) of the training-time dynamics."""
    rows = []
    for run_id, path in zip(run_ids, metric_paths):
        for line in Path(path).read_text().splitlines():
            if '"dynamics"' not in line:
                continue
            dyn = json.loads(line)["dynamics"]
            step = dyn["after_updates"]
            for quantity in ("residual_rms", "grad_norm_h", "param_grad_norm"):
                offset = 1 if quantity == "param_grad_norm" else 0  # layers 1..L; h_l from 0
                for i, v in enumerate(dyn[quantity]):
                    rows.append(
                        {
                            "run_id": run_id,
                            "step": step,
                            "quantity": quantity,
                            "index": i + offset,
                            "name": "",
                            "value": v,
                        }
                    )
            for name, v in dyn["norm_factor"].items():
                rows.append(
                    {
                        "run_id": run_id,
                        "step": step,
                        "quantity": "norm_factor",
                        "index": -1,
                        "name": name,
                        "value": v,
                    }
                )
    return pd.DataFrame(rows, columns=["run_id", "step", "quantity", "index", "name", "value"])
