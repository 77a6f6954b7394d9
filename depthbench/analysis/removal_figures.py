"""Layer-removal figures: the validation loss as layers are removed by each ranking
(results/tables/removal.parquet, depthbench.probes.removal), every architecture and depth of the
grid and the pretrained models on the same axes."""

from __future__ import annotations

import matplotlib.lines as mlines
import matplotlib.patches as mpatches
import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import style as S

RANKING_TITLES = {
    "angular_block": "angular block (Gromov et al.)",
    "block_influence": "block influence (ShortGPT)",
    "causal": "causal score (DepthBench)",
    "last": "last layers before the final one",
    "random": "random (mean of draws)",
}
DEPTH_STYLES = ["-", "--", ":", "-."]
Y_CAP = 1.0  # the axis stops at +100%: past it every model is broken and the curves only crowd


def removal_curves(tables: dict, ctx: S.Context):
    """One panel per ranking: the validation loss's relative rise against the fraction of layers
    removed, a line per (architecture, depth) of the best-LR runs (first seed) and per pretrained
    model; colour: architecture, line style: depth (solid: the deepest); shaded: within the
    tolerance of effective depth."""
    removal = tables.get("removal", pd.DataFrame())
    what = "validation loss as layers are removed"
    if removal.empty or not R.has(removal, "domain", "ranking", "arch", "n_layer"):
        return S.message_figure(
            ctx, what, "no removal rows (removal or probes disabled, or every run diverged)"
        )
    val = removal[removal["domain"] == "val"]
    if "is_best_lr" in val.columns:
        val = R.first_seed(val[val["is_best_lr"].fillna(False).astype(bool)])
    rankings = [r for r in RANKING_TITLES if r in set(val["ranking"])]
    depths = sorted(int(L) for L in val["n_layer"].dropna().unique())
    styles = {
        L: DEPTH_STYLES[min(len(depths) - 1 - i, len(DEPTH_STYLES) - 1)]
        for i, L in enumerate(depths)
    }
    fig, axes = S.panels(len(rankings), ctx, cols=3, sharey=True)
    archs = R.archs(val)
    tolerance = ctx.thresholds.get("removal_tolerance", 0.05)
    top = min(Y_CAP, max(2 * tolerance, float(val["change"].max()))) * 1.08
    for ax, ranking in zip(axes, rankings):
        rows = val[val["ranking"] == ranking]
        for arch in archs:
            for L in depths:
                g = rows[(rows["arch"] == arch) & (rows["n_layer"] == L)]
                if g.empty:
                    continue
                curve = g.groupby("fraction")["change"].mean().clip(upper=Y_CAP)
                st = S.arch_style(arch)
                ax.plot(
                    curve.index,
                    curve.values,
                    linestyle=styles[L],
                    color=st["color"],
                    marker=st["marker"],
                    markersize=3,
                )
        ax.axhspan(-1, tolerance, color="tab:green", alpha=0.12, lw=0)
        ax.set_title(RANKING_TITLES[ranking])
        ax.set_xlabel("fraction of layers removed")
        ax.set_ylim(-0.05 * top, top)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"validation loss / full - 1\n(capped at +{Y_CAP:.0%})")
    handles = [
        mlines.Line2D(
            [], [], color=S.arch_style(a)["color"], marker=S.arch_style(a)["marker"], label=a
        )
        for a in archs
    ]
    handles += [
        mlines.Line2D([], [], color="0.3", linestyle=styles[L], label=f"L={L}") for L in depths
    ]
    handles.append(
        mpatches.Patch(
            color="tab:green", alpha=0.25, label=f"within {tolerance:.0%}\n(effective depth)"
        )
    )
    fig.legend(handles=handles, loc="outside right center", fontsize=S.FONT["legend"])
    pretrained = "status" in val.columns and (val["status"] == "pretrained").any()
    S.title(
        fig,
        ctx,
        what,
        "best-LR runs, first seed" + ("; pretrained models as their family" if pretrained else ""),
    )
    return fig
