"""Figures from the Parquet tables only (never from training code), as PNG and PDF."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from depthbench.io import atomic_write  # noqa: E402


def arch_style(arch: str, archs: list[str]) -> dict:
    """A distinct colour and marker per architecture (more than the 10 default colours)."""
    i = sorted(archs).index(arch) if arch in archs else 0
    colors = list(plt.get_cmap("tab10").colors) + ["black", "darkgoldenrod", "slategray"]
    return {"color": colors[i % len(colors)], "marker": "osD^v<>ph*X"[i % 11]}


def save(fig, png: str | Path, pdf: str | Path, dpi: int) -> None:
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight"))
    atomic_write(pdf, lambda tmp: fig.savefig(tmp, format="pdf", bbox_inches="tight"))
    plt.close(fig)


def _log_ticks(ax, values) -> None:
    """Log-scaled x axis labelled at the values actually used, in plain notation."""
    ax.set_xscale("log")
    ticks = sorted(set(float(v) for v in values))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{v:g}" for v in ticks], rotation=45, fontsize=8)
    ax.minorticks_off()


def _floor(ax, floor: float) -> None:
    ax.axhline(floor, color="0.4", linestyle="--", linewidth=1)
    ax.annotate(f"unigram floor {floor:.2f}", xy=(0.01, floor), xycoords=("axes fraction", "data"),
                xytext=(0, -12), textcoords="offset points", fontsize=8, color="0.3")


def headline(best: pd.DataFrame, runs: pd.DataFrame, png, pdf, width: float, height: float, dpi: int, title: str) -> None:
    """Validation loss at the best learning rate against d_model / n_layer, one line per arch."""
    fig, ax = plt.subplots(figsize=(width, height))
    archs = sorted(best["arch"].unique())
    for (arch, knobs), group in best.groupby(["arch", "knobs"]):
        group = group.sort_values("ratio")
        label = arch if knobs == "{}" else f"{arch} {knobs}"
        ax.plot(group["ratio"], group["final_val_loss"], label=label, **arch_style(arch, archs))
    floor = float(runs["unigram_floor"].iloc[0])
    _floor(ax, floor)
    _log_ticks(ax, best["ratio"].round(1))
    ax.set_xlabel("d_model / n_layer (log scale; deeper and narrower to the left)")
    ax.set_ylabel("validation loss at best LR (nats/token)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2 if len(archs) > 6 else 1)
    ax.grid(alpha=0.3)
    save(fig, png, pdf, dpi)


def loss_vs_lr(runs: pd.DataFrame, png, pdf, width: float, height: float, dpi: int, title: str) -> None:
    """Final validation loss against learning rate, one panel per shape; diverged runs as x."""
    shapes = runs[["n_layer", "d_model"]].drop_duplicates().sort_values("n_layer").itertuples(index=False)
    shapes = list(shapes)
    fig, axes = plt.subplots(1, len(shapes), figsize=(width * max(1, len(shapes)) / 2, height), sharey=True, squeeze=False)
    finite = runs.loc[runs["status"] == "ok", "final_val_loss"]
    top = float(finite.max()) if not finite.empty else float(runs["unigram_floor"].iloc[0])
    for ax, (n_layer, d_model) in zip(axes[0], shapes):
        sub = runs[(runs["n_layer"] == n_layer) & (runs["d_model"] == d_model)]
        archs = sorted(runs["arch"].unique())
        for arch, group in sub.groupby("arch"):
            style = arch_style(arch, archs)
            ok = group[group["status"] == "ok"].groupby("lr", as_index=False)["final_val_loss"].mean()
            ax.plot(ok["lr"], ok["final_val_loss"], label=arch, **style)
            bad = group[group["status"] == "diverged"]
            if not bad.empty:
                ax.scatter(bad["lr"], [top * 1.02] * len(bad), marker="x", color=style["color"])
        _floor(ax, float(runs["unigram_floor"].iloc[0]))
        _log_ticks(ax, runs["lr"])
        ax.set_title(f"L={n_layer}, d={d_model} (ratio {d_model / n_layer:.1f})", fontsize=9)
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final validation loss (x: diverged)")
    axes[0][-1].legend(fontsize=7, ncol=2 if runs["arch"].nunique() > 6 else 1)
    fig.suptitle(title)
    save(fig, png, pdf, dpi)


def loss_curves(curves: pd.DataFrame, best: pd.DataFrame, runs: pd.DataFrame, png, pdf, width: float, height: float, dpi: int, title: str) -> None:
    """Validation loss over training tokens for each (architecture, shape) at its best LR."""
    chosen = runs.merge(best[["arch", "n_layer", "d_model", "knobs", "best_lr"]], on=["arch", "n_layer", "d_model", "knobs"])
    chosen = chosen[chosen["lr"] == chosen["best_lr"]]
    archs = sorted(chosen["arch"].unique())
    fig, axes = plt.subplots(1, max(1, len(archs)), figsize=(width * max(1, len(archs)) / 2, height), sharey=True, squeeze=False)
    for ax, arch in zip(axes[0], archs):
        for row in chosen[chosen["arch"] == arch].sort_values("n_layer").itertuples():
            c = curves[(curves["run_id"] == row.run_id) & curves["val_loss"].notna()]
            ax.plot(c["tokens"], c["val_loss"], label=f"L={row.n_layer}, d={row.d_model}")
        _floor(ax, float(runs["unigram_floor"].iloc[0]))
        ax.set_title(arch, fontsize=9)
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("validation loss")
    fig.suptitle(title)
    save(fig, png, pdf, dpi)


def dynamics(dyn: pd.DataFrame, runs: pd.DataFrame, best: pd.DataFrame, png, pdf, width: float, height: float, dpi: int, title: str) -> None:
    """Deepest shape, best LR: gradient norm of h_l by layer over training (one panel per
    architecture, one line per measured step) and the final residual RMS by layer."""
    chosen = runs.merge(best[["arch", "n_layer", "d_model", "knobs", "best_lr"]], on=["arch", "n_layer", "d_model", "knobs"])
    chosen = chosen[(chosen["lr"] == chosen["best_lr"]) & (chosen["n_layer"] == chosen["n_layer"].max())]
    archs = sorted(chosen["arch"].unique())
    fig, axes = plt.subplots(1, len(archs) + 1, figsize=(width * (len(archs) + 1) / 2, height), squeeze=False)
    axes = axes[0]
    for ax, arch in zip(axes, archs):
        run_id = chosen[chosen["arch"] == arch]["run_id"].iloc[0]
        sub = dyn[(dyn["run_id"] == run_id) & (dyn["quantity"] == "grad_norm_h")]
        steps = sorted(sub["step"].unique())
        cmap = plt.get_cmap("viridis")
        for n, step in enumerate(steps):
            s = sub[sub["step"] == step].sort_values("index")
            ax.plot(s["index"], s["value"], color=cmap(n / max(1, len(steps) - 1)), label=f"step {step}" if n in (0, len(steps) - 1) else None)
        ax.set_yscale("log")
        ax.set_title(f"{arch}: ||dL/dh_l||", fontsize=9)
        ax.set_xlabel("layer l")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for arch in archs:
        run_id = chosen[chosen["arch"] == arch]["run_id"].iloc[0]
        sub = dyn[(dyn["run_id"] == run_id) & (dyn["quantity"] == "residual_rms")]
        last = sub[sub["step"] == sub["step"].max()].sort_values("index")
        ax.plot(last["index"], last["value"], label=arch, **arch_style(arch, archs))
    ax.set_yscale("log")
    ax.set_title("residual RMS by layer (last measurement)", fontsize=9)
    ax.set_xlabel("layer l (h_l)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    save(fig, png, pdf, dpi)
