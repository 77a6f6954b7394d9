"""Rows of pretrained runs in the runs table, beside trained runs
(depthbench.analysis.tables.run_rows).

A pretrained run has no recipe: lr is NaN, seed -1, no knobs, no training steps, status
'pretrained' (so that best_learning_rates, which takes status 'ok' runs only, leaves it out, and
every probe and NLL row of it gets is_best_lr False). arch is the family name (llama, qwen3, ...),
params the parameters as stored (a tied LM head counted once).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import pandas as pd


def pretrained_run_rows(summary_paths: Iterable[str], experiment: str) -> pd.DataFrame:
    rows = []
    for path in summary_paths:
        s = json.loads(Path(path).read_text())
        rows.append(
            {
                "run_id": s["run_id"],
                "experiment": experiment,
                "arch": s["arch"],
                "n_layer": s["n_layer"],
                "d_model": s["d_model"],
                "ratio": s["d_model"] / s["n_layer"],
                "d_ff": s["d_ff"],
                "n_head": s["n_head"],
                "n_kv_head": s["n_kv_head"],
                "params": s["n_params"],
                "lr": math.nan,
                "seed": -1,
                "knobs": "{}",
                "status": s["status"],
                "final_val_loss": math.nan,
                "steps": 0,
                "total_steps": 0,
                "tokens_seen": 0,
                "pretrained_name": s["name"],
                "pretrained_source": s["source"],
                "transformers_class": s["transformers_class"],
                # the unigram floor is the DepthBench tokenizer's: it does not apply to another
                # vocabulary
                "unigram_floor": math.nan,
            }
        )
    return pd.DataFrame(rows)


def with_pretrained(runs: pd.DataFrame, pretrained: pd.DataFrame) -> pd.DataFrame:
    """The runs table with the pretrained rows appended (columns a side lacks left empty)."""
    if pretrained.empty:
        return runs
    if runs.empty:
        return pretrained.reset_index(drop=True)
    return pd.concat([runs, pretrained], ignore_index=True)
