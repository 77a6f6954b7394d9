"""The figure registry: every figure by name, with the report section it belongs to, its
caption (the report's text under it), the tables it reads, the workflow rule that draws it, and
what it needs from the grid.

What a grid gets is decided from the architectures' own declarations, never from their names:
a figure that needs probe families is drawn when some architecture of the grid supports all of
them (`ARCHITECTURES[name].probes`), and an architecture-specific figure when some architecture
declares it (`ARCHITECTURES[name].figures`). Config switches (probes, dynamics, NLL) decide the
rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from depthbench.analysis import (
    arch_figures,
    cost_figures,
    dynamics_figures,
    layer_figures,
    loss_figures,
    nll_figures,
    probe_figures,
    removal_figures,
    step_figures,
)
from depthbench.analysis import style as S
from depthbench.analysis.readers import grid_line


def _probes_on(config: dict) -> bool:
    return bool(config.get("probes", {}).get("enabled", True))


def _dynamics_on(config: dict) -> bool:
    return int(config.get("train", {}).get("dynamics_every", 0) or 0) > 0


def _at_steps_on(config: dict) -> bool:
    return _probes_on(config) and bool(config.get("probes", {}).get("at_steps"))


def _removal_on(config: dict) -> bool:
    return _probes_on(config) and bool(config.get("removal", {}).get("enabled", True))


def _nll_on(config: dict) -> bool:
    return bool(config.get("nll", {}).get("enabled", True))


@dataclass(frozen=True)
class Figure:
    name: str
    draw: Callable  # (tables: dict[str, DataFrame], ctx: Context) -> matplotlib Figure
    section: str
    rule: str
    tables: tuple[str, ...]
    caption: str
    probes: frozenset[str] = frozenset()  # probe families some architecture must support
    arch_figure: str | None = None  # declared by some architecture in `.figures`
    when: Callable[[dict], bool] = field(default=lambda config: True)


LOSS, PROBES, DYN, NLL, COST = (
    "1. Loss",
    "2. Layer utilization probes",
    "3. Training dynamics",
    "4. NLL",
    "5. Cost",
)
_LOSS = ("runs", "best_lr", "curves")


def _probe_fig(name, draw, caption, probes=frozenset(), arch_figure=None) -> Figure:
    return Figure(
        name,
        draw,
        PROBES,
        "probe_figures",
        ("probes",),
        caption,
        frozenset(probes),
        arch_figure,
        _probes_on,
    )


FIGURES: dict[str, Figure] = {
    f.name: f
    for f in [
        Figure(
            "headline",
            loss_figures.headline,
            LOSS,
            "figures",
            _LOSS + ("effective_depth",),
            "Validation loss at the best learning rate (seeds averaged; bars +-1 std where several seeds) against "
            "d_model / n_layer at a fixed parameter budget, one line per architecture; open circles: the best LR is at "
            "the edge of the swept range (the true optimum may lie outside); dashed: the unigram floor. Where the grid "
            "removes layers, the middle panel is the fraction of layers that can be removed with the validation loss "
            "within the tolerance (effective depth, the best ranking). The lower panel "
            "is each shape's parameter count relative to the budget. A curve that rises to the left means added depth "
            "is wasted.",
        ),
        Figure(
            "loss_vs_lr",
            loss_figures.loss_vs_lr,
            LOSS,
            "figures",
            _LOSS,
            "Final validation loss against the peak learning rate, one panel per shape; x marks a diverged run.",
        ),
        Figure(
            "loss_curves",
            loss_figures.loss_curves,
            LOSS,
            "figures",
            _LOSS,
            "Training loss at every logged step (thin) and validation loss at each evaluation (dots) against training "
            "tokens, at each shape's best learning rate, one panel per architecture.",
        ),
        _probe_fig(
            "angular_distance",
            probe_figures.angular_distance,
            "Angular distance d(l, l+k) = arccos(cos(h_l, h_l+k)) / pi at the last token of each sequence, laid out "
            "architecture (rows) x shape (columns) on one colour scale; dark cells near k = 1 late in depth mean "
            "consecutive layers barely change the stream.",
            {"angular_distance"},
        ),
        _probe_fig(
            "angular_distance_all",
            probe_figures.angular_distance_all,
            "The same angular distance averaged over all tokens instead of the last one.",
            {"angular_distance"},
        ),
        _probe_fig(
            "angular_adjacent",
            probe_figures.angular_adjacent,
            "Adjacent-layer angular distance d(l, l+1) per architecture, one panel per depth (solid: last token, "
            "dashed: all tokens).",
            {"angular_distance"},
        ),
        _probe_fig(
            "logit_lens",
            probe_figures.logit_lens,
            "Logit lens: the final norm and LM head applied to each layer's residual h_l. Top: the cross-entropy "
            "of that prediction on the probe sample; bottom: how often its top-1 token is the model's final one, "
            "against l / L, one panel per depth. A curve that reaches the final loss early in depth means the "
            "later layers add little to the prediction.",
            {"logit_lens"},
        ),
        Figure(
            "removal_curves",
            removal_figures.removal_curves,
            PROBES,
            "probe_figures",
            ("removal",),
            "Layer removal: the validation loss's rise (held-apart windows, not the probe sample) as a fraction of "
            "the layers is removed in one pass, the layers chosen by each ranking: the contiguous block with the "
            "smallest angular distance between its input and output (Gromov et al.), the lowest block influence "
            "1 - cos(h_l-1, h_l) (ShortGPT), the lowest causal score, the last layers before the final one, and a "
            "seeded random choice (the baseline). Colour: architecture; line style: depth; shaded: within the effective-"
            "depth tolerance. A curve that stays flat as layers go means those layers did little.",
            when=_removal_on,
        ),
        _probe_fig(
            "causal_matrix",
            probe_figures.causal_matrix,
            "Causal score C(s, l): relative change of layer l's update when layer s is skipped (everything it "
            "contributes removed), per architecture at the deepest shape; the dashed square is the last 3/4 of depth "
            "and dots mark cells above the causal threshold.",
            {"causal_score"},
        ),
        _probe_fig(
            "permutation_matrix",
            probe_figures.permutation_matrix,
            "Permutation score P(a, b): relative loss change after exchanging all parameters of layers a and b, per "
            "architecture at the deepest shape; dashed square: last 3/4 of depth; dots: above the threshold.",
            {"permutation_score"},
        ),
        _probe_fig(
            "probe_shares",
            probe_figures.probe_shares,
            "Share of layer pairs in the last 3/4 of depth whose causal (left) or permutation (right) score exceeds "
            "its threshold, against depth: higher means later layers depend on each other and on their order.",
            {"causal_score", "permutation_score"},
        ),
        _probe_fig(
            "usefulness",
            layer_figures.usefulness,
            "Usefulness ratio r_l = loss with layer l replaced by its least-squares affine fit / loss, per layer and "
            "depth; a layer above the red threshold does non-linear work that an affine map cannot replace.",
            {"usefulness_ratio"},
        ),
        _probe_fig(
            "token_similarity",
            layer_figures.token_similarity,
            "Mean pairwise cosine similarity of the tokens of a sequence at each layer, at init, at init with the "
            "prefix-average part of attention removed, and trained (deepest shape): growth with depth at init is "
            "rank collapse.",
            {"token_similarity"},
        ),
        _probe_fig(
            "effective_rank",
            layer_figures.effective_rank,
            "Effective rank (Roy and Vetterli) of the token matrix at each layer, at init, at init without the "
            "prefix-average part, and trained (deepest shape).",
            {"effective_rank"},
        ),
        _probe_fig(
            "residual_product_rank",
            arch_figures.residual_product_rank,
            "Effective rank of the product of the per-sublayer stream-mixing matrices over depth (1 = the streams "
            "collapse to one, n = all kept), trained (solid) and at init (dashed); bands: the papers' ranges "
            "(mHC 1.44-1.65, HC 2.53-2.81).",
            arch_figure="residual_product_rank",
        ),
        _probe_fig(
            "depth_mixing",
            arch_figures.depth_mixing,
            "Mean depth-softmax weight each reading sublayer of Attention Residuals puts on each source (0 = the "
            "embedding), per architecture and shape.",
            arch_figure="depth_mixing",
        ),
        _probe_fig(
            "dead_zone",
            arch_figures.dead_zone,
            "Block AttnRes: weight each layer puts on the current partial sum, per depth, with the dead zone (weight "
            "below the threshold) shaded; right: the dead-zone length against depth with the paper's 2, 5 and 8 "
            "layers at L = 16, 24, 32.",
            arch_figure="dead_zone",
        ),
        Figure(
            "dynamics",
            dynamics_figures.dynamics,
            DYN,
            "dynamics_figure",
            ("dynamics", "runs", "best_lr"),
            "Per layer over training (colour: optimizer step), at the deepest shape and each architecture's best LR: "
            "the residual RMS, the RMSNorm backward factor sqrt(d)/||y|| (below the red line the norm shrinks the "
            "gradient) and the gradient norm of h_l.",
            when=_dynamics_on,
        ),
        Figure(
            "probes_over_training",
            step_figures.probes_over_training,
            DYN,
            "probe_figures",
            ("probes",),
            "The probes of the weights kept at the probes.at_steps steps (best LR, first seed) against the optimizer "
            "step, one row per depth: causal and permutation shares, the adjacent angular distance d(l, l+1) averaged "
            "over layers, and token similarity at the last layer h_L (dotted: at init). The last point is the final "
            "model; where a share falls to 0 while the distance shrinks, the late layers have stopped mattering.",
            frozenset(
                {"causal_score", "permutation_score", "angular_distance", "token_similarity"}
            ),
            when=_at_steps_on,
        ),
        Figure(
            "adjacent_distance_over_training",
            step_figures.adjacent_distance_over_training,
            DYN,
            "probe_figures",
            ("probes",),
            "Adjacent-layer angular distance d(l, l+1) at the last token for every layer (rows) and kept "
            "step (columns, log scale), architecture x depth on one colour scale: dark cells late in depth are layers "
            "that barely change the stream, and the column where they appear is when that happened.",
            frozenset({"angular_distance"}),
            when=_at_steps_on,
        ),
        Figure(
            "nll_vs_ratio",
            nll_figures.nll_vs_ratio,
            NLL,
            "nll_figures",
            ("nll",),
            "Teacher-forced NLL in bits per byte on code, STEM and math documents against d_model / n_layer, at each "
            "architecture's best learning rate.",
            when=_nll_on,
        ),
        Figure(
            "cost_vs_ratio",
            cost_figures.cost_vs_ratio,
            COST,
            "cost_figures",
            ("cost",),
            "Analytic prefill FLOPs and KV cache per 4096-token sequence against d_model / n_layer; measured peak "
            "memory only for GPU runs (on CPU the process's resident memory is the Python runtime, not the model).",
        ),
        Figure(
            "loss_vs_cost",
            cost_figures.loss_vs_cost,
            COST,
            "cost_figures",
            ("cost",),
            "Validation loss at the best LR against prefill FLOPs, and against device-hours for GPU runs only (points "
            "labelled by depth).",
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


def context(config: dict) -> S.Context:
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


def render(name: str, tables: dict, ctx: S.Context, png: str | Path, pdf: str | Path) -> None:
    """Draw one registered figure from the tables and write its PNG and PDF atomically."""
    S.save(FIGURES[name].draw(tables, ctx), png, pdf, ctx.dpi)
