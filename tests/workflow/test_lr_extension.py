"""The LR sweep extending itself through the lr_sweep checkpoint, end to end: one cell of two
learning rates whose best is at an edge gets the next LR past it in a second round, replicates
train only once the round settles it (test_lr_rounds checks that a grid widened by hand to that
LR names the same run)."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from tests.workflow_runs import copy_workflow, grid, job_counts, snakemake
from tests.workflow_runs import write_config

pytestmark = pytest.mark.slow


def one_cell(wiki_jsonl, **overrides) -> dict:
    """pre_ln at L = 1 over LRs 1e-3 and 3e-3 (either wins: two LRs put the best at an edge), a
    replicate at the best LR, no probes, NLL or removal: only the sweep's rounds and the
    tables."""
    off = {"enabled": False}
    config = grid(
        wiki_jsonl,
        architectures=["pre_ln"],
        shapes=[{"n_layer": 1}],
        learning_rates=[1e-3, 3e-3],
        seeds_at_best_lr=2,
        lr_sweep={"max_extensions": 2},
        probes=off,
        nll=off,
        removal=off,
    )
    config["train"]["tokens_per_param"] = 0.1  # 40 steps: the rounds need losses, not learning
    config.update(overrides)
    return config


def test_the_sweep_extends_past_its_edge_then_replicates_the_bracketed_best(wiki_jsonl, tmp_path):
    root = copy_workflow(tmp_path)
    write_config(root, one_cell(wiki_jsonl))
    proc = snakemake(root, "--until", "tables")
    log = proc.stdout + proc.stderr
    assert job_counts(log).get("train") == 2  # the plan before any job: the grid's two LRs
    rounds = sorted((root / "results/tables/lr_sweep").glob("round*.parquet"))
    first = pd.read_parquet(rounds[0]).iloc[0]
    assert first["lr_at_edge"] and not first["settled"] and len(first["next_run_ids"]) == 1
    (called,) = first["next_run_ids"]
    past = {1e-3: "lr0.0003333_", 3e-3: "lr0.009_"}[first["best_lr"]]  # the grid's ratio, 3
    assert past in called
    last = pd.read_parquet(rounds[-1]).iloc[0]
    assert last["settled"] and len(rounds) == 1 + last["n_lrs_tried"] - 2
    runs = pd.read_parquet(root / "results/tables/runs.parquet")
    assert called in set(runs.run_id)
    (replica,) = runs[runs.seed == 1].itertuples()
    assert list(last["replicate_run_ids"]) == [replica.run_id] and replica.lr == last["best_lr"]
    trains = [m.start() for m in re.finditer(r"^(?:local)?rule train:", log, re.M)]
    sweeps = [m.start() for m in re.finditer(r"^(?:local)?checkpoint lr_sweep:", log, re.M)]
    assert len(sweeps) == len(rounds) and trains[-1] > sweeps[-1]  # the replicate after them
    best = pd.read_parquet(root / "results/tables/best_lr.parquet").iloc[0]
    tried = sorted(runs[runs.seed == 0].lr)
    assert best["best_lr"] == last["best_lr"] and best["n"] == 2
    assert bool(best["lr_at_edge"]) == (best["best_lr"] in (tried[0], tried[-1]))
