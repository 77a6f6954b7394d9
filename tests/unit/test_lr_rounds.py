"""The LR sweep's extensions (depthbench.grid.extend) and rounds (depthbench.analysis.lr_rounds):
the LRs past an edge on the grid's spacing, run ids that a grid widened by hand reuses, and what
each round calls for or settles; `depthbench plan` and `validate` count the extensions."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from depthbench.analysis.lr_rounds import ROUND_COLUMNS, last_round, round_path, sweep_round
from depthbench.grid.extend import extension_lr
from tests.run_outputs import grid_config


def test_extension_lrs_follow_the_grids_spacing_at_each_edge():
    lrs = [2e-3, 5e-3, 1.25e-2]
    assert [extension_lr(lrs, 1, k) for k in (1, 2)] == [0.03125, 0.07812]  # x2.5, 4 digits
    assert [extension_lr(lrs, -1, k) for k in (1, 2)] == [8e-4, 3.2e-4]
    assert extension_lr([1e-3, 2e-3, 8e-3], 1, 1) == 0.032  # the top edge's own ratio, 4


def test_extension_runs_are_the_runs_of_a_grid_widened_by_hand(wiki_jsonl):
    """An extension's run id is the one the same LR gets when written into the grid, so a grid
    widened later reuses the extension's training."""
    from depthbench.grid.config import expand_grid

    config = grid_config(wiki_jsonl, learning_rates=[2e-3, 5e-3], lr_sweep={"max_extensions": 2})
    config["seeds"] = [0, 1]
    exp = expand_grid(config)
    assert len(exp.extensions) == 2 * 2 * 2  # two sides x two steps x two sweep seeds
    assert sorted({s.lr for s in exp.extensions.values()}) == [3.2e-4, 8e-4, 0.0125, 0.03125]
    wide = expand_grid({**config, "learning_rates": [8e-4, 2e-3, 5e-3, 0.0125]})
    for run_id, spec in exp.extensions.items():
        if spec.lr in (8e-4, 0.0125):
            assert run_id in wide.runs
    assert not expand_grid({**config, "lr_sweep": {"max_extensions": 0}}).extensions
    one = expand_grid({**config, "learning_rates": [2e-3]})
    assert not one.extensions  # one LR: no spacing to extend by


def ladder(*rungs, grid=(1, 2, 3)) -> list[dict]:
    """One cell whose rungs are LRs 1..n (x1e-3), one run each, those in `grid` the grid's."""
    return [
        {"arch": "a", "n_layer": 2, "d_model": 64, "knobs": "{}"}
        | {"rungs": [{"lr": i * 1e-3, "run_ids": [f"r{i}"], "grid": i in grid} for i in rungs]}
    ]


def runs(**loss) -> pd.DataFrame:
    """Runs r{i} with the given final losses (NaN: diverged)."""
    return pd.DataFrame(
        {
            "run_id": list(loss),
            "status": ["diverged" if v != v else "ok" for v in loss.values()],
            "final_val_loss": list(loss.values()),
        }
    )


REPLICAS = {f"r{i}": [f"r{i}_s1"] for i in range(6)}


def test_a_round_extends_past_the_edge_that_wins_and_settles_a_bracketed_cell():
    cell = ladder(0, 1, 2, 3, 4, 5)  # grid 1..3, extensions 0 below and 4, 5 above
    top = sweep_round(runs(r1=4.3, r2=4.2, r3=4.1), cell, 0, 2, REPLICAS).iloc[0]
    assert list(top.index) == ROUND_COLUMNS
    assert top["lr_at_edge"] and not top["settled"] and list(top["next_run_ids"]) == ["r4"]
    assert list(top["replicate_run_ids"]) == []  # replicates wait for the bracket
    again = sweep_round(runs(r1=4.3, r2=4.2, r3=4.1, r4=4.15), cell, 1, 2, REPLICAS).iloc[0]
    assert again["best_lr"] == 3e-3 and not again["lr_at_edge"] and again["settled"]
    assert list(again["sweep_run_ids"]) == ["r3"] and list(again["replicate_run_ids"]) == ["r3_s1"]
    assert list(again["tried_run_ids"]) == ["r1", "r2", "r3", "r4"]
    low = sweep_round(runs(r1=4.0, r2=4.2, r3=4.1), cell, 0, 2, REPLICAS).iloc[0]
    assert list(low["next_run_ids"]) == ["r0"]  # the bottom edge won


def test_a_cell_still_at_an_edge_when_its_extensions_are_spent_is_settled_and_marked():
    cell = ladder(1, 2, 3, 4)
    spent = sweep_round(runs(r1=4.3, r2=4.2, r3=4.1, r4=4.0), cell, 1, 1, REPLICAS).iloc[0]
    assert spent["settled"] and spent["lr_at_edge"] and spent["best_lr"] == 4e-3
    assert list(spent["replicate_run_ids"]) == ["r4_s1"]
    end = sweep_round(runs(r1=4.3, r2=4.2, r3=4.1, r4=4.0), cell, 1, 2, REPLICAS).iloc[0]
    assert end["settled"] and end["lr_at_edge"]  # no LR past r4 in the ladder


def test_a_diverged_lr_bounds_the_sweep_and_an_all_diverged_cell_settles_without_a_best():
    cell = ladder(1, 2, 3)
    bounded = sweep_round(runs(r1=4.3, r2=4.1, r3=math.nan), cell, 0, 2, REPLICAS).iloc[0]
    assert bounded["best_lr"] == 2e-3 and not bounded["lr_at_edge"] and bounded["settled"]
    nan = math.nan
    dead = sweep_round(runs(r1=nan, r2=nan, r3=nan), cell, 0, 2, REPLICAS).iloc[0]
    assert dead["settled"] and math.isnan(dead["best_lr"]) and list(dead["next_run_ids"]) == []


def test_the_last_round_is_the_first_that_calls_nothing(tmp_path):
    cell = ladder(1, 2, 3, 4)
    first = sweep_round(runs(r1=4.3, r2=4.2, r3=4.1), cell, 0, 2, REPLICAS)
    first.to_parquet(round_path(tmp_path, 0))
    assert last_round(tmp_path, 2) is None  # round 1 is still to come
    sweep_round(runs(r1=4.3, r2=4.2, r3=4.1, r4=4.2), cell, 1, 2, REPLICAS).to_parquet(
        round_path(tmp_path, 1)
    )
    assert last_round(tmp_path, 2) == round_path(tmp_path, 1)
    assert last_round(tmp_path, 0) == round_path(tmp_path, 0)  # no extensions: round 0


@pytest.mark.parametrize("max_extensions", [0, 2])
def test_plan_and_validate_count_the_extensions_at_most(wiki_jsonl, max_extensions, capsys):
    from depthbench.commands.plan import format_plan, plan_experiment
    from depthbench.grid.config import expand_grid

    config = grid_config(
        wiki_jsonl,
        architectures=["pre_ln", "hc"],
        learning_rates=[2e-3, 5e-3],
        lr_sweep={"max_extensions": max_extensions},
    )
    plans = plan_experiment(expand_grid(config))
    assert len(plans.extensions) == 2 * max_extensions  # 2 cells, one side each
    text = format_plan(plans, "H100", 0.4, 80e9)
    assert (f"at most {2 * max_extensions} runs" in text) == bool(max_extensions)
