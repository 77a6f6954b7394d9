"""The LR sweep's rounds: what the lr_sweep checkpoint decides each time it reads the sweep.

Round 0 reads the grid's runs (every learning rate at the sweep's seeds); round k reads those and
every extension an earlier round called for. Per cell (its ladder of learning rates,
depthbench.grid.extend.ladders) a round takes the rungs whose runs it read as tried, the best
one by the mean final validation loss of its finished runs (diverged runs count as tried but
cannot be best, so an LR that diverged bounds the sweep), and:

- when the best is the lowest or the highest LR tried, the ladder has an LR past it and the
  round is below `lr_sweep.max_extensions`, it calls that LR's runs (`next_run_ids`): the next
  round reads them;
- otherwise the cell is settled: its best LR is bracketed, or its extensions are spent (still
  at an edge, `lr_at_edge`), or no run of it finished. A settled cell lists the sweep's
  finished runs at its best LR (`sweep_run_ids`) and the replicates seeds_at_best_lr adds there
  (`replicate_run_ids`): replicates train only once a cell's best LR is settled.

A round can only move a cell's best to the LR it added, so a cell extends on one side only, at
most max_extensions times, and the sweep ends at the first round that calls nothing
(`last_round`). Each round's table lists every cell (columns `ROUND_COLUMNS`), `tried_run_ids`
holding every sweep run read so far.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

ROUND_COLUMNS = [
    "arch",
    "n_layer",
    "d_model",
    "knobs",
    "best_lr",
    "final_val_loss",
    "lr_at_edge",
    "n_lrs_tried",
    "settled",
    "tried_run_ids",
    "next_run_ids",
    "sweep_run_ids",
    "replicate_run_ids",
]


def _cell_row(cell: dict, runs: dict, round_: int, max_extensions: int, replicates: dict) -> dict:
    rungs = cell["rungs"]
    tried = [i for i, r in enumerate(rungs) if all(rid in runs for rid in r["run_ids"])]
    loss = {}
    for i in tried:
        finished = [runs[rid] for rid in rungs[i]["run_ids"] if runs[rid] == runs[rid]]
        loss[i] = float(np.mean(finished)) if finished else math.nan
    ok = [i for i in tried if loss[i] == loss[i]]
    row = {k: cell[k] for k in ("arch", "n_layer", "d_model", "knobs")}
    row |= {
        "n_lrs_tried": len(tried),
        "tried_run_ids": [r for i in tried for r in rungs[i]["run_ids"]],
    }
    if not ok:
        return row | {"best_lr": math.nan, "final_val_loss": math.nan, "lr_at_edge": False,
                      "settled": True, "next_run_ids": [], "sweep_run_ids": [],
                      "replicate_run_ids": []}  # fmt: skip
    best = min(ok, key=lambda i: loss[i])
    low, high = min(tried), max(tried)
    step = -1 if best == low else 1 if best == high else 0
    nxt = best + step if step and 0 <= best + step < len(rungs) else None
    if round_ >= max_extensions or (nxt is not None and nxt in tried):
        nxt = None
    at_best = [rid for rid in rungs[best]["run_ids"] if runs[rid] == runs[rid]]
    settled = nxt is None
    reps = [r for rid in rungs[best]["run_ids"] for r in replicates.get(rid, [])] if settled else []
    return row | {
        "best_lr": float(rungs[best]["lr"]),
        "final_val_loss": loss[best],
        "lr_at_edge": best in (low, high),
        "settled": settled,
        "next_run_ids": [] if settled else list(rungs[nxt]["run_ids"]),
        "sweep_run_ids": at_best if settled else [],
        "replicate_run_ids": reps,
    }


def sweep_round(
    runs: pd.DataFrame, ladders: list[dict], round_: int, max_extensions: int, replicates: dict
) -> pd.DataFrame:
    """One round's table from the runs it read (runs.parquet rows: run_id, status,
    final_val_loss), the grid's ladders, the round's number, `lr_sweep.max_extensions` and
    {sweep run id: [its replicates' ids]}."""
    finished = runs["status"].eq("ok") & runs["final_val_loss"].notna()
    loss = dict(zip(runs["run_id"], runs["final_val_loss"].where(finished, math.nan)))
    rows = [_cell_row(c, loss, round_, max_extensions, replicates) for c in ladders]
    return pd.DataFrame(rows, columns=ROUND_COLUMNS)


def calls(path: str | Path) -> bool:
    """Whether the round's table at `path` calls for another round."""
    table = pd.read_parquet(path, columns=["next_run_ids"])
    return any(len(ids) for ids in table["next_run_ids"])


def round_path(folder: str | Path, k: int) -> Path:
    return Path(folder) / f"round{k}.parquet"


def last_round(folder: str | Path, max_extensions: int) -> Path | None:
    """The sweep's last round among the tables in `folder` (the first that calls nothing, or
    round max_extensions), or None while one it needs is missing."""
    for k in range(max_extensions + 1):
        path = round_path(folder, k)
        if not path.exists():
            return None
        if k == max_extensions or not calls(path):
            return path
    return None
