"""Probe figures over layer pairs: angular distance d(l, l+k) heatmaps and the adjacent curve
d(l, l+1); causal score C(s, l) and permutation score P(a, b) matrices with the last-3/4 region
and the thresholds marked; the shares against depth. Drawn from results/tables/probes.parquet:
the matrices from the best-LR run of each architecture and shape (its first seed), the curve and
the shares from every seed at the best LR with their 95% intervals (analysis.summaries)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import not_learned as NL
from depthbench.analysis import style as S
from depthbench.analysis import summaries as SM

SEQUENCES = "the probe sequences"
UNIT = (0.0, 1.0)  # the range of a share and of an angular distance

NO_PROBES = "no trained probe rows (probes disabled, or every run diverged)"


def _angular(tables: dict, ctx: S.Context, probe: str, what: str):
    """Heatmaps of d(l, l+k) laid out architecture (rows) x shape (columns), one colour scale
    shared by every panel; each panel's axes cover exactly its own l = 0..L-1 and k = 1..L."""
    data = R.probe(tables.get("probes", pd.DataFrame()), probe)
    if data.empty:
        return S.message_figure(ctx, what, NO_PROBES)
    vmax = float(np.ceil(data.loc[data["j"] > 0, "value"].max() * 10) / 10) or 0.5
    depths = [L for L, _ in R.shapes(data)]
    fig, axes, cells = S.arch_depth_grid(data, R.archs(data), depths, ctx, "no trained run")
    im = None
    for ax, arch, L, rows in cells:
        M = R.matrix(rows, (L + 1, L + 1))[:L, 1:]  # l = 0..L-1, k = 1..L
        im = ax.imshow(
            M.T,
            origin="lower",
            aspect="auto",
            vmin=0,
            vmax=vmax,
            cmap="viridis",
            extent=(-0.5, L - 0.5, 0.5, L + 0.5),
        )
        ax.set_title(f"{arch}, L={L}, d={int(rows['d_model'].iloc[0])}")
        step = max(1, L // 4)
        ax.set_xticks(range(0, L, step))
        ax.set_yticks(range(1, L + 1, step))
        ax.set_xlabel("layer l (h_l)")
        ax.set_ylabel("offset k")
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="d(l, l+k) = arccos(cos(h_l, h_l+k)) / pi")
    S.title(fig, ctx, what, "lower-left triangle: l + k <= L")
    return fig


def angular_distance(tables: dict, ctx: S.Context):
    return _angular(tables, ctx, "angular_distance_last", "angular distance d(l, l+k), last token")


def angular_distance_all(tables: dict, ctx: S.Context):
    return _angular(tables, ctx, "angular_distance_all", "angular distance d(l, l+k), all tokens")


def _adjacent_cells(probes: pd.DataFrame, probe: str) -> pd.DataFrame:
    """d(l, l+1) per cell and layer l, seeds combined (summaries.cells)."""
    runs = SM.probe_runs(probes, probe)
    return SM.cells(runs[runs["j"] == 1], SM.CELL_KEYS + ["i"])


def angular_adjacent(tables: dict, ctx: S.Context):
    """d(l, l+1) against l for each architecture, one panel per depth (last token, with its 95%
    interval as a band; dashed: all tokens; a cell that did not learn: thin with x markers, its
    solid line dotted)."""
    probes = tables.get("probes", pd.DataFrame())
    last, allt = (
        _adjacent_cells(probes, p) for p in ("angular_distance_last", "angular_distance_all")
    )
    if last.empty:
        return S.message_figure(ctx, "adjacent-layer angular distance", NO_PROBES)
    shapes = R.shapes(last)
    fig, axes = S.panels(len(shapes), ctx, cols=3, sharey=True)
    flat_keys, marked = R.not_learned_keys(tables), 0
    for ax, (L, d) in zip(axes, shapes):
        for arch in R.archs(last):
            st = S.arch_style(arch)
            for data, ls, lab in ((last, "-", arch), (allt, "--", None)):
                g = data[(data["arch"] == arch) & (data["n_layer"] == L)].sort_values("i")
                flat = R.all_in_cells(g, flat_keys)
                marked += flat and ls == "-"
                ax.plot(g["i"], g["value"], **NL.curve_style(st, flat, lab, ls))
                if ls == "-":
                    SM.band(ax, g["i"], g["ci_low"], g["ci_high"], st["color"], UNIT)
        ax.set_title(f"L={L}, d={d}")
        ax.set_xlabel("layer l (pair h_l, h_l+1)")
        ax.set_xticks(range(0, L, max(1, L // 4)))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("d(l, l+1)\nsolid: last token, dashed: all tokens")
    S.legend_over(fig, axes)
    bands = f"bands (last token): {SM.interval_text(last, SEQUENCES)}" + SM.within_text(UNIT)
    S.fig_note(fig, "\n".join(p for p in (bands, NL.not_learned_text(curves=marked)) if p))
    S.title(fig, ctx, "adjacent-layer angular distance d(l, l+1)")
    return fig


def _score_matrices(
    tables: dict, ctx: S.Context, probe: str, key: str, what: str, axes_names: tuple[str, str]
):
    """One score matrix per architecture at the deepest shape (or figures.matrix_n_layer), the
    last-3/4 block outlined, and cells above the threshold dotted."""
    data = R.probe(tables.get("probes", pd.DataFrame()), probe)
    if ctx.matrix_n_layer and not data.empty:
        if not (data["n_layer"] == ctx.matrix_n_layer).any():
            return S.message_figure(
                ctx,
                what,
                f"no trained run at figures.matrix_n_layer = {ctx.matrix_n_layer} "
                f"(depths with rows: {sorted(data['n_layer'].unique().tolist())})",
            )
        data = data[data["n_layer"] == ctx.matrix_n_layer]
    data = R.deepest(data)
    if data.empty:
        return S.message_figure(ctx, what, NO_PROBES)
    threshold = ctx.thresholds[key]
    L, d = R.shapes(data)[-1]
    archs = R.archs(data)
    fig, axes = S.panels(len(archs), ctx, cols=3, scale=0.9)
    vmax = max(2 * threshold, float(np.nanpercentile(data["value"], 95)))
    im = None
    for ax, arch in zip(axes, archs):
        M = R.matrix(data[data["arch"] == arch], (L + 1, L + 1))[1:, 1:]
        im = ax.imshow(
            M, origin="lower", cmap="magma", vmin=0, vmax=vmax, extent=(0.5, L + 0.5, 0.5, L + 0.5)
        )
        ys, xs = np.nonzero(np.nan_to_num(M) > threshold)
        ax.scatter(xs + 1, ys + 1, s=6, c="cyan", marker=".")
        q = L // 4 + 0.5  # the last 3/4 of depth: layers l > L/4
        ax.add_patch(
            S.plt.Rectangle(
                (q, q), L + 0.5 - q, L + 0.5 - q, fill=False, ec="lime", lw=1.2, ls="--"
            )
        )
        ax.set_title(arch)
        ax.set_xlabel(axes_names[1])
        ax.set_ylabel(axes_names[0])
        ticks = range(1, L + 1, max(1, L // 4))
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
    fig.colorbar(
        im, ax=axes, shrink=0.8, label=f"{what.split(' ')[0]} score (cyan dots: > {threshold})"
    )
    S.title(
        fig,
        ctx,
        f"{what}; green dashed: last 3/4 of depth",
        f"L={L}, d={d}" + ("" if ctx.matrix_n_layer else " (deepest shape)"),
    )
    return fig


def causal_matrix(tables: dict, ctx: S.Context):
    return _score_matrices(
        tables,
        ctx,
        "causal_score",
        "causal_threshold",
        "causal score C(s, l)",
        ("skipped layer s", "layer l (l > s)"),
    )


def permutation_matrix(tables: dict, ctx: S.Context):
    return _score_matrices(
        tables,
        ctx,
        "permutation_score",
        "permutation_threshold",
        "permutation score P(a, b)",
        ("layer a", "layer b (b > a)"),
    )


def probe_shares(tables: dict, ctx: S.Context):
    """Share of layer pairs in the last 3/4 of depth above threshold, against depth, with each
    cell's 95% interval as a bar; a cell that did not learn is a cross off the line, no bar."""
    probes = tables.get("probes", pd.DataFrame())
    parts = [
        (SM.probe_cells(probes, p, index=()), k, lab)
        for p, k, lab in (
            ("causal_share", "causal_threshold", "causal score"),
            ("permutation_share", "permutation_threshold", "permutation score"),
        )
    ]
    if all(p[0].empty for p in parts):
        return S.message_figure(ctx, "causal and permutation shares vs depth", NO_PROBES)
    fig, axes = S.panels(2, ctx, cols=2)
    notes, flat_keys, crosses = [], R.not_learned_keys(tables), 0
    for ax, (data, key, lab) in zip(axes, parts):
        curves = {}
        series = [
            (arch, knobs, g.sort_values("n_layer"))
            for arch in R.archs(data)
            for knobs, g in data[data["arch"] == arch].groupby("knobs")
        ]
        for k, (arch, knobs, g) in enumerate(series):
            st, flat = S.arch_style(arch), R.in_cells(g, flat_keys)
            crosses += NL.trend(ax, g["n_layer"], g["value"], flat, st, S.label(arch, knobs))
            x = SM.dodge(g["n_layer"], k, len(series), step=0.08, log=False)  # bars side by side
            SM.error_bars(ax, x, g["ci_low"], g["ci_high"], st["color"], UNIT, skip=flat)
            curves[S.label(arch, knobs)] = g.set_index("n_layer")["value"]
        if data.empty:
            S.note(ax, f"no {lab} rows")
        else:
            ax.set_xticks(sorted(data["n_layer"].unique()))
        ax.set_xlabel("n_layer")
        ax.set_ylabel(f"share of pairs with {lab} > {ctx.thresholds[key]}")
        ax.set_title(f"{lab}\n(pairs in the last 3/4 of depth)")  # two lines: beside the legend
        ax.grid(alpha=0.3)
        groups = S.coinciding(curves)
        if groups:  # under the panels: inside one, a long note would cover its axis label
            notes.append(f"{lab}: {S.coincide_text(groups)}")
    S.legend_over(fig, axes)  # inside a panel, it would lie on a share's line
    bars = SM.interval_text(pd.concat([p[0] for p in parts]), SEQUENCES)
    flat_text = NL.not_learned_text(crosses, bars=True)
    S.fig_note(
        fig, "\n".join(p for p in [f"bars: {bars}" + SM.within_text(UNIT), *notes, flat_text] if p)
    )
    S.title(fig, ctx, "causal and permutation shares vs depth")
    return fig


def logit_lens(tables: dict, ctx: S.Context):
    """The logit lens per layer (depthbench.probes.lens): cross-entropy of each layer's prediction
    (top row) and its top-1 agreement with the model's final prediction (bottom row) against l / L,
    one column per depth, one line per architecture (dotted: a cell that did not learn). Every
    curve ends at l / L = 1 on the model's own loss and at agreement 1."""
    probes = tables.get("probes", pd.DataFrame())
    ce, agree = R.probe(probes, "lens_cross_entropy"), R.probe(probes, "lens_top1_agreement")
    what = "logit lens: each layer's prediction through the final norm and LM head"
    if ce.empty:
        return S.message_figure(ctx, what, NO_PROBES)
    shapes = R.shapes(ce)
    cols = len(shapes)
    # each panel its own cross-entropy scale: a pretrained model's embedding read through its
    # head can sit at 100 nats, which would flatten every other curve of a shared axis
    fig, axes = S.plt.subplots(
        2,
        cols,
        figsize=(max(ctx.width, ctx.width * 0.55 * cols), ctx.height * 1.5),
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    flat_keys, marked = R.not_learned_keys(tables), 0
    for c, (L, d) in enumerate(shapes):
        top, bottom = axes[0][c], axes[1][c]
        for arch in R.archs(ce):
            st = S.arch_style(arch)
            for ax, data in ((top, ce), (bottom, agree)):
                g = data[(data["arch"] == arch) & (data["n_layer"] == L)].sort_values("i")
                if not g.empty:
                    flat = R.all_in_cells(g, flat_keys)
                    marked += flat and ax is top
                    ax.plot(g["i"] / L, g["value"], **NL.curve_style(st, flat, arch))
        top.set_title(f"L={L}, d={d}")
        if c:
            top.set_ylabel("nats")
            bottom.sharey(axes[1][0])
        bottom.set_xlabel("layer l / L (h_0: the embedding)")
        bottom.set_ylim(-0.03, 1.03)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("cross-entropy of the\nlayer's prediction (nats)")
    axes[1][0].set_ylabel("top-1 agreement with\nthe final prediction")
    S.legend_over(fig, axes[0])  # every architecture once, whichever panels it appears in
    if marked:
        S.fig_note(fig, NL.not_learned_text(curves=marked))
    S.title(fig, ctx, what)
    return fig
