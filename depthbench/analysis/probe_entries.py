"""The figure registry's entries of the report's section 2, layer utilization probes, in
registry order (depthbench.analysis.registry): the probe figures, drawn from the probe table
when the probes are on and some architecture of the grid supports the families a figure needs
(or declares the figure), and the layer-removal curves.
"""

from __future__ import annotations

from depthbench.analysis.figure_spec import PROBES, Figure, probes_on, removal_on


# The tables behind readers.not_learned_keys: figures comparing cells mark those whose best-LR
# runs did not learn.
MARKS = ("runs", "best_lr")


def _probe_fig(
    name, function, caption, probes=frozenset(), arch_figure=None, marks: tuple[str, ...] = ()
) -> Figure:
    return Figure(
        name,
        function,
        PROBES,
        "probe_figures",
        ("probes", *marks),
        caption,
        frozenset(probes),
        arch_figure,
        probes_on,
    )


PROBE_FIGURES: list[Figure] = [
    _probe_fig(
        "angular_distance",
        "probe_figures.angular_distance",
        "Angular distance d(l, l+k) = arccos(cos(h_l, h_l+k)) / pi at the last token of each "
        "sequence, laid out architecture (rows) x shape (columns) on one colour scale; dark cells "
        "near k = 1 late in depth mean consecutive layers barely change the stream.",
        {"angular_distance"},
    ),
    _probe_fig(
        "angular_distance_all",
        "probe_figures.angular_distance_all",
        "The same angular distance averaged over all tokens instead of the last one.",
        {"angular_distance"},
    ),
    _probe_fig(
        "angular_adjacent",
        "probe_figures.angular_adjacent",
        "Adjacent-layer angular distance d(l, l+1) per architecture, one panel per depth (solid: "
        "last token, dashed: all tokens).",
        {"angular_distance"},
        marks=MARKS,
    ),
    _probe_fig(
        "logit_lens",
        "probe_figures.logit_lens",
        "Logit lens: the final norm and LM head applied to each layer's residual h_l. Top: the "
        "cross-entropy of that prediction on the probe sample; bottom: how often its top-1 token "
        "is the model's final one, against l / L, one panel per depth. A curve that reaches the "
        "final loss early in depth means the later layers add little to the prediction.",
        {"logit_lens"},
        marks=MARKS,
    ),
    Figure(
        "removal_curves",
        "removal_figures.removal_curves",
        PROBES,
        "probe_figures",
        ("removal",),
        "Layer removal: the validation loss's rise (held-apart windows, not the probe sample) as a "
        "fraction of the layers is removed in one pass, the layers chosen by each ranking: the "
        "contiguous block with the smallest angular distance between its input and output (Gromov "
        "et al.), the lowest block influence 1 - cos(h_l-1, h_l) (ShortGPT), the lowest causal "
        "score, the last layers before the final one, and a seeded random choice (the baseline). "
        "Colour: architecture; line style: depth; shaded: within the effective-depth tolerance. A "
        "curve that stays flat as layers go means those layers did little.",
        when=removal_on,
    ),
    _probe_fig(
        "causal_matrix",
        "probe_figures.causal_matrix",
        "Causal score C(s, l): relative change of layer l's update when layer s is skipped "
        "(everything it contributes removed), per architecture at the deepest shape; the dashed "
        "square is the last 3/4 of depth and dots mark cells above the causal threshold.",
        {"causal_score"},
    ),
    _probe_fig(
        "permutation_matrix",
        "probe_figures.permutation_matrix",
        "Permutation score P(a, b): relative loss change after exchanging all parameters of layers "
        "a and b, per architecture at the deepest shape; dashed square: last 3/4 of depth; dots: "
        "above the threshold.",
        {"permutation_score"},
    ),
    _probe_fig(
        "probe_shares",
        "probe_figures.probe_shares",
        "Share of layer pairs in the last 3/4 of depth whose causal (left) or permutation (right) "
        "score exceeds its threshold, against depth: higher means later layers depend on each "
        "other and on their order.",
        {"causal_score", "permutation_score"},
        marks=MARKS,
    ),
    _probe_fig(
        "usefulness",
        "layer_figures.usefulness",
        "Usefulness ratio r_l = loss with layer l replaced by its least-squares affine fit / loss, "
        "per layer and depth; a layer above the red threshold does non-linear work that an affine "
        "map cannot replace.",
        {"usefulness_ratio"},
        marks=MARKS,
    ),
    _probe_fig(
        "token_similarity",
        "layer_figures.token_similarity",
        "Mean pairwise cosine similarity of the tokens of a sequence at each layer, at init, at "
        "init with the prefix-average part of attention removed, and trained (deepest shape): "
        "growth with depth at init is rank collapse.",
        {"token_similarity"},
        marks=MARKS,
    ),
    _probe_fig(
        "effective_rank",
        "layer_figures.effective_rank",
        "Effective rank (Roy and Vetterli) of the token matrix at each layer, at init, at init "
        "without the prefix-average part, and trained (deepest shape).",
        {"effective_rank"},
        marks=MARKS,
    ),
    _probe_fig(
        "residual_product_rank",
        "arch_figures.residual_product_rank",
        "Effective rank of the product of the per-sublayer stream-mixing matrices over depth (1 = "
        "the streams collapse to one, n = all kept), trained (solid) and at init (dashed); bands: "
        "the papers' ranges (mHC 1.44-1.65, HC 2.53-2.81).",
        arch_figure="residual_product_rank",
        marks=MARKS,
    ),
    _probe_fig(
        "depth_mixing",
        "arch_figures.depth_mixing",
        "Mean depth-softmax weight each reading sublayer of Attention Residuals puts on each "
        "source (0 = the embedding), per architecture and shape.",
        arch_figure="depth_mixing",
    ),
    _probe_fig(
        "dead_zone",
        "arch_figures.dead_zone",
        "Block AttnRes: weight each layer puts on the current partial sum, per depth, with the "
        "dead zone (weight below the threshold) shaded; right: the dead-zone length against depth "
        "with the paper's 2, 5 and 8 layers at L = 16, 24, 32.",
        arch_figure="dead_zone",
        marks=MARKS,
    ),
]
