"""best_lr's seed interval, the cells' estimates (analysis.summaries) and the figures that draw
them: t intervals computed here from a printed t table, the run's own interval for one seed."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import LineCollection, PolyCollection

from depthbench.analysis import registry
from depthbench.analysis import summaries as SM
from depthbench.analysis.tables import best_learning_rates
from tests.analysis_tables import synthetic_tables

T975_DF2 = 4.303  # t(0.975, 2), from a printed table
CTX = registry.context({"name": "syn", "shapes": [{"n_layer": 2}], "seeds": [0, 1, 2]})


def _runs(losses: dict[tuple[str, float], list[float]]) -> pd.DataFrame:
    rows = []
    for (arch, lr), values in losses.items():
        for seed, loss in enumerate(values):
            rows.append(
                {
                    "run_id": f"{arch}_{lr}_{seed}",
                    "experiment": "syn",
                    "arch": arch,
                    "n_layer": 2,
                    "d_model": 64,
                    "ratio": 32.0,
                    "params": 1000,
                    "params_vs_budget": 0.0,
                    "knobs": "{}",
                    "lr": lr,
                    "seed": seed,
                    "status": "ok",
                    "final_val_loss": loss,
                }
            )
    return pd.DataFrame(rows)


def test_best_lr_has_the_pooled_interval_and_n():
    """pre_ln's three seeds at its best LR give the seed variance (2 df) that hc's single seed
    shares; the LR choice is clear (1.4 nats apart), so it adds nothing."""
    three = [4.0, 4.1, 4.3]
    best = best_learning_rates(
        _runs({("pre_ln", 1e-3): three, ("pre_ln", 2e-3): [5.5, 5.6, 5.4], ("hc", 1e-3): [3.9]})
    ).set_index("arch")
    pre, hc = best.loc["pre_ln"], best.loc["hc"]
    mean, sd = sum(three) / 3, math.sqrt(sum((x - sum(three) / 3) ** 2 for x in three) / 2)
    half = T975_DF2 * sd / math.sqrt(3)
    assert pre["best_lr"] == 1e-3 and pre["n"] == 3 and pre["n_seeds"] == 3
    assert pre["final_val_loss"] == pytest.approx(mean)
    assert pre["final_val_loss_std"] == pytest.approx(sd)
    assert pre["ci_low"] == pytest.approx(mean - half, abs=1e-3)
    assert pre["ci_high"] == pytest.approx(mean + half, abs=1e-3)
    assert (pre["pooled_df"], pre["ci_df"], pre["lr_choice_sd"]) == (2, 2, 0.0)
    assert hc["n"] == 1 and hc["pooled_sd"] == pytest.approx(sd)
    assert (hc["ci_low"], hc["ci_high"]) == pytest.approx(
        (3.9 - T975_DF2 * sd, 3.9 + T975_DF2 * sd), abs=1e-3
    )


def test_cells_combine_seeds_by_t_interval_and_keep_one_runs_own():
    rows = pd.DataFrame(
        {
            "arch": ["a", "a", "a", "b"],
            "n_layer": [2, 2, 2, 2],
            "d_model": [8, 8, 8, 8],
            "knobs": ["{}"] * 4,
            "value": [1.0, 1.2, 1.1, 5.0],
            "ci_low": [0.0, 0.0, 0.0, 4.5],
            "ci_high": [9.0, 9.0, 9.0, 5.4],
            "ratio": [4.0] * 4,
        }
    )
    got = SM.cells(rows, SM.CELL_KEYS).set_index("arch")
    half = T975_DF2 * np.std([1.0, 1.2, 1.1], ddof=1) / math.sqrt(3)
    assert got.loc["a", "n"] == 3 and got.loc["a", "value"] == pytest.approx(1.1)
    assert got.loc["a", "ci_low"] == pytest.approx(1.1 - half, abs=1e-3)
    assert got.loc["a", "ci_high"] == pytest.approx(1.1 + half, abs=1e-3)
    assert tuple(got.loc["b", ["value", "ci_low", "ci_high", "n"]]) == (5.0, 4.5, 5.4, 1)
    assert got.loc["b", "ratio"] == 4.0
    assert "bootstrap over x (one seed)" in SM.interval_text(got, "x")
    assert "t interval over 3 seeds" in SM.interval_text(got, "x")


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.findobj(plt.Text))


def _bars(ax) -> int:
    return sum(len(c.get_segments()) for c in ax.collections if isinstance(c, LineCollection))


def _with_seeds(tables: dict, seeds: int) -> dict:
    """Tables with every run repeated over `seeds` seeds, values shifted a little per seed, and
    a bootstrap interval of +-0.01 on every probe and NLL row."""
    runs = pd.concat(
        [
            tables["runs"].assign(
                seed=s,
                run_id=tables["runs"]["run_id"] + f"_s{s}",
                final_val_loss=tables["runs"]["final_val_loss"] + 0.01 * s,
            )
            for s in range(seeds)
        ],
        ignore_index=True,
    )
    out = {**tables, "runs": runs, "best_lr": best_learning_rates(runs)}
    for name, column in (("probes", "value"), ("nll", "bits_per_byte")):
        t = tables[name]
        out[name] = pd.concat(
            [
                t.assign(
                    seed=s, run_id=t["run_id"] + f"_s{s}", **{column: t[column] + 0.001 * s}
                ).assign(ci_low=lambda d: d[column] - 0.01, ci_high=lambda d: d[column] + 0.01)
                for s in range(seeds)
            ],
            ignore_index=True,
        )
    return out


@pytest.fixture(scope="module")
def base():
    return synthetic_tables(archs=("pre_ln", "hc"), depths=(2, 4), lrs=(2e-3,))


def test_headline_draws_the_pooled_interval_and_says_n_1(base):
    several = _with_seeds(base, 3)
    fig = registry.FIGURES["headline"].draw(several, CTX)
    sd = several["best_lr"]["pooled_sd"].iloc[0]
    assert f"seed SD {sd:.2g} pooled over the cells (8 df)" in _texts(fig)
    assert _bars(fig.axes[0]) == 4
    plt.close(fig)
    one = registry.FIGURES["headline"].draw(_with_seeds(base, 1), CTX)
    assert "n=1 in every cell" in _texts(one) and _bars(one.axes[0]) == 0
    plt.close(one)
    # one cell of a single seed among cells of three: its point says n=1, and its bar is the
    # pooled seed variance's
    runs = several["runs"]
    drop = (runs["arch"] == "hc") & (runs["n_layer"] == 2) & (runs["seed"] > 0)
    mixed = {**several, "runs": runs[~drop], "best_lr": best_learning_rates(runs[~drop])}
    fig = registry.FIGURES["headline"].draw(mixed, CTX)
    said = [t.get_text() for t in fig.axes[0].texts]
    assert said.count("n=1") == 1 and _bars(fig.axes[0]) == 4
    assert "; n=1: one seed" in _texts(fig)
    plt.close(fig)


@pytest.mark.parametrize("seeds, what", [(1, "bootstrap over"), (3, "t interval over 3 seeds")])
def test_probe_and_nll_figures_draw_the_intervals_and_say_what_they_are(base, seeds, what):
    tables = _with_seeds(base, seeds)
    for name, kind in (
        ("probe_shares", LineCollection),
        ("nll_vs_ratio", LineCollection),
        ("angular_adjacent", PolyCollection),
        ("usefulness", PolyCollection),
        ("token_similarity", PolyCollection),
    ):
        fig = registry.FIGURES[name].draw(tables, CTX)
        drawn = [c for ax in fig.axes for c in ax.collections if isinstance(c, kind)]
        assert drawn, name
        assert "95% interval: " + what in _texts(fig), name
        plt.close(fig)


def test_figures_of_tables_without_interval_columns_say_so(base):
    tables = {**base, "best_lr": base["best_lr"].drop(columns=["ci_low", "ci_high"])}
    fig = registry.FIGURES["headline"].draw(tables, CTX)
    assert "no interval columns in best_lr" in _texts(fig) and _bars(fig.axes[0]) == 0
    plt.close(fig)
    fig = registry.FIGURES["probe_shares"].draw(tables, CTX)
    assert "no intervals in the table" in _texts(fig)
    plt.close(fig)


def test_headline_crosses_the_cells_that_did_not_learn(base):
    """A cell whose best-LR runs are `learned: false` gets a cross and the title says what it
    means; without such a cell there is neither."""
    runs = base["runs"].assign(learned=True)
    fig = registry.FIGURES["headline"].draw({**base, "runs": runs}, CTX)
    assert "did not learn" not in _texts(fig)
    assert not [c for c in fig.axes[0].collections if len(c.get_offsets()) and _is_cross(c)]
    plt.close(fig)
    flat = runs.assign(learned=~((runs["arch"] == "hc") & (runs["n_layer"] == 4)))
    fig = registry.FIGURES["headline"].draw({**base, "runs": flat}, CTX)
    crosses = [c for c in fig.axes[0].collections if len(c.get_offsets()) and _is_cross(c)]
    assert len(crosses) == 1 and len(crosses[0].get_offsets()) == 1
    assert "x: did not learn" in _texts(fig)
    plt.close(fig)


def _is_cross(collection) -> bool:
    from matplotlib.markers import MarkerStyle

    cross = MarkerStyle("x").get_path().transformed(MarkerStyle("x").get_transform())
    return any(
        len(p.vertices) == len(cross.vertices) and (p.vertices == cross.vertices).all()
        for p in collection.get_paths()
    )
