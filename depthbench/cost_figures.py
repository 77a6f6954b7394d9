"""Figures of the NLL and cost tables: NLL per domain, cost, and loss against cost.

Every figure shows, per architecture (and knob setting), the run at its best learning rate with
seeds averaged (`is_best_lr` in the tables), against d_model / n_layer on a log axis.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd

from depthbench.figures import _log_ticks, arch_style, save


def _best(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["is_best_lr"] & (df["status"] == "ok")]


def _lines(ax, data: pd.DataFrame, x: str, y: str, archs: list[str], label: bool = True) -> None:
    for (arch, knobs), group in data.groupby(["arch", "knobs"]):
        group = group.groupby(x, as_index=False)[y].mean().sort_values(x)
        name = arch if knobs == "{}" else f"{arch} {knobs}"
        ax.plot(group[x], group[y], label=name if label else None, **arch_style(arch, archs))


def _panels(n: int, width: float, height: float):
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols / 1.6, height * rows / 1.2), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _finish(fig, title: str, archs: list[str], png, pdf, dpi: int) -> None:
    """Title, one legend of the architectures below the panels, and the PNG and PDF."""
    fig.suptitle(title)
    fig.legend(fontsize=7, loc="lower center", ncol=min(6, max(1, len(archs))), bbox_to_anchor=(0.5, -0.05))
    fig.tight_layout()
    save(fig, png, pdf, dpi)


def nll_vs_ratio(nll: pd.DataFrame, png, pdf, width: float, height: float, dpi: int, title: str) -> None:
    """Bits per byte of each domain against d_model / n_layer, one panel per domain."""
    data = _best(nll[nll["level"] == "domain"])
    domains = sorted(data["domain"].unique()) or ["(no runs)"]
    archs = sorted(data["arch"].unique())
    fig, axes = _panels(len(domains), width, height)
    for ax, domain in zip(axes, domains):
        part = data[data["domain"] == domain]
        _lines(ax, part, "ratio", "bits_per_byte", archs, label=ax is axes[0])
        if not part.empty:
            _log_ticks(ax, part["ratio"].round(1))
            n_docs = int(part["n_docs"].iloc[0])
            ax.set_title(f"{domain} ({n_docs} docs)", fontsize=9)
        ax.set_xlabel("d_model / n_layer")
        ax.set_ylabel("teacher-forced NLL (bits per byte)")
        ax.grid(alpha=0.3)
    _finish(fig, title, archs, png, pdf, dpi)


COST_PANELS = [
    ("prefill_flops_4096", 1e12, "prefill TFLOPs per 4096-token sequence"),
    ("kv_cache_bytes_4096", 2**20, "KV cache, MiB per 4096 tokens (bf16)"),
    ("measured_peak_memory_bytes", 2**20, "measured peak memory (MiB)"),
]


def cost_vs_ratio(cost: pd.DataFrame, png, pdf, width: float, height: float, dpi: int, title: str) -> None:
    """Prefill FLOPs, KV cache and measured peak memory against d_model / n_layer."""
    data = _best(cost).copy()
    archs = sorted(data["arch"].unique())
    fig, axes = _panels(len(COST_PANELS), width, height)
    for ax, (column, scale, label) in zip(axes, COST_PANELS):
        part = data.dropna(subset=[column]).assign(value=lambda d, c=column, s=scale: d[c].astype(float) / s)
        _lines(ax, part, "ratio", "value", archs, label=ax is axes[0])
        if not part.empty:
            _log_ticks(ax, part["ratio"].round(1))
        if column == "measured_peak_memory_bytes" and not part.empty:
            kinds = ", ".join(sorted(part["peak_memory_kind"].dropna().unique()))
            label = f"{label}\n[{kinds}]"
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlabel("d_model / n_layer")
        ax.grid(alpha=0.3)
    _finish(fig, title, archs, png, pdf, dpi)


def loss_vs_cost(cost: pd.DataFrame, png, pdf, width: float, height: float, dpi: int, title: str) -> None:
    """Validation loss against the cost a user pays: prefill FLOPs and device-hours of training."""
    data = _best(cost).copy()
    data["prefill_tflops"] = data["prefill_flops_4096"] / 1e12
    archs = sorted(data["arch"].unique())
    fig, axes = _panels(2, width, height)
    for ax, (x, label) in zip(axes, [("prefill_tflops", "prefill TFLOPs per 4096-token sequence"), ("device_hours", "device-hours of the training run")]):
        for (arch, knobs), group in data.groupby(["arch", "knobs"]):
            group = group.groupby("n_layer", as_index=False)[[x, "final_val_loss"]].mean().sort_values(x)
            name = arch if knobs == "{}" else f"{arch} {knobs}"
            ax.plot(group[x], group["final_val_loss"], label=name if ax is axes[0] else None, **arch_style(arch, archs))
            for _, r in group.iterrows():
                ax.annotate(f"L{int(r['n_layer'])}", (r[x], r["final_val_loss"]), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel(label + " (log)")
        ax.set_ylabel("validation loss at best LR (nats/token)")
        ax.grid(alpha=0.3)
    _finish(fig, title, archs, png, pdf, dpi)
