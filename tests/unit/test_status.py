"""`depthbench status`: each run's state (trained, diverged, partial, stale, invalid, missing) and
the jobs Snakemake would run next; with best-LR evaluation, only the best runs are named."""

from __future__ import annotations

import os

import pandas as pd

from tests.conftest import status_grid, tiny_config
from tests.run_outputs import fake_summary, save_step


def test_status_reports_each_run_and_the_next_jobs(wiki_jsonl, tmp_path, capsys):
    from depthbench.commands.cli import main

    config = tiny_config(
        wiki_jsonl, architectures=["pre_ln", "post_ln", "peri_ln"], learning_rates=[3e-3, 50.0]
    )
    cfg, exp, res = status_grid(config, tmp_path)
    ids = list(exp.runs)
    trained, diverged, partial, stale_time, copied, missing = ids
    for rid in ids[:5]:
        fake_summary(res, exp.runs[rid], "diverged" if rid == diverged else "ok")
    (res / "probes").mkdir()
    (res / "probes" / f"{trained}.parquet").write_bytes(b"x")
    (res / "runs" / partial / "summary.json").unlink()
    save_step(res / "work" / partial / "checkpoints", 4, partial)
    os.utime(res / "runs" / stale_time / "summary.json", (1e8, 1e8))  # older than the shards
    (res / "runs" / copied / "summary.json").write_text(
        (res / "runs" / trained / "summary.json").read_text()
    )
    assert main(["status", str(cfg), "--results", str(res)]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.split() and line.split()[0] in ids
    }
    assert rows[trained] == ["trained", "yes", "-", "-"]
    assert rows[diverged] == ["diverged", "no", "-", "probe"]
    assert rows[partial] == ["partial", "no", "-", "train", "(resume),", "probe"]
    assert rows[stale_time][:2] == ["stale", "no"] and rows[missing][0] == "missing"
    assert rows[copied][:4] == ["invalid", "no", "-", "none:"]  # snakemake would not retrain it
    assert (
        "belongs to run" in out and "older than its input" in out and "checkpoint at step 4" in out
    )
    assert "train: 2 runs" in out and "train (resume): 1 run" in out and "probe: 5 runs" in out
    assert "tables: fail on 1 invalid summary" in out


def test_status_with_best_lr_evaluation_names_only_the_best_runs(wiki_jsonl, tmp_path, capsys):
    from depthbench.commands.cli import main
    from depthbench.analysis.tables import best_learning_rates

    config = tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2])
    config["probes"] = {"runs": "best_lr"}
    cfg, exp, res = status_grid(config, tmp_path)
    low, high = sorted(exp.runs, key=lambda rid: exp.runs[rid].lr)
    for rid in (low, high):
        fake_summary(res, exp.runs[rid])

    def rows():
        assert main(["status", str(cfg), "--results", str(res)]) == 0
        out = capsys.readouterr().out
        return {
            line.split()[0]: line.split()[1:3]
            for line in out.splitlines()
            if line.split() and line.split()[0] in (low, high)
        }

    assert rows() == {low: ["trained", "later"], high: ["trained", "later"]}  # no best_lr table yet
    runs = pd.DataFrame(
        [
            {
                "run_id": rid,
                "experiment": "tiny",
                "arch": s.arch,
                "n_layer": s.shape.n_layer,
                "d_model": s.shape.d_model,
                "knobs": "{}",
                "ratio": 1.0,
                "params": 1,
                "params_vs_budget": 0.0,
                "lr": s.lr,
                "seed": s.seed,
                "status": "ok",
                "final_val_loss": 4.0 if rid == high else 4.5,
            }
            for rid, s in exp.runs.items()
        ]
    )
    (res / "tables").mkdir()
    runs.to_parquet(res / "tables" / "runs.parquet")
    best_learning_rates(runs).to_parquet(res / "tables" / "best_lr.parquet")
    assert rows() == {low: ["trained", "-"], high: ["trained", "no"]}  # only the best LR is probed


def test_status_marks_trained_runs_that_did_not_learn(wiki_jsonl, tmp_path, capsys):
    """A run whose final loss is not analysis.learned_margin below the unigram floor is at-floor,
    with the reason; a larger floor distance, or a smaller margin, leaves it trained."""
    import json

    from depthbench.commands.cli import main
    from depthbench.data.shards import META_VERSION

    config = tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2])
    cfg, exp, res = status_grid(config, tmp_path)
    stuck, learned = sorted(exp.runs, key=lambda rid: exp.runs[rid].lr)
    fake_summary(res, exp.runs[stuck], final_val_loss=5.95)  # 0.05 below the floor
    fake_summary(res, exp.runs[learned], final_val_loss=5.5)
    meta = res / "data" / exp.data_id / "meta.json"
    meta.write_text(json.dumps({"version": META_VERSION, "unigram_val_loss": 6.0}))
    os.utime(meta, (1e9, 1e9))

    def states(config_file):
        assert main(["status", str(config_file), "--results", str(res)]) == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line.split()[1] for line in out.split("\n") if line.split()}
        return {stuck: rows[stuck], learned: rows[learned]}, out

    got, out = states(cfg)
    assert got == {stuck: "at-floor", learned: "trained"}
    assert (
        "did not learn: final validation loss 5.950 is not 0.1 nats below the unigram floor "
        "6.000 (analysis.learned_margin)" in out
    )
    assert "2 runs: 1 at-floor, 1 trained" in out
    narrow = tmp_path / "narrow.yaml"
    narrow.write_text(cfg.read_text() + "analysis: {learned_margin: 0.01}\n")
    assert states(narrow)[0] == {stuck: "trained", learned: "trained"}


def test_status_lists_replicates_once_the_lr_sweep_has_chosen_them(wiki_jsonl, tmp_path, capsys):
    """seeds_at_best_lr: while the sweep's table is missing, status says replicates follow the
    sweep and lists none; once its last round (results/tables/lr_sweep/round0.parquet, no
    extensions) names one, it is a run of the grid (missing, to train) and the plan counts it."""
    from depthbench.commands.cli import main

    config = tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2], seeds_at_best_lr=2)
    config["probes"] = {"runs": "best_lr"}
    cfg, exp, res = status_grid(config, tmp_path)
    for rid in exp.runs:
        fake_summary(res, exp.runs[rid])
    assert main(["status", str(cfg), "--results", str(res)]) == 0
    out = capsys.readouterr().out
    assert "2 runs: 2 trained" in out and "once every run of the LR sweep has trained" in out
    sweep_id = min(exp.runs, key=lambda rid: exp.runs[rid].lr)
    (replica,) = exp.replicates[sweep_id]
    (res / "tables" / "lr_sweep").mkdir(parents=True)
    other = max(exp.runs, key=lambda rid: exp.runs[rid].lr)
    assert "later" in out  # the best-LR probes wait for the sweep's table
    pd.DataFrame(
        {"best_lr": [3e-3], "tried_run_ids": [list(exp.runs)], "next_run_ids": [[]]}
        | {"sweep_run_ids": [[sweep_id]], "replicate_run_ids": [[replica]]}
    ).to_parquet(res / "tables" / "lr_sweep" / "round0.parquet")
    assert main(["status", str(cfg), "--results", str(res)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.split()}
    assert rows[replica] == ["missing", "no"] and "3 runs: 1 missing, 2 trained" in out
    # the sweep's table, not best_lr.parquet, says which runs the probes take
    assert rows[sweep_id] == ["trained", "no"] and rows[other] == ["trained", "-"]
    assert "train: 1 run" in out and "LR sweep" not in out


def test_status_counts_the_extensions_still_possible_and_lists_those_called(
    wiki_jsonl, tmp_path, capsys
):
    """lr_sweep.max_extensions 2: before the sweep's rounds, at most 2 extension runs (one cell,
    one side, one seed); once round 0 calls one, it is a run to train and at most 1 more is
    possible; once round 1 settles the cell, none."""
    from depthbench.commands.cli import main

    config = tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2], lr_sweep={"max_extensions": 2})
    cfg, exp, res = status_grid(config, tmp_path)
    for rid in exp.runs:
        fake_summary(res, exp.runs[rid])
    assert main(["status", str(cfg), "--results", str(res)]) == 0
    assert "up to 2 run(s) past the edges" in capsys.readouterr().out
    called = min(
        (r for r in exp.extensions if exp.extensions[r].lr > 1e-2),
        key=lambda r: exp.extensions[r].lr,
    )
    assert exp.extensions[called].lr == 0.03333  # 1e-2 x (1e-2 / 3e-3), to 4 digits
    folder = res / "tables" / "lr_sweep"
    folder.mkdir(parents=True)
    rounds = {"tried_run_ids": [list(exp.runs)], "sweep_run_ids": [[]], "replicate_run_ids": [[]]}
    pd.DataFrame(rounds | {"next_run_ids": [[called]]}).to_parquet(folder / "round0.parquet")
    assert main(["status", str(cfg), "--results", str(res)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()}
    assert rows[called] == "missing" and "up to 1 run(s) past the edges" in out
    fake_summary(res, exp.extensions[called])
    tried = {"tried_run_ids": [[*exp.runs, called]], "next_run_ids": [[]]}
    pd.DataFrame(rounds | tried).to_parquet(folder / "round1.parquet")
    assert main(["status", str(cfg), "--results", str(res)]) == 0
    out = capsys.readouterr().out
    assert "3 runs: 3 trained" in out and "past the edges" not in out
