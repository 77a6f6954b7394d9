"""Probes over training (probes.at_steps): when do layers stop mattering? From the "snapshot"
rows of results/tables/probes.parquet (depthbench.probes.steps), best-LR run of each
architecture and shape (first seed), against the optimizer step on a log axis.

- `probes_over_training`: rows = depths, columns = causal share, permutation share, adjacent
  angular distance averaged over layers (mean over l of d(l, l+1), last token) and token
  similarity at the last layer h_L; one line per architecture; token similarity at init
  (step 0, off the log axis) as a dotted line in the architecture's colour.
- `adjacent_distance_over_training`: d(l, l+1) per layer (y) and step (x) as heatmaps laid out
  architecture x depth on one colour scale.

The final step is a snapshot too, so every curve ends on the final model's probe value.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from depthbench.analysis import readers as R
from depthbench.analysis import style as S

STAGE = "snapshot"
NO_STEPS = "no probe rows over training (set probes.at_steps, e.g. {log_spaced: 6})"

# (column title, y label): one column each in probes_over_training
QUANTITIES = (
    ("causal share", "share of late pairs with C(s, l) > {causal_threshold}"),
    ("permutation share", "share of late pairs with P(a, b) > {permutation_threshold}"),
    ("adjacent angular distance", "mean over l of d(l, l+1)\n(last token)"),
    ("token similarity at h_L", "mean pairwise cosine of tokens\nat the last layer h_L"),
)


def step_rows(probes: pd.DataFrame, name: str) -> pd.DataFrame:
    """Snapshot rows of one probe, one run per (arch, shape, knobs): the best-LR run, first seed."""
    if not R.has(probes, "probe", "stage", "step", "value", *R.SHAPE_KEYS):
        return pd.DataFrame(
            columns=["run_id", "probe", "stage", "step", "i", "j", "value", *R.SHAPE_KEYS, "seed"]
        )
    sub = probes[(probes["probe"] == name) & (probes["stage"] == STAGE)]
    if "is_best_lr" in sub.columns:
        sub = sub[sub["is_best_lr"].fillna(False).astype(bool)]
    return R.first_seed(sub)


def quantity_series(probes: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """{column title: rows (arch, n_layer, d_model, step, value)}: each quantity per step."""
    keys = ["arch", "n_layer", "d_model", "step"]
    adjacent = step_rows(probes, "angular_distance_last")
    tsim = step_rows(probes, "token_similarity")
    return {
        "causal share": step_rows(probes, "causal_share")[keys + ["value"]],
        "permutation share": step_rows(probes, "permutation_share")[keys + ["value"]],
        "adjacent angular distance": adjacent[adjacent["j"] == 1]
        .groupby(keys, as_index=False)["value"]
        .mean(),
        "token similarity at h_L": tsim[tsim["i"] == tsim["n_layer"]][keys + ["value"]],
    }


def _init_tsim(probes: pd.DataFrame) -> pd.DataFrame:
    """Token similarity at h_L at init (stage init, step 0), per architecture and depth."""
    rows = R.probe(probes, "token_similarity", "init")
    return rows[rows["i"] == rows["n_layer"]]


def probes_over_training(tables: dict, ctx: S.Context):
    probes = tables.get("probes", pd.DataFrame())
    series = quantity_series(probes)
    if all(s.empty for s in series.values()):
        return S.message_figure(ctx, "probes over training", NO_STEPS)
    shapes = R.shapes(pd.concat([s for s in series.values() if not s.empty]))
    archs = R.archs(pd.concat([s for s in series.values() if not s.empty]))
    init = _init_tsim(probes)
    fig, axes = S.panels(len(QUANTITIES) * len(shapes), ctx, cols=len(QUANTITIES), scale=0.9)
    for r, (L, d) in enumerate(shapes):
        for c, (what, ylabel) in enumerate(QUANTITIES):
            ax = axes[r * len(QUANTITIES) + c]
            data = series[what]
            data = data[data["n_layer"] == L]
            for arch in archs:
                g = data[data["arch"] == arch].sort_values("step")
                if not g.empty:
                    ax.plot(
                        g["step"].astype(float),
                        g["value"],
                        label=arch,
                        linewidth=1.2,
                        **S.arch_style(arch),
                    )
                if c == 3:
                    base = init[(init["arch"] == arch) & (init["n_layer"] == L)]["value"]
                    if not base.empty:
                        ax.axhline(
                            float(base.iloc[0]),
                            color=S.arch_style(arch)["color"],
                            linestyle=":",
                            linewidth=1,
                        )
            if data.empty:
                S.note(ax, f"no {what} rows at L={L}")
                continue
            S.log_ticks(ax, data["step"].astype(float).unique())
            if c < 2:  # shares are fractions: one fixed range, so a flat line reads as its value
                ax.set_ylim(-0.03, 1.03)
            ax.set_title(f"{what}, L={L}, d={d}")
            ax.set_xlabel("optimizer step (log)")
            ax.set_ylabel(ylabel.format(**ctx.thresholds), fontsize=S.FONT["tick"])
            ax.grid(alpha=0.3)
    handles = [Line2D([], [], label=a, **S.arch_style(a)) for a in archs]
    handles.append(
        Line2D([], [], color="0.3", linestyle=":", label="token similarity at init (step 0)")
    )
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 6),
        fontsize=S.FONT["legend"],
    )
    S.title(
        fig,
        ctx,
        "probes over training (probes.at_steps)",
        "best LR per architecture and depth, first seed",
    )
    return fig


def _edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges on a log axis: geometric midpoints between steps, mirrored at both ends."""
    logs = np.log(steps.astype(float))
    if len(logs) == 1:
        return np.exp([logs[0] - 0.5, logs[0] + 0.5])
    mids = (logs[1:] + logs[:-1]) / 2
    return np.exp(np.concatenate([[2 * logs[0] - mids[0]], mids, [2 * logs[-1] - mids[-1]]]))


def adjacent_distance_over_training(tables: dict, ctx: S.Context):
    what = "adjacent angular distance d(l, l+1) per layer over training"
    rows = step_rows(tables.get("probes", pd.DataFrame()), "angular_distance_last")
    rows = rows[rows["j"] == 1]
    if rows.empty:
        return S.message_figure(ctx, what, NO_STEPS)
    vmax = float(np.ceil(rows["value"].max() * 10) / 10) or 0.1
    depths = [L for L, _ in R.shapes(rows)]
    fig, axes, cells = S.arch_depth_grid(rows, R.archs(rows), depths, ctx, "no snapshot rows")
    mesh = None
    for ax, arch, L, cell in cells:
        M = cell.pivot_table(index="i", columns="step", values="value", aggfunc="mean").reindex(
            range(L)
        )
        steps = M.columns.to_numpy(dtype=float)
        mesh = ax.pcolormesh(
            _edges(steps), np.arange(L + 1) - 0.5, M.to_numpy(), vmin=0, vmax=vmax, cmap="viridis"
        )
        S.log_ticks(ax, steps)
        ax.set_yticks(range(0, L, max(1, L // 4)))
        ax.set_title(f"{arch}, L={L}, d={int(cell['d_model'].iloc[0])}")
        ax.set_xlabel("optimizer step (log)")
        ax.set_ylabel("layer l (pair h_l, h_l+1)")
    fig.colorbar(
        mesh, ax=axes, shrink=0.8, label="d(l, l+1) = arccos(cos(h_l, h_l+1)) / pi, last token"
    )
    S.title(fig, ctx, what, "best LR per architecture and depth, first seed")
    return fig
