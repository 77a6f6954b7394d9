"""Cells that did not learn (runs.parquet `learned` false at every best-LR seed) in the figures
that compare cells: figures joining cells into a trend across shapes leave such a cell off the
line and cross it; per-layer figures keep its curve, dotted, its label saying so; either way a
note says what the mark means, and with every cell learned there is no mark and no note."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import same_color
from matplotlib.markers import MarkerStyle

from depthbench.analysis import registry
from depthbench.analysis import style as S
from tests.analysis_tables import synthetic_tables

CTX = registry.context(
    {"name": "syn", "budget": {"params": 8e5}, "shapes": [{"n_layer": 2}], "seeds": [0]}
)
NOTE = "did not learn (final loss within the learned margin of the unigram floor"
CROSS = MarkerStyle("x").get_path().transformed(MarkerStyle("x").get_transform())


@pytest.fixture(scope="module")
def base():
    return synthetic_tables(archs=("pre_ln", "hc", "attnres_block"), depths=(2, 4, 8), lrs=(2e-3,))


def _flag(tables: dict, arch: str, L: int) -> dict:
    """The tables with the runs of (arch, L) marked as not learned, every other run learned."""
    runs = tables["runs"].assign(learned=True)
    runs.loc[(runs["arch"] == arch) & (runs["n_layer"] == L), "learned"] = False
    return {**tables, "runs": runs}


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.findobj(plt.Text))


def _crosses(ax) -> list[tuple[float, float]]:
    """The (x, y) of every 'x' marker scattered on ax."""
    out = []
    for c in ax.collections:
        paths = c.get_paths()
        if paths and any(
            len(p.vertices) == len(CROSS.vertices) and np.allclose(p.vertices, CROSS.vertices)
            for p in paths
        ):
            out += [tuple(map(float, xy)) for xy in c.get_offsets()]
    return out


def _line(ax, label: str):
    (line,) = [ln for ln in ax.lines if ln.get_label() == label]
    return line


def _cell(tables: dict, arch: str, L: int, column: str = "ratio") -> float:
    runs = tables["runs"]
    return float(runs.loc[(runs["arch"] == arch) & (runs["n_layer"] == L), column].iloc[0])


def _assert_trend(ax, line, x: float, y: float) -> None:
    """The line leaves out x and a cross sits at (x, y) in the line's colour."""
    xs = np.asarray(line.get_xdata(), dtype=float)
    assert len(xs) and not np.isclose(xs, x).any(), xs
    at = [c for c in _crosses(ax) if np.isclose(c[0], x) and np.isclose(c[1], y)]
    assert at, (_crosses(ax), x, y)
    crossing = [
        c for c in ax.collections if len(c.get_offsets()) and np.allclose(c.get_offsets()[0], at[0])
    ]
    assert same_color(crossing[0].get_edgecolor()[0], line.get_color())


def test_headline_leaves_the_cell_off_the_loss_and_the_removal_lines(base):
    tables = _flag(base, "hc", 4)
    x = _cell(tables, "hc", 4)
    fig = registry.FIGURES["headline"].draw(tables, CTX)
    top, rem = fig.axes[0], fig.axes[1]
    best = tables["best_lr"]
    loss = float(
        best.loc[(best["arch"] == "hc") & (best["n_layer"] == 4), "final_val_loss"].iloc[0]
    )
    _assert_trend(top, _line(top, "hc"), x, loss)
    hc = S.arch_style("hc")["color"]
    (rem_line,) = [ln for ln in rem.lines if same_color(ln.get_color(), hc)]
    depth = tables["effective_depth"]
    assert len(rem.lines) == 3  # one per architecture
    from depthbench.analysis.readers import removable

    fraction = removable(depth).set_index(["arch", "n_layer"]).loc[("hc", 4), "removable"]
    _assert_trend(rem, rem_line, x, float(fraction))
    assert "x: " + NOTE in _texts(fig)
    plt.close(fig)


def test_probe_shares_cross_the_cell_off_the_depth_line(base):
    fig = registry.FIGURES["probe_shares"].draw(_flag(base, "hc", 4), CTX)
    for ax, value in zip(fig.axes[:2], (0.3, 0.4)):  # the synthetic hc causal / permutation share
        _assert_trend(ax, _line(ax, "hc"), 4.0, value)
        assert len(_line(ax, "pre_ln").get_xdata()) == 3
    assert "x: " + NOTE in _texts(fig)
    plt.close(fig)


def test_nll_vs_ratio_crosses_the_cell_off_the_ratio_line(base):
    tables = _flag(base, "hc", 4)
    fig = registry.FIGURES["nll_vs_ratio"].draw(tables, CTX)
    panels = [ax for ax in fig.axes if ax.lines]
    assert len(panels) == 3  # code, math, stem
    for ax in panels:
        _assert_trend(ax, _line(ax, "hc"), _cell(tables, "hc", 4), 1.5 - 0.01 * 4)
    assert "x: " + NOTE in _texts(fig)
    plt.close(fig)


def test_residual_product_rank_crosses_the_trained_cell_and_keeps_init(base):
    fig = registry.FIGURES["residual_product_rank"].draw(_flag(base, "hc", 4), CTX)
    (ax,) = [a for a in fig.axes if a.lines]
    _assert_trend(ax, _line(ax, "hc trained"), 4.0, 2.6)
    assert list(_line(ax, "hc at init").get_xdata()) == [2, 4, 8]  # at init nothing has trained
    assert "x: " + NOTE in _texts(fig)
    plt.close(fig)


def test_dead_zone_crosses_the_length_and_dots_the_depths_curve(base):
    fig = registry.FIGURES["dead_zone"].draw(_flag(base, "attnres_block", 4), CTX)
    left, right = fig.axes[:2]
    _assert_trend(right, _line(right, "ours"), 4.0, 1.0)  # L // 4 layers
    curve = _line(left, "L=4 (did not learn)")
    assert curve.get_linestyle() == ":"
    assert "x: " + NOTE in _texts(fig)
    plt.close(fig)


@pytest.mark.parametrize(
    "name, panel",
    [
        ("angular_adjacent", lambda fig: fig.axes[2]),  # the L = 8 panel
        ("usefulness", lambda fig: fig.axes[2]),
        ("token_similarity", lambda fig: fig.axes[2]),  # the trained panel, deepest shape
        ("effective_rank", lambda fig: fig.axes[2]),
        ("logit_lens", lambda fig: fig.axes[2]),  # top row, L = 8
    ],
)
def test_per_layer_curve_of_the_cell_stays_dotted_and_labelled(base, name, panel):
    fig = registry.FIGURES[name].draw(_flag(base, "hc", 8), CTX)
    ax = panel(fig)
    flat, learned = _line(ax, "hc (did not learn)"), _line(ax, "pre_ln")
    assert flat.get_linestyle() != learned.get_linestyle()
    assert flat.get_linewidth() < learned.get_linewidth()
    assert len(flat.get_xdata()) == len(learned.get_xdata())  # the curve is kept whole
    legends = [lg for lg in [*fig.legends, *(a.get_legend() for a in fig.axes)] if lg]
    assert any("hc (did not learn)" in [t.get_text() for t in lg.get_texts()] for lg in legends)
    assert NOTE in _texts(fig)
    if name in ("token_similarity", "effective_rank"):  # at init nothing has trained
        assert _line(fig.axes[0], "hc").get_linestyle() == "-"
    plt.close(fig)


FIGURES = [
    "headline",
    "probe_shares",
    "nll_vs_ratio",
    "residual_product_rank",
    "dead_zone",
    "angular_adjacent",
    "usefulness",
    "token_similarity",
    "effective_rank",
    "logit_lens",
]


@pytest.mark.parametrize("learned", ["all learned", "no learned column"])
def test_no_mark_and_no_note_when_every_cell_learned(base, learned):
    runs = base["runs"].assign(learned=True)
    tables = {**base, "runs": runs if learned == "all learned" else runs.drop(columns="learned")}
    for name in FIGURES:
        fig = registry.FIGURES[name].draw(tables, CTX)
        assert "did not learn" not in _texts(fig), name
        assert not any(_crosses(ax) for ax in fig.axes), name
        plt.close(fig)
