"""The figure registry: every figure by name, with the report section it belongs to, its
caption (the report's text under it), the tables it reads, the workflow rule that draws it, and
what it needs from the grid.

What a grid gets is decided from the architectures' own declarations, never from their names:
a figure that needs probe families is drawn when some architecture of the grid supports all of
them (`ARCHITECTURES[name].probes`), and an architecture-specific figure when some architecture
declares it (`ARCHITECTURES[name].figures`). Config switches (probes, dynamics, NLL) decide the
rest. The Figure record, the section names and the switches are in
depthbench.analysis.figure_spec; the entries of section 2 (probes) in
depthbench.analysis.probe_entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from depthbench.analysis.figure_spec import (
    COST,
    DYN,
    LOSS,
    NLL,
    Figure,
    at_steps_on,
    dynamics_on,
    nll_on,
)
from depthbench.analysis.probe_entries import PROBE_FIGURES

if TYPE_CHECKING:
    from depthbench.analysis.style import Context


_LOSS = ("runs", "best_lr", "curves")


FIGURES: dict[str, Figure] = {
    f.name: f
    for f in [
        Figure(
            "headline",
            "loss_figures.headline",
            LOSS,
            "figures",
            _LOSS + ("effective_depth",),
            "Validation loss at the best learning rate (seeds averaged; bars: the 95% interval "
            "with the seed variance pooled over the grid's cells plus the LR choice's, "
            "depthbench.analysis.best_loss; n=1 marks a cell of one seed) against d_model / "
            "n_layer at a fixed parameter budget, one line per architecture; "
            "open circles: the best LR is at the edge of the swept range (the true "
            "optimum may lie outside); crosses: cells that did not learn, left off the lines; "
            "dashed: the unigram floor. Where the grid removes layers, "
            "the middle panel is the fraction of layers that can be removed with the validation "
            "loss within the tolerance (effective depth, the best ranking). The lower panel is "
            "each shape's parameter count relative to the budget. A curve that rises to the left "
            "means added depth is wasted.",
        ),
        Figure(
            "loss_vs_lr",
            "loss_figures.loss_vs_lr",
            LOSS,
            "figures",
            _LOSS,
            "Final validation loss against the peak learning rate, one panel per shape; x marks a "
            "diverged run.",
        ),
        Figure(
            "loss_curves",
            "loss_figures.loss_curves",
            LOSS,
            "figures",
            _LOSS,
            "Training loss at every logged step (thin) and validation loss at each evaluation "
            "(dots) against training tokens, at each shape's best learning rate, one panel per "
            "architecture.",
        ),
        *PROBE_FIGURES,
        Figure(
            "dynamics",
            "dynamics_figures.dynamics",
            DYN,
            "dynamics_figure",
            ("dynamics", "runs", "best_lr"),
            "Per layer over training (colour: optimizer step), at the deepest shape and each "
            "architecture's best LR: the residual RMS, the RMSNorm backward factor sqrt(d)/||y|| "
            "(below the red line the norm shrinks the gradient) and the gradient norm of h_l.",
            when=dynamics_on,
        ),
        Figure(
            "probes_over_training",
            "step_figures.probes_over_training",
            DYN,
            "probe_figures",
            ("probes",),
            "The probes of the weights kept at the probes.at_steps steps (best LR, first seed) "
            "against the optimizer step, one row per depth: causal and permutation shares, the "
            "adjacent angular distance d(l, l+1) averaged over layers, and token similarity at the "
            "last layer h_L (dotted: at init). The last point is the final model; where a share "
            "falls to 0 while the distance shrinks, the late layers have stopped mattering.",
            frozenset(
                {"causal_score", "permutation_score", "angular_distance", "token_similarity"}
            ),
            when=at_steps_on,
        ),
        Figure(
            "adjacent_distance_over_training",
            "step_figures.adjacent_distance_over_training",
            DYN,
            "probe_figures",
            ("probes",),
            "Adjacent-layer angular distance d(l, l+1) at the last token for every layer (rows) "
            "and kept step (columns, log scale), architecture x depth on one colour scale: dark "
            "cells late in depth are layers that barely change the stream, and the column where "
            "they appear is when that happened.",
            frozenset({"angular_distance"}),
            when=at_steps_on,
        ),
        Figure(
            "nll_vs_ratio",
            "nll_figures.nll_vs_ratio",
            NLL,
            "nll_figures",
            ("nll", "runs", "best_lr"),  # runs, best_lr: the cells that did not learn
            "Teacher-forced NLL in bits per byte on code, STEM and math documents against d_model "
            "/ n_layer, at each architecture's best learning rate.",
            when=nll_on,
        ),
        Figure(
            "cost_vs_ratio",
            "cost_figures.cost_vs_ratio",
            COST,
            "cost_figures",
            ("cost",),
            "Analytic prefill FLOPs and KV cache per 4096-token sequence against d_model / "
            "n_layer; measured peak memory only for GPU runs (on CPU the process's resident memory "
            "is the Python runtime, not the model).",
        ),
        Figure(
            "loss_vs_cost",
            "cost_figures.loss_vs_cost",
            COST,
            "cost_figures",
            ("cost",),
            "Validation loss at the best LR against prefill FLOPs, and against device-hours for "
            "GPU runs only (points labelled by depth).",
        ),
    ]
}


def grid_figures(architectures: list[str], config: dict) -> list[str]:
    """The figures a grid gets, in registry order, from its architectures' declarations."""
    import depthbench.models.archs  # noqa: F401  (registers every architecture)
    from depthbench.models.registry import ARCHITECTURES

    classes = [ARCHITECTURES[a] for a in dict.fromkeys(architectures)]
    names = []
    for fig in FIGURES.values():
        if not fig.when(config):
            continue
        if fig.probes and not any(fig.probes <= cls.probes for cls in classes):
            continue
        if fig.arch_figure and not any(fig.arch_figure in cls.figures for cls in classes):
            continue
        names.append(fig.name)
    return names


def of_rule(names: list[str], rule: str) -> list[str]:
    return [n for n in names if FIGURES[n].rule == rule]


def tables_of(names: list[str]) -> list[str]:
    """The tables the named figures read, in a fixed order."""
    wanted = {t for n in names for t in FIGURES[n].tables}
    return [
        t
        for t in (
            "runs",
            "best_lr",
            "curves",
            "dynamics",
            "probes",
            "nll",
            "cost",
            "removal",
            "effective_depth",
        )
        if t in wanted
    ]


def context(config: dict) -> "Context":
    # style and readers (matplotlib and pandas with them) are imported by the figure jobs, not
    # by the Snakefile, which reads the registry to plan
    from depthbench.analysis import style as S
    from depthbench.analysis.readers import grid_line

    fig_cfg, probes = config.get("figures", {}), config.get("probes", {})
    ctx = S.Context(
        width=fig_cfg.get("width_in", 6.0),
        height=fig_cfg.get("height_in", 4.0),
        dpi=fig_cfg.get("dpi", 150),
        experiment=config.get("name", "experiment"),
        grid_line=grid_line(config),
        budget=config.get("budget", {}).get("params"),
        matrix_n_layer=fig_cfg.get("matrix_n_layer"),
    )
    ctx.thresholds.update({k: probes[k] for k in ctx.thresholds if k in probes})
    if "tolerance" in config.get("removal", {}):
        ctx.thresholds["removal_tolerance"] = config["removal"]["tolerance"]
    return ctx


def render(name: str, tables: dict, ctx: "Context", png: str | Path, pdf: str | Path) -> None:
    """Draw one registered figure from the tables and write its PNG and PDF atomically."""
    from depthbench.analysis import style as S

    S.save(FIGURES[name].draw(tables, ctx), png, pdf, ctx.dpi)
