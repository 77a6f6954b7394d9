"""Architecture-specific figures (drawn when an architecture in the grid declares them in
`ARCHITECTURES[name].figures`): the residual-product rank of HC and mHC against depth, the
depth-mixing weights of Attention Residuals, and Block AttnRes's dead zone."""

from __future__ import annotations

import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import not_learned as NL
from depthbench.analysis import style as S

# The papers' numbers, drawn as references (the probe table of docs/design/probes.md).
PAPER_RANK = {"mhc": (1.44, 1.65), "hc": (2.53, 2.81)}
PAPER_DEAD_ZONE = {16: 2, 24: 5, 32: 8}


def _by_depth(rows: pd.DataFrame, flat_keys: frozenset) -> pd.DataFrame:
    """Per n_layer, shallow to deep: the mean value of the rows of cells that learned and, apart
    from it (`flat` True), of those of cells in `flat_keys` (readers.not_learned_keys)."""
    flat = R.in_cells(rows, flat_keys).to_numpy()
    return (
        rows.assign(flat=flat)
        .groupby(["n_layer", "flat"], as_index=False)["value"]
        .mean()
        .sort_values("n_layer")
    )


def residual_product_rank(tables: dict, ctx: S.Context):
    """erank of the product of the stream-mixing matrices against depth: trained (solid; a cell
    that did not learn is a cross off the line) and at init (dashed); the papers' ranges as
    shaded bands."""
    probes = tables.get("probes", pd.DataFrame())
    trained, init = (R.probe(probes, "residual_product_rank", s) for s in ("trained", "init"))
    if trained.empty and init.empty:
        return S.message_figure(
            ctx, "residual-product rank (hc, mhc)", "no residual_product_rank rows"
        )
    fig, (ax,) = S.panels(1, ctx)
    flat_keys, crosses = R.not_learned_keys(tables), 0
    for arch in R.archs(pd.concat([trained, init])):
        st = S.arch_style(arch)
        g = _by_depth(trained[trained["arch"] == arch], flat_keys)
        if not g.empty:  # no legend entry for a stage without rows
            crosses += NL.trend(ax, g["n_layer"], g["value"], g["flat"], st, f"{arch} trained")
        g = init[init["arch"] == arch].groupby("n_layer")["value"].mean()
        if not g.empty:  # at init nothing has trained: every cell is a point of the line
            ax.plot(g.index, g.values, linestyle="--", label=f"{arch} at init", **st)
        if arch in PAPER_RANK:
            lo, hi = PAPER_RANK[arch]
            ax.axhspan(lo, hi, color=st["color"], alpha=0.12, label=f"{arch} paper range {lo}-{hi}")
    if init.empty:
        S.note(ax, "no init rows for this probe yet", y=0.1)
    if trained.empty:
        S.note(ax, "no trained rows (every hc/mhc run diverged)", y=0.9)
    depths = sorted(pd.concat([trained, init])["n_layer"].unique())
    ax.set_xticks(depths)
    ax.set_xlabel("n_layer")
    ax.set_ylabel("effective rank of the stream-mixing product\n(1 = one stream, n = full)")
    ax.grid(alpha=0.3)
    S.legend(ax, loc="best")
    if crosses:
        S.fig_note(fig, NL.not_learned_text(crosses))
    S.title(fig, ctx, "residual-product rank, mHC vs HC")
    return fig


def depth_mixing(tables: dict, ctx: S.Context):
    """Mean depth-softmax weight of each reading sublayer (rows) on each source (columns), one
    panel per (AttnRes architecture, shape), one colour scale."""
    data = R.probe(tables.get("probes", pd.DataFrame()), "depth_weight")
    if data.empty:
        return S.message_figure(ctx, "depth-mixing weights (attnres)", "no depth_weight rows")
    depths = [L for L, _ in R.shapes(data)]
    fig, axes, cells = S.arch_depth_grid(data, R.archs(data), depths, ctx, "no run")
    im = None
    for ax, arch, L, rows in cells:
        M = R.matrix(rows, (int(rows["i"].max()) + 1, int(rows["j"].max()) + 1))[1:]
        im = ax.imshow(
            M,
            origin="lower",
            aspect="auto",
            vmin=0,
            vmax=1,
            cmap="magma",
            extent=(-0.5, M.shape[1] - 0.5, 0.5, M.shape[0] + 0.5),
        )
        ax.set_title(f"{arch}, L={L}, d={int(rows['d_model'].iloc[0])}")
        ax.set_xlabel("source (0 = embedding)")
        ax.set_ylabel("reading sublayer s\n(top row: final)")
    fig.colorbar(im, ax=axes, shrink=0.8, label="mean softmax weight on the source")
    S.title(fig, ctx, "depth-mixing weights of Attention Residuals")
    return fig


def dead_zone(tables: dict, ctx: S.Context):
    """Block AttnRes: weight on the current partial sum per layer, one line per depth, the
    dead-zone threshold dashed and each depth's dead-zone length marked by a shaded span; right,
    the length against depth. A depth whose cell did not learn keeps its curve, dotted, and is
    a cross off the length's line."""
    probes = tables.get("probes", pd.DataFrame())
    weights = R.probe(probes, "partial_sum_weight")
    lengths = R.probe(probes, "dead_zone_layers")
    if weights.empty:
        return S.message_figure(
            ctx, "Block AttnRes dead zone", "no partial_sum_weight rows (attnres_block not trained)"
        )
    threshold = ctx.thresholds.get("dead_zone_threshold", 0.05)
    fig, (ax, bx) = S.panels(2, ctx, cols=2)
    cmap = S.plt.get_cmap("viridis")
    depths = sorted(weights["n_layer"].unique())
    flat_keys, marked = R.not_learned_keys(tables), 0
    for n, L in enumerate(depths):
        color = cmap(n / max(1, len(depths) - 1) * 0.85)
        g = weights[weights["n_layer"] == L].sort_values("i")
        flat = R.all_in_cells(g, flat_keys)
        marked += flat
        st = {"marker": "o", "markersize": 4, "color": color}
        ax.plot(g["i"] / L, g["value"], **NL.curve_style(st, flat, f"L={L}"))
        k = lengths.loc[lengths["n_layer"] == L, "value"]
        if not k.empty and k.iloc[0] > 0:
            # layers 1..k, half a layer either side, clipped to the model (a dead zone of all L
            # layers must not shade past l/L = 1)
            ax.axvspan(0.5 / L, min(k.iloc[0] + 0.5, L) / L, color=color, alpha=0.12)
    ax.axhline(
        threshold, color="firebrick", linestyle="--", linewidth=1, label=f"threshold {threshold}"
    )
    ax.set_xlim(0, 1.04)
    ax.set_xlabel("layer l / L")
    ax.set_ylabel("weight on the current partial sum")
    ax.set_title("shaded: the dead zone of each depth")
    ax.grid(alpha=0.3)
    S.legend(ax)
    g = _by_depth(lengths, flat_keys)
    crosses = NL.trend(
        bx, g["n_layer"], g["value"], g["flat"], {"marker": "o", "color": "C9"}, "ours"
    )
    bx.plot(
        list(PAPER_DEAD_ZONE),
        list(PAPER_DEAD_ZONE.values()),
        marker="s",
        linestyle=":",
        color="0.4",
        label="paper",
    )
    bx.set_xlabel("n_layer")
    bx.set_ylabel("dead-zone length (layers)")
    bx.set_title("dead-zone length vs depth")
    bx.grid(alpha=0.3)
    S.legend(bx)
    if lengths.empty:
        S.note(bx, "no dead_zone_layers rows")
    if crosses or marked:
        S.fig_note(fig, NL.not_learned_text(crosses, marked))
    S.title(fig, ctx, "Block AttnRes dead zone")
    return fig
