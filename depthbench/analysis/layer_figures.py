"""Per-layer probe figures: usefulness ratio r_l with the threshold drawn, token similarity and
effective rank per layer (at init, at init without the prefix-average part of attention, and
trained). From results/tables/probes.parquet: every seed of each cell at its best LR (at init,
its lowest LR), combined per layer with a 95% interval drawn as a band (analysis.summaries)."""

from __future__ import annotations

import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import style as S
from depthbench.analysis import summaries as SM

NO_PROBES = "no probe rows at this stage (probes disabled, or every run diverged)"
SEQUENCES = "the probe sequences"


def _layer_cells(probes: pd.DataFrame, probe: str, stage: str = "trained") -> pd.DataFrame:
    return SM.probe_cells(probes, probe, stage, index=("i",))


def _per_layer(ax, data: pd.DataFrame, L: int, first: int = 0, within=None) -> dict:
    """One line per architecture of value against layer i (i >= first) at depth L, its 95%
    interval as a band (drawn inside `within`, the quantity's range, where it has one)."""
    curves = {}
    for arch in R.archs(data):
        g = data[
            (data["arch"] == arch) & (data["n_layer"] == L) & (data["i"] >= first)
        ].sort_values("i")
        if not g.empty:
            st = S.arch_style(arch)
            ax.plot(g["i"], g["value"], label=arch, **st)
            SM.band(ax, g["i"], g["ci_low"], g["ci_high"], st["color"], within)
            curves[arch] = g.set_index("i")["value"]
    ax.set_xticks(range(first, L + 1, max(1, L // 4)))
    ax.grid(alpha=0.3)
    groups = S.coinciding(curves)
    if groups:
        S.note(ax, S.coincide_text(groups), y=0.9)
    return curves


def usefulness(tables: dict, ctx: S.Context):
    """r_l = loss with layer l replaced by its affine least-squares fit / loss, per layer, one
    panel per depth; the dashed line is the usefulness threshold (a layer above it is useful)."""
    data = _layer_cells(tables.get("probes", pd.DataFrame()), "usefulness_ratio")
    if data.empty:
        return S.message_figure(ctx, "usefulness ratio r_l per layer", NO_PROBES)
    shapes = R.shapes(data)
    fig, axes = S.panels(len(shapes), ctx, cols=3, sharey=True)
    threshold = ctx.thresholds["usefulness_threshold"]
    for ax, (L, d) in zip(axes, shapes):
        _per_layer(ax, data, L, first=1)
        ax.axhline(
            threshold,
            color="firebrick",
            linestyle="--",
            linewidth=1,
            label=f"threshold {threshold}",
        )
        ax.axhline(1.0, color="0.5", linewidth=0.8)
        ax.set_title(f"L={L}, d={d}")
        ax.set_xlabel("layer l replaced by its affine fit")
    axes[0].set_ylabel("r_l = loss_affine / loss")
    S.legend(axes[-1])
    missing = sorted(
        set(tables.get("probes", pd.DataFrame()).get("arch", pd.Series(dtype=str)).unique())
        - set(data["arch"])
    )
    notes = [f"bands: {SM.interval_text(data, SEQUENCES)}"]
    if missing:
        notes.append(f"not defined for {', '.join(missing)} (no usefulness rows)")
    S.fig_note(fig, "\n".join(notes))
    S.title(fig, ctx, "usefulness: per-layer ratio r_l (above the red line: layer useful)")
    return fig


STAGES = (
    ("init", "at init"),
    ("init_no_prefix_avg", "at init, prefix-average part removed"),
    ("trained", "trained"),
)


def _stages_figure(tables: dict, ctx: S.Context, probe: str, ylabel: str, what: str, within=None):
    """Three panels (init, init without prefix-average, trained) at the deepest shape."""
    probes = tables.get("probes", pd.DataFrame())
    parts = [(_layer_cells(probes, probe, stage), lab) for stage, lab in STAGES]
    present = [p for p, _ in parts if not p.empty]
    if not present:
        return S.message_figure(ctx, what, NO_PROBES)
    L = max(int(p["n_layer"].max()) for p in present)
    fig, axes = S.panels(3, ctx, cols=3, sharey=True)
    for ax, (data, lab) in zip(axes, parts):
        data = data[data["n_layer"] == L]
        _per_layer(ax, data, L, within=within)
        if data.empty:
            S.note(ax, f"no rows {lab}")
        ax.set_title(lab)
        ax.set_xlabel("layer l (h_l)")
    axes[0].set_ylabel(ylabel)
    S.legend(axes[0])
    d = (
        int(present[0].loc[present[0]["n_layer"] == L, "d_model"].iloc[0])
        if (present[0]["n_layer"] == L).any()
        else None
    )
    bands = SM.interval_text(pd.concat(present), SEQUENCES)
    S.fig_note(fig, f"bands: {bands}" + (SM.within_text(within) if within else ""))
    S.title(fig, ctx, what, f"deepest shape L={L}" + (f", d={d}" if d else ""))
    return fig


def token_similarity(tables: dict, ctx: S.Context):
    return _stages_figure(
        tables,
        ctx,
        "token_similarity",
        "mean pairwise cosine of tokens\n(within a sequence)",
        "token similarity per layer",
        within=(-1.0, 1.0),  # a cosine
    )


def effective_rank(tables: dict, ctx: S.Context):
    return _stages_figure(
        tables,
        ctx,
        "effective_rank",
        "effective rank of the token matrix\n(Roy-Vetterli)",
        "effective rank per layer",
    )
