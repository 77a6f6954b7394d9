"""Per-layer probe figures: usefulness ratio r_l with the threshold drawn, token similarity and
effective rank per layer (at init, at init without the prefix-average part of attention, and
trained). From results/tables/probes.parquet: every seed of each cell at its best LR (at init,
its lowest LR), combined per layer with a 95% interval drawn as a band (analysis.summaries)."""

from __future__ import annotations

import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import not_learned as NL
from depthbench.analysis import style as S
from depthbench.analysis import summaries as SM

NO_PROBES = "no probe rows at this stage (probes disabled, or every run diverged)"
SEQUENCES = "the probe sequences"


def _layer_cells(probes: pd.DataFrame, probe: str, stage: str = "trained") -> pd.DataFrame:
    return SM.probe_cells(probes, probe, stage, index=("i",))


def _per_layer(
    ax, data: pd.DataFrame, L: int, first: int = 0, within=None, flat_keys=frozenset()
) -> tuple[int, str]:
    """One line per architecture of value against layer i (i >= first) at depth L, its 95%
    interval as a band (drawn inside `within`, the quantity's range, where it has one); the
    curve of a cell in `flat_keys` (readers.not_learned_keys) marked by style.curve_style. The
    number of curves so marked, and which curves coincide ('' for none) for the figure's note:
    inside a panel a third of the figure wide, the note would be wider than the panel."""
    curves, marked = {}, 0
    for arch in R.archs(data):
        g = data[
            (data["arch"] == arch) & (data["n_layer"] == L) & (data["i"] >= first)
        ].sort_values("i")
        if not g.empty:
            st, flat = S.arch_style(arch), R.all_in_cells(g, flat_keys)
            marked += flat
            ax.plot(g["i"], g["value"], **NL.curve_style(st, flat, arch))
            SM.band(ax, g["i"], g["ci_low"], g["ci_high"], st["color"], within)
            curves[arch] = g.set_index("i")["value"]
    ax.set_xticks(range(first, L + 1, max(1, L // 4)))
    ax.grid(alpha=0.3)
    return marked, S.coincide_text(S.coinciding(curves))


def _coincide_notes(said: dict[str, list[str]]) -> list[str]:
    """One note line per coincide text, naming the panels it holds in."""
    return [f"{', '.join(panels)}: {text}" for text, panels in said.items() if text]


def usefulness(tables: dict, ctx: S.Context):
    """r_l = loss with layer l replaced by its affine least-squares fit / loss, per layer, one
    panel per depth; the dashed line is the usefulness threshold (a layer above it is useful)."""
    data = _layer_cells(tables.get("probes", pd.DataFrame()), "usefulness_ratio")
    if data.empty:
        return S.message_figure(ctx, "usefulness ratio r_l per layer", NO_PROBES)
    shapes = R.shapes(data)
    fig, axes = S.panels(len(shapes), ctx, cols=3, sharey=True)
    threshold = ctx.thresholds["usefulness_threshold"]
    flat_keys, marked, said = R.not_learned_keys(tables), 0, {}
    for ax, (L, d) in zip(axes, shapes):
        n, same = _per_layer(ax, data, L, first=1, flat_keys=flat_keys)
        marked += n
        said.setdefault(same, []).append(f"L={L}")
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
    S.legend_over(fig, axes)
    missing = sorted(
        set(tables.get("probes", pd.DataFrame()).get("arch", pd.Series(dtype=str)).unique())
        - set(data["arch"])
    )
    notes = [f"bands: {SM.interval_text(data, SEQUENCES)}", *_coincide_notes(said)]
    if missing:
        notes.append(f"not defined for {', '.join(missing)} (no usefulness rows)")
    if marked:
        notes.append(NL.not_learned_text(curves=marked))
    S.fig_note(fig, "\n".join(notes))
    S.title(fig, ctx, "usefulness: per-layer ratio r_l (above the red line: layer useful)")
    return fig


STAGES = (
    ("init", "at init"),
    ("init_no_prefix_avg", "at init, prefix-average part removed"),
    ("trained", "trained"),
)


def _stages_figure(tables: dict, ctx: S.Context, probe: str, ylabel: str, what: str, within=None):
    """Three panels (init, init without prefix-average, trained) at the deepest shape; in the
    trained panel the curve of a cell that did not learn is marked (at init nothing has
    trained, so every init curve is drawn alike)."""
    probes = tables.get("probes", pd.DataFrame())
    parts = [(_layer_cells(probes, probe, stage), lab) for stage, lab in STAGES]
    present = [p for p, _ in parts if not p.empty]
    if not present:
        return S.message_figure(ctx, what, NO_PROBES)
    L = max(int(p["n_layer"].max()) for p in present)
    fig, axes = S.panels(3, ctx, cols=3, sharey=True)
    flat_keys, marked, said = R.not_learned_keys(tables), 0, {}
    for ax, (data, lab), (stage, _) in zip(axes, parts, STAGES):
        data = data[data["n_layer"] == L]
        trained = flat_keys if stage == "trained" else frozenset()
        n, same = _per_layer(ax, data, L, within=within, flat_keys=trained)
        marked += n
        said.setdefault(same, []).append(lab)
        if data.empty:
            S.note(ax, f"no rows {lab}")
        ax.set_title(lab)
        ax.set_xlabel("layer l (h_l)")
    axes[0].set_ylabel(ylabel)
    S.legend_over(fig, axes)
    d = (
        int(present[0].loc[present[0]["n_layer"] == L, "d_model"].iloc[0])
        if (present[0]["n_layer"] == L).any()
        else None
    )
    bands = f"bands: {SM.interval_text(pd.concat(present), SEQUENCES)}" + (
        SM.within_text(within) if within else ""
    )
    notes = [bands, *_coincide_notes(said), NL.not_learned_text(curves=marked)]
    S.fig_note(fig, "\n".join(p for p in notes if p))
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
