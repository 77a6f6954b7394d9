"""The analysis side: every registered figure on full, empty, all-diverged, single-run and
single-shape tables; the registry's choice of figures from the architectures' declarations; the
report's first screen (the claims' verdicts: tests/unit/test_claims.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from depthbench.analysis import registry
from depthbench.analysis.claims.table import claims_table, load_claims
from depthbench.analysis.report import build_report
from depthbench.analysis.readers import grid_line
from depthbench.models.registry import ARCHITECTURES
from depthbench.models.base import GENERIC_PROBES, DecoderLM
from tests.analysis_tables import synthetic_tables

CLAIMS_FILE = Path(__file__).resolve().parents[2] / "config" / "claims.yaml"
CTX = registry.context(
    {
        "name": "syn",
        "budget": {"params": 8e5},
        "shapes": [{"n_layer": 2}],
        "learning_rates": [2e-3],
        "seeds": [0],
    }
)


def texts(fig) -> str:
    """Every text of a figure (titles, labels, notes), lower-cased."""
    return " ".join(t.get_text() for t in fig.findobj(plt.Text)).lower()


def has_data(fig) -> bool:
    """True when some axes holds a drawn line with points, an image or a scatter."""
    for ax in fig.axes:
        if any(
            len(line.get_xdata()) and line.get_marker() not in (None, "None", "")
            for line in ax.lines
        ):
            return True
        if ax.images or any(
            len(c.get_offsets()) for c in ax.collections if hasattr(c, "get_offsets")
        ):
            return True
    return False


@pytest.fixture(scope="module")
def full():
    return synthetic_tables()


def test_every_figure_draws_the_full_grid_with_labelled_axes(full):
    for name, fig_def in registry.FIGURES.items():
        fig = fig_def.draw(full, CTX)
        assert has_data(fig), name
        assert "nothing to draw" not in texts(fig), name
        assert "syn:" in fig._suptitle.get_text() and "budget 8e+05" in fig._suptitle.get_text(), (
            name
        )
        for ax in fig.axes:
            if (
                ax.get_visible()
                and ax.axison
                and ax.get_label() != "<colorbar>"
                and (ax.lines or ax.images)
            ):
                xs = [a.get_xlabel() for a in ax.get_shared_x_axes().get_siblings(ax)]
                ys = [a.get_ylabel() for a in ax.get_shared_y_axes().get_siblings(ax)]
                assert any(xs) and any(ys), (name, ax.get_title())
        plt.close(fig)


EMPTY = {
    k: pd.DataFrame() for k in ("runs", "best_lr", "curves", "dynamics", "probes", "nll", "cost")
}


@pytest.mark.parametrize("case", ["empty", "all_diverged", "single_run", "single_shape"])
def test_every_figure_is_drawn_and_says_what_is_missing(case, tmp_path):
    if case == "empty":
        tables = EMPTY
    elif case == "all_diverged":
        tables = synthetic_tables(archs=("pre_ln", "hc"), depths=(2, 4), diverged=lambda *a: True)
    elif case == "single_run":
        tables = synthetic_tables(archs=("pre_ln",), depths=(2,), lrs=(2e-3,))
    else:
        tables = synthetic_tables(archs=("pre_ln", "attnres_block"), depths=(4,), lrs=(2e-3,))
    for name, fig_def in registry.FIGURES.items():
        fig = fig_def.draw(tables, CTX)
        said = texts(fig)
        if case in ("empty", "all_diverged") and name not in (
            "loss_vs_lr",
            "token_similarity",
            "effective_rank",
            "angular_distance",
            "cost_vs_ratio",
        ):
            assert "nothing to draw" in said or "no " in said, (case, name)
        if case == "empty":
            assert "nothing to draw" in said, name
        assert has_data(fig) or "nothing to draw" in said or "no " in said, (case, name)
        plt.close(fig)
    registry.render("headline", tables, CTX, tmp_path / "h.png", tmp_path / "h.pdf")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG" and (
        tmp_path / "h.pdf"
    ).read_bytes()[:4] == b"%PDF"


def test_all_diverged_figures_name_the_cause():
    tables = synthetic_tables(archs=("pre_ln",), depths=(2,), diverged=lambda *a: True)
    assert "no run finished without diverging" in texts(
        registry.FIGURES["headline"].draw(tables, CTX)
    )
    assert "every run at this shape diverged" in texts(
        registry.FIGURES["loss_vs_lr"].draw(tables, CTX)
    )
    assert "no rows trained" in texts(registry.FIGURES["token_similarity"].draw(tables, CTX))
    plt.close("all")


def test_coinciding_architectures_are_named():
    same = lambda arch, L, lr: 4.0 + 0.01 * L  # noqa: E731  every architecture the same loss
    tables = synthetic_tables(
        archs=("pre_ln", "post_ln", "lns"), depths=(2, 4), lrs=(2e-3,), loss=same
    )
    assert "pre_ln = post_ln = lns coincide" in texts(
        registry.FIGURES["headline"].draw(tables, CTX)
    )
    plt.close("all")


def test_score_matrices_at_the_requested_depth(full):
    ctx = registry.context({"figures": {"matrix_n_layer": 4}})
    fig = registry.FIGURES["causal_matrix"].draw(full, ctx)
    assert "l=4, d=80" in texts(fig) and fig.axes[0].images[0].get_array().shape == (4, 4)
    said = texts(
        registry.FIGURES["permutation_matrix"].draw(
            full, registry.context({"figures": {"matrix_n_layer": 6}})
        )
    )
    assert "matrix_n_layer = 6" in said and "[2, 4, 8]" in said
    plt.close("all")


def test_gpu_only_measurements_are_left_out_on_cpu(full):
    said = texts(registry.FIGURES["cost_vs_ratio"].draw(full, CTX))
    assert "cpu runs only: measured peak memory not drawn" in said
    gpu = {**full, "cost": full["cost"].assign(device="cuda:0")}
    fig = registry.FIGURES["cost_vs_ratio"].draw(gpu, CTX)
    assert "measured peak gpu memory" in texts(fig) and len(fig.axes[2].lines) == 3
    plt.close("all")


class _Toy(DecoderLM):
    """Declares the dead-zone figure and no usefulness probe: the registry must follow it."""

    probes = GENERIC_PROBES - {"usefulness_ratio"}
    figures = frozenset({"dead_zone"})


def test_registry_follows_the_architectures_declarations(monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, "toy_arch", _Toy)
    names = registry.grid_figures(["toy_arch"], {})
    assert (
        "dead_zone" in names and "usefulness" not in names and "residual_product_rank" not in names
    )
    assert "usefulness" in registry.grid_figures(["toy_arch", "pre_ln"], {})
    assert {"residual_product_rank"} <= set(registry.grid_figures(["mhc"], {}))
    assert {"depth_mixing", "dead_zone"} <= set(registry.grid_figures(["attnres_block"], {}))
    assert "dead_zone" not in registry.grid_figures(["attnres_full"], {})
    off = registry.grid_figures(
        ["pre_ln"],
        {"probes": {"enabled": False}, "nll": {"enabled": False}, "train": {"dynamics_every": 0}},
    )
    assert off == ["headline", "loss_vs_lr", "loss_curves", "cost_vs_ratio", "loss_vs_cost"]
    assert "dynamics" in registry.grid_figures(["pre_ln"], {"train": {"dynamics_every": 5}})
    for name in registry.FIGURES:
        assert registry.FIGURES[name].caption and registry.FIGURES[name].tables


def test_report_opens_on_headline_claims_and_best_lr(tmp_path, full):
    names = ["headline", "usefulness"]
    for n in names:
        registry.render(n, full, CTX, tmp_path / f"{n}.png", tmp_path / f"{n}.pdf")
    full = {**full, "claims": claims_table(load_claims(CLAIMS_FILE), full, {})}
    page = build_report(
        names + ["dead_zone"], tmp_path, full, {"name": "syn", "budget": {"params": 8e5}}
    )
    first = page.split('<h2 id="s0">')[0]
    assert first.count("data:image/png;base64,iVBORw0KGgo") == 1  # the headline, embedded
    assert (
        "Claims of the source papers" in first
        and "Best learning rate per shape" in first
        and "vs budget" in first
    )
    claims = full["claims"].set_index("claim_id")["verdict"]
    for (
        claim_id,
        verdict,
    ) in claims.items():  # testable claims open the page; the rest are counted, all in full below
        assert (f"<b>({claim_id[0]})</b>" in first) == (not verdict.startswith("not testable")), (
            claim_id
        )
        assert f"<b>({claim_id[0]})</b>" in page
    assert (
        f"{int(claims.str.startswith('not testable').sum())} more not testable in this grid"
        in first
    )
    assert page.count("<figcaption>") == 3 and "dead_zone.png was not drawn" in page
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched: opens offline


def test_titles_of_a_grid_with_pretrained_models_say_whose_budget_they_state():
    """The grid line names the pretrained models and marks the budget, depths and LRs as the
    trained grid's, so a figure of SmolLM2's 30 layers is not titled as if it were a 4-layer run."""
    settings = {
        "budget": {"params": 3.9e5},
        "shapes": [{"n_layer": 4}],
        "learning_rates": [4e-3],
        "seeds": [0],
    }
    assert grid_line(settings) == "budget 3.9e+05 params; L = 4; LR 0.004; seeds 0"
    assert grid_line({**settings, "seeds_at_best_lr": 2}).endswith("seeds 0 (2 at each best LR)")
    line = grid_line({**settings, "pretrained": ["smollm2_135m_instruct"]})
    assert line == (
        "trained: budget 3.9e+05 params; L = 4; LR 0.004; seeds 0; "
        "pretrained: smollm2_135m_instruct"
    )
    assert grid_line({**settings, "pretrained": [{"name": "a"}, {"name": "b"}]}).endswith(
        "pretrained: a, b"
    )
