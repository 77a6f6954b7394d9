"""Every table stage's script finishes, with the rows it should have, on degenerate grids: every
run diverged, a single run, a single shape, no run with outputs."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from depthbench.grid.config import expand_grid
from tests.conftest import REPO
from tests.run_outputs import fake_summary, grid_config


class _Files(list):
    """A Snakemake-like named file list: indexable, and with attributes."""

    def __init__(self, items=(), **named):
        super().__init__(items or named.values())
        self.__dict__.update(named)


def _run_script(name: str, **parts) -> None:
    runpy.run_path(
        str(REPO / "scripts" / name), init_globals={"snakemake": SimpleNamespace(**parts)}
    )


def _degenerate(wiki_jsonl, kind):
    if kind == "all_diverged":
        exp = expand_grid(
            grid_config(
                wiki_jsonl,
                architectures=["pre_ln", "post_ln"],
                shapes=[{"n_layer": 1}, {"n_layer": 2}],
                learning_rates=[50.0, 80.0],
            )
        )
        return exp, {rid: "diverged" for rid in exp.runs}
    if kind == "single_run":
        exp = expand_grid(grid_config(wiki_jsonl))
        return exp, {rid: "ok" for rid in exp.runs}
    if kind == "single_shape":
        exp = expand_grid(
            grid_config(
                wiki_jsonl, architectures=["pre_ln", "post_ln"], learning_rates=[3e-3, 50.0]
            )
        )
        return exp, {rid: "diverged" if "_lr50_" in rid else "ok" for rid in exp.runs}
    exp = expand_grid(grid_config(wiki_jsonl))
    return exp, {}  # empty: no run of the grid has outputs to aggregate


@pytest.mark.parametrize("kind", ["all_diverged", "single_run", "single_shape", "empty"])
def test_every_table_stage_finishes_on_degenerate_grids(wiki_jsonl, tmp_path, kind):
    from depthbench.data.shards import META_VERSION

    exp, statuses = _degenerate(wiki_jsonl, kind)
    res = tmp_path / "results"
    data = res / "data" / "meta.json"
    data.parent.mkdir(parents=True)
    data.write_text(json.dumps({"version": META_VERSION, "unigram_val_loss": 6.0}))
    specs = [exp.runs[rid] for rid in statuses]
    summaries = [str(fake_summary(res, s, statuses[s.run_id])) for s in specs]
    metrics = [str(Path(p).with_name("metrics.jsonl")) for p in summaries]
    probes, nll = [], []
    for s in specs:
        trained = statuses[s.run_id] == "ok"
        p = res / "probes" / f"{s.run_id}.parquet"
        p.parent.mkdir(exist_ok=True)
        pd.DataFrame(
            {
                "run_id": s.run_id,
                "probe": ["causal_score"] * (1 + trained),
                "stage": ["init", "trained"][: 1 + trained],
                "i": 0,
                "j": 0,
                "value": 0.5,
                "status": statuses[s.run_id],
            }
        ).to_parquet(p)
        n = res / "nll" / f"{s.run_id}.parquet"
        n.parent.mkdir(exist_ok=True)
        pd.DataFrame(
            {
                "run_id": s.run_id,
                "level": ["set", "domain"],
                "set": ["gsm8k", ""],
                "domain": ["math", "math"],
                "nats_per_token": 2.0 if trained else math.nan,
                "bits_per_byte": 1.0 if trained else math.nan,
                "status": statuses[s.run_id],
            }
        ).to_parquet(n)
        probes.append(str(p))
        nll.append(str(n))
    tables = res / "tables"
    out = _Files(
        runs=str(tables / "runs.parquet"),
        curves=str(tables / "curves.parquet"),
        best_lr=str(tables / "best_lr.parquet"),
        dynamics=str(tables / "dynamics.parquet"),
    )
    hashes = {s.run_id: s.spec_hash() for s in specs}
    log = _Files([str(tmp_path / "log.txt")])
    _run_script(
        "tables.py",
        input=_Files(summaries=summaries, metrics=metrics, data=str(data), pretrained=[]),
        output=out,
        log=log,
        params=SimpleNamespace(
            experiment="tiny",
            spec_hashes=hashes,
            sweep_seeds=[0],
            budget_params=None,
            learned_margin=0.1,
        ),
    )
    made = {}
    # a removal file per run: no rows for a diverged run (depthbench.probes.removal_run)
    removal = []
    for s in specs:
        r = res / "removal" / f"{s.run_id}.parquet"
        r.parent.mkdir(exist_ok=True)
        rows = (
            [
                {
                    "ranking": "last",
                    "draw": 0,
                    "k": k,
                    "fraction": k / 2,
                    "removed": "",
                    "domain": "val",
                    "loss": 2.0 + k,
                    "full_loss": 2.0,
                    "change": k / 2,
                }
                for k in (0, 1)
            ]
            if statuses[s.run_id] == "ok"
            else []
        )
        pd.DataFrame(
            rows,
            columns=[
                "ranking",
                "draw",
                "k",
                "fraction",
                "removed",
                "domain",
                "loss",
                "full_loss",
                "change",
            ],
        ).assign(run_id=s.run_id, status=statuses[s.run_id]).to_parquet(r)
        removal.append(str(r))
    for script, extra, target, outputs in (
        ("cost_table.py", {"summaries": summaries, "pretrained": []}, "cost", ("cost",)),
        ("probes_table.py", {"probes": probes}, "probes", ("probes", "lens")),
        ("nll_table.py", {"nll": nll}, "nll", ("nll",)),
        ("removal_table.py", {"removal": removal}, "removal", ("removal", "effective_depth")),
    ):
        paths = {name: str(tables / f"{name}.parquet") for name in outputs}
        _run_script(
            script,
            input=_Files(**extra, runs=out.runs, best_lr=out.best_lr),
            output=_Files(**paths),
            log=log,
            params=SimpleNamespace(spec_hashes=hashes, seq_len=32, tolerance=0.05),
        )
        made.update({name: pd.read_parquet(path) for name, path in paths.items()})
    runs, best = pd.read_parquet(out.runs), pd.read_parquet(out.best_lr)
    assert sorted(runs.run_id) == sorted(statuses)
    n_ok = sum(v == "ok" for v in statuses.values())
    groups = {(s.arch, s.shape.n_layer) for s in specs if statuses[s.run_id] == "ok"}
    assert len(best) == len(groups) and (n_ok == 0) == best.empty
    assert sorted(made["cost"].get("run_id", pd.Series(dtype=str))) == sorted(statuses)
    assert sorted(set(made["probes"].run_id)) == sorted(statuses) and "is_best_lr" in made["probes"]
    assert sorted(set(made["nll"].run_id)) == sorted(statuses) and "arch" in made["nll"]
    if n_ok:
        assert made["probes"][made["probes"].stage == "trained"].is_best_lr.all()
    ok = sorted(r for r, v in statuses.items() if v == "ok")
    assert (
        sorted(set(made["removal"].get("run_id", []))) == ok
        and sorted(made["effective_depth"].get("run_id", [])) == ok
    )
