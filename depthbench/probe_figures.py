"""Probe figures, drawn from results/tables/probes.parquet only (best-LR run of each
architecture and shape; the first seed where several exist)."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from depthbench.figures import arch_style, save  # noqa: E402


def _best(probes: pd.DataFrame, probe: str, stage: str = "trained") -> pd.DataFrame:
    sub = probes[(probes["probe"] == probe) & (probes["stage"] == stage) & probes["is_best_lr"]]
    if sub.empty:
        return sub
    first_seed = sub.groupby(["arch", "n_layer", "d_model", "knobs"])["seed"].transform("min")
    return sub[sub["seed"] == first_seed]


def _grid(n: int, width: float, height: float):
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols / 2, height * rows / 1.6), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat)


def _panel_matrices(data: pd.DataFrame, size) -> list[tuple[tuple, np.ndarray]]:
    """One (arch, n_layer, d_model) panel each: the rows' values placed at (i, j) in a NaN
    matrix of shape size(sub, n_layer)."""
    panels = []
    for key in sorted(data.groupby(["arch", "n_layer", "d_model"]).groups):
        arch, n_layer, d_model = key
        sub = data[(data["arch"] == arch) & (data["n_layer"] == n_layer) & (data["d_model"] == d_model)]
        M = np.full(size(sub, n_layer), np.nan)
        M[sub["i"].to_numpy(), sub["j"].to_numpy()] = sub["value"].to_numpy()
        panels.append((key, M))
    return panels


def angular_distance(probes, png, pdf, title, thresholds, width, height, dpi):
    """Heatmap of d(l, l+k) (last token) per (architecture, shape)."""
    panels = _panel_matrices(_best(probes, "angular_distance_last"), lambda sub, L: (L + 1, L + 1))
    fig, axes = _grid(len(panels), width, height)
    for ax, ((arch, n_layer, d_model), M) in zip(axes, panels):
        im = ax.imshow(M[:, 1:].T, origin="lower", aspect="auto", vmin=0, vmax=0.5, cmap="viridis")
        ax.set_title(f"{arch} L={n_layer} d={d_model}", fontsize=8)
        ax.set_xlabel("layer l", fontsize=7)
        ax.set_ylabel("offset k", fontsize=7)
        ax.set_yticks(range(0, n_layer, max(1, n_layer // 4)))
        ax.set_yticklabels([str(k + 1) for k in range(0, n_layer, max(1, n_layer // 4))])
        ax.tick_params(labelsize=6)
    fig.colorbar(im, ax=axes, shrink=0.6, label="arccos(cos(h_l, h_l+k)) / pi")
    fig.suptitle(title)
    save(fig, png, pdf, dpi)


def probe_shares(probes, png, pdf, title, thresholds, width, height, dpi):
    """Share of layer pairs in the last 3/4 of depth above threshold, against depth."""
    fig, axes = plt.subplots(1, 2, figsize=(width * 1.6, height))
    archs = sorted(probes["arch"].unique())
    for ax, (probe, key, label) in zip(axes, (("causal_share", "causal_threshold", "causal score"), ("permutation_share", "permutation_threshold", "permutation score"))):
        data = _best(probes, probe)
        for arch, group in data.groupby("arch"):
            group = group.sort_values("n_layer")
            ax.plot(group["n_layer"], group["value"], label=arch, **arch_style(arch, archs))
        ax.set_xlabel("n_layer")
        ax.set_ylabel(f"share of pairs with {label} > {thresholds[key]}")
        ax.set_title(f"{label} (last 3/4 of depth)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2 if len(archs) > 6 else 1)
    fig.suptitle(title)
    save(fig, png, pdf, dpi)


def _by_layer(probes, probe, stage, ax, archs, n_layer=None):
    data = _best(probes, probe, stage)
    if n_layer is None and not data.empty:
        n_layer = data["n_layer"].max()
    data = data[data["n_layer"] == n_layer]
    for arch, group in data.groupby("arch"):
        group = group.sort_values("i")
        ax.plot(group["i"], group["value"], label=arch, **arch_style(arch, archs))
    return n_layer


def token_similarity_init(probes, png, pdf, title, thresholds, width, height, dpi):
    """Token similarity by layer at init, with and without the prefix-average part of attention
    (post_ln against pre_ln and every other architecture in the grid), deepest shape."""
    archs = sorted(probes["arch"].unique())
    fig, axes = plt.subplots(1, 3, figsize=(width * 2, height), sharey=True)
    for ax, (probe, stage, label) in zip(axes, (
        ("token_similarity", "init", "at init"),
        ("token_similarity", "init_no_prefix_avg", "at init, prefix-average part removed"),
        ("token_similarity", "trained", "trained"),
    )):
        L = _by_layer(probes, probe, stage, ax, archs)
        ax.set_title(f"{label} (L={L})", fontsize=9)
        ax.set_xlabel("layer l (h_l)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean pairwise cosine of tokens")
    axes[-1].legend(fontsize=7, ncol=2 if len(archs) > 6 else 1)
    fig.suptitle(title)
    save(fig, png, pdf, dpi)


def effective_rank(probes, png, pdf, title, thresholds, width, height, dpi):
    archs = sorted(probes["arch"].unique())
    fig, ax = plt.subplots(figsize=(width, height))
    L = _by_layer(probes, "effective_rank", "trained", ax, archs)
    ax.set_xlabel("layer l (h_l)")
    ax.set_ylabel("effective rank of the token matrix")
    ax.set_title(f"{title} (L={L})", fontsize=9)
    ax.legend(fontsize=7, ncol=2 if len(archs) > 6 else 1)
    ax.grid(alpha=0.3)
    save(fig, png, pdf, dpi)


def _summary_vs_depth(probes, probe, ylabel, png, pdf, title, width, height, dpi, ylim=None):
    """One summary number per run against n_layer, one line per architecture."""
    archs = sorted(probes["arch"].unique())
    data = _best(probes, probe)
    fig, ax = plt.subplots(figsize=(width, height))
    for arch, group in data.groupby("arch"):
        group = group.sort_values("n_layer")
        ax.plot(group["n_layer"], group["value"], label=arch, **arch_style(arch, archs))
    ax.set_xlabel("n_layer")
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2 if len(archs) > 6 else 1)
    ax.grid(alpha=0.3)
    save(fig, png, pdf, dpi)


def usefulness(probes, png, pdf, title, thresholds, width, height, dpi):
    """Fraction of useful layers (affine-replacement loss ratio above threshold) per shape."""
    ylabel = f"fraction of layers with r_l > {thresholds['usefulness_threshold']}"
    _summary_vs_depth(probes, "useful_fraction", ylabel, png, pdf, title, width, height, dpi, ylim=(-0.05, 1.05))


def residual_product_rank(probes, png, pdf, title, thresholds, width, height, dpi):
    """hc against mhc: effective rank of the product of stream-mixing matrices."""
    _summary_vs_depth(probes, "residual_product_rank", "effective rank of the stream-mixing product", png, pdf, title, width, height, dpi)


def depth_mixing(probes, png, pdf, title, thresholds, width, height, dpi):
    """Mean depth-softmax weight of every sublayer (rows) on every source (columns), attnres."""
    size = lambda sub, L: (int(sub["i"].max()) + 1, int(sub["j"].max()) + 1)  # noqa: E731
    panels = _panel_matrices(_best(probes, "depth_weight"), size)
    fig, axes = _grid(len(panels), width, height)
    for ax, ((arch, n_layer, d_model), M) in zip(axes, panels):
        im = ax.imshow(M[1:], origin="lower", aspect="auto", vmin=0, vmax=1, cmap="magma")
        ax.set_title(f"{arch} L={n_layer} d={d_model}", fontsize=8)
        ax.set_xlabel("source (0 = embedding)", fontsize=7)
        ax.set_ylabel("reading sublayer (last: final)", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.colorbar(im, ax=axes, shrink=0.6, label="softmax weight")
    fig.suptitle(title)
    save(fig, png, pdf, dpi)
