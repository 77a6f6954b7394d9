"""Training dynamics from results/tables/dynamics.parquet: per layer, the residual RMS, the
RMSNorm backward factor sqrt(d)/||y|| and the gradient norm of h_l, one line per measured step
coloured by step (colour bar), at the deepest shape and each architecture's best LR."""

from __future__ import annotations

import re

import matplotlib as mpl
import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import style as S

QUANTITIES = (
    ("residual_rms", "residual RMS of h_l", "log"),
    ("norm_factor", "RMSNorm backward factor\nsqrt(d)/||y|| (mean per layer)", "linear"),
    ("grad_norm_h", "||dLoss/dh_l||", "log"),
)


def norm_layer(name: str, n_layer: int) -> int:
    """Layer of a norm named by module path ('blocks.3.attn_norm' -> 4); other norms (the final
    norm, an embedding norm) go after the last layer, at L + 1."""
    m = re.search(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) + 1 if m else n_layer + 1


def _series(dyn: pd.DataFrame, run_id: str, quantity: str, n_layer: int) -> pd.DataFrame:
    sub = dyn[(dyn["run_id"] == run_id) & (dyn["quantity"] == quantity)].copy()
    if quantity == "norm_factor" and not sub.empty:
        sub["index"] = [norm_layer(n, n_layer) for n in sub["name"]]
        sub = sub.groupby(["step", "index"], as_index=False)["value"].mean()
    return sub.dropna(subset=["value"])


def dynamics(tables: dict, ctx: S.Context):
    """Rows: architectures; columns: the three quantities against layer; colour: step."""
    dyn, runs, best = (tables.get(k, pd.DataFrame()) for k in ("dynamics", "runs", "best_lr"))
    chosen = R.first_seed(R.deepest(R.best_runs(runs, best)))
    if chosen.empty or not R.has(dyn, "run_id", "quantity", "step"):
        why = (
            "no dynamics rows (train.dynamics_every = 0)"
            if R.has(chosen, "run_id")
            else "no run finished without diverging"
        )
        return S.message_figure(ctx, "training dynamics", why)
    chosen = chosen[chosen["run_id"].isin(set(dyn["run_id"]))]
    if chosen.empty:
        return S.message_figure(ctx, "training dynamics", "the best-LR runs logged no dynamics")
    archs = R.archs(chosen)
    fig, axes = S.panels(3 * len(archs), ctx, cols=3, scale=0.9)
    steps = dyn.loc[dyn["run_id"].isin(set(chosen["run_id"])), "step"]
    norm = mpl.colors.Normalize(
        vmin=float(steps.min()), vmax=float(max(steps.max(), steps.min() + 1))
    )
    cmap = S.plt.get_cmap("viridis")
    L = int(chosen["n_layer"].iloc[0])
    for r, arch in enumerate(archs):
        run = chosen[chosen["arch"] == arch].iloc[0]
        for c, (quantity, ylabel, scale) in enumerate(QUANTITIES):
            ax = axes[3 * r + c]
            sub = _series(dyn, run["run_id"], quantity, L)
            for step, g in sub.groupby("step"):
                g = g.sort_values("index")
                ax.plot(
                    g["index"],
                    g["value"],
                    color=cmap(norm(step)),
                    marker=".",
                    markersize=3,
                    linewidth=1,
                )
            if sub.empty:
                S.note(
                    ax,
                    f"no {quantity} values"
                    + (" (h_l not on the gradient path)" if quantity == "grad_norm_h" else ""),
                )
            elif scale == "log" and (sub["value"] > 0).all():
                ax.set_yscale("log")
            if quantity == "norm_factor" and not sub.empty:
                ax.axhline(1.0, color="firebrick", linestyle="--", linewidth=0.8)
            ax.set_title(f"{arch}: {ylabel.splitlines()[0]}")
            ax.set_ylabel(ylabel, fontsize=S.FONT["tick"])
            ax.set_xlabel("layer l" + (" (L+1: final norm)" if quantity == "norm_factor" else ""))
            ax.grid(alpha=0.3)
    fig.colorbar(
        mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, shrink=0.6, label="optimizer step"
    )
    d = int(chosen["d_model"].iloc[0])
    S.title(
        fig,
        ctx,
        "training dynamics per layer over training",
        f"deepest shape L={L}, d={d}, best LR per architecture",
    )
    return fig
