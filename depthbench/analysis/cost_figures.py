"""Cost figures from results/tables/cost.parquet: analytic prefill FLOPs and KV cache against
d_model / n_layer, measured peak memory only for GPU runs (device 'cuda...': the allocator's
peak; on CPU the process's max RSS is mostly the Python runtime and is not drawn), and loss
against prefill FLOPs and, for GPU runs, device-hours (CPU timings of tiny models are noise)."""

from __future__ import annotations

import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import style as S

CPU_NOTE = "CPU runs only: measured {what} not drawn\n({why})"
WHY = {
    "peak memory": "on CPU it measures the Python process, not the model",
    "device-hours": "CPU timings of tiny models are noise, not the model's cost",
}


def _best(cost: pd.DataFrame) -> pd.DataFrame:
    if not R.has(cost, "is_best_lr", "status"):
        return pd.DataFrame()
    return cost[cost["is_best_lr"].fillna(False).astype(bool) & (cost["status"] == "ok")]


def _gpu(df: pd.DataFrame) -> pd.DataFrame:
    return (
        df[df["device"].fillna("").astype(str).str.startswith("cuda")]
        if "device" in df
        else df.iloc[0:0]
    )


def _lines(ax, data: pd.DataFrame, x: str, y: str, label_points: bool = False) -> dict:
    curves = {}
    order = R.archs(data)
    for (arch, knobs), g in sorted(
        data.groupby(["arch", "knobs"]), key=lambda kv: order.index(kv[0][0])
    ):
        g = (
            g.groupby(x, as_index=False)
            .agg(**{y: (y, "mean"), "n_layer": ("n_layer", "first")})
            .sort_values(x)
        )
        name = S.label(arch, knobs)
        ax.plot(g[x], g[y], label=name, **S.arch_style(arch))
        curves[name] = g.set_index(x)[y]
        if label_points:
            for _, r in g.iterrows():
                ax.annotate(
                    f"L{int(r['n_layer'])}",
                    (r[x], r[y]),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
    return curves


def cost_vs_ratio(tables: dict, ctx: S.Context):
    """Prefill FLOPs and KV cache (analytic, every shape: no best-LR filter needed) and measured
    peak memory (GPU runs at the best LR only) against d_model / n_layer."""
    cost = tables.get("cost", pd.DataFrame())
    if not R.has(cost, "ratio", "prefill_flops_4096"):
        return S.message_figure(ctx, "inference and memory cost vs shape", "no cost rows")
    fig, axes = S.panels(3, ctx, cols=3)
    analytic = cost.drop_duplicates(subset=["arch", "knobs", "n_layer", "d_model"]).assign(
        tflops=lambda d: d["prefill_flops_4096"] / 1e12,
        kv=lambda d: d["kv_cache_bytes_4096"] / 2**20,
    )
    notes = []
    for ax, col, ylabel in (
        (axes[0], "tflops", "prefill TFLOPs per 4096-token sequence"),
        (axes[1], "kv", "KV cache per 4096 tokens (MiB, bf16)"),
    ):
        groups = S.coinciding(_lines(ax, analytic, "ratio", col))
        if groups:
            notes.append(f"{ylabel.split(' ')[0]}: {S.coincide_text(groups)}")
        ax.set_ylabel(ylabel)
    gpu = (
        _gpu(_best(cost)).dropna(subset=["measured_peak_memory_bytes"])
        if "measured_peak_memory_bytes" in cost
        else pd.DataFrame()
    )
    if gpu.empty:
        S.note(axes[2], CPU_NOTE.format(what="peak memory", why=WHY["peak memory"]))
        axes[2].set_xticks([])
        axes[2].set_yticks([])
    else:
        _lines(axes[2], gpu.assign(mib=gpu["measured_peak_memory_bytes"] / 2**20), "ratio", "mib")
        axes[2].set_ylabel("measured peak GPU memory (MiB, allocator)")
    for ax in axes:
        if ax.lines:
            S.log_ticks(ax, analytic["ratio"].round(1))
        ax.set_xlabel("d_model / n_layer (log)")
        ax.grid(alpha=0.3)
    S.legend(axes[0])
    if notes:
        S.fig_note(fig, "\n".join(notes))
    S.title(fig, ctx, "inference and memory cost vs shape")
    return fig


def loss_vs_cost(tables: dict, ctx: S.Context):
    """Validation loss at the best LR against prefill FLOPs, and against device-hours of
    training for GPU runs (points labelled by depth)."""
    data = _best(tables.get("cost", pd.DataFrame()))
    if data.empty:
        return S.message_figure(
            ctx, "loss vs cost", "no cost rows of a best-LR run that did not diverge"
        )
    data = data.assign(tflops=data["prefill_flops_4096"] / 1e12)
    fig, axes = S.panels(2, ctx, cols=2, sharey=True)
    _lines(axes[0], data, "tflops", "final_val_loss", label_points=True)
    axes[0].set_xlabel("prefill TFLOPs per 4096-token sequence (log)")
    axes[0].set_xscale("log")
    gpu = _gpu(data)
    if gpu.empty:
        S.note(axes[1], CPU_NOTE.format(what="device-hours", why=WHY["device-hours"]))
        axes[1].set_xticks([])
    else:
        _lines(axes[1], gpu, "device_hours", "final_val_loss", label_points=True)
        axes[1].set_xscale("log")
        axes[1].set_xlabel("device-hours of the training run (GPU, log)")
    axes[0].set_ylabel("validation loss at best LR (nats/token)")
    for ax in axes:
        ax.grid(alpha=0.3)
    S.legend(axes[0])
    S.title(fig, ctx, "loss vs cost (points: depth L)")
    return fig
