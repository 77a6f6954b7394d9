"""The one plotting style of DepthBench's figures: a colour and marker per architecture, sizes
and fonts, the unigram-floor line, log ticks at the values used, the "what is missing" note,
and PNG + PDF written atomically (the marks of a cell that did not learn: not_learned.py).

Every figure function builds its matplotlib Figure through `panels` (or `message_figure` when
nothing can be drawn) and the registry saves it with `save`, so sizes and fonts are set here
only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

if TYPE_CHECKING:
    import pandas

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from depthbench.util.io import atomic_write  # noqa: E402

COLORS = list(plt.get_cmap("tab10").colors) + ["black", "darkgoldenrod", "slategray"]
MARKERS = "osD^v<>ph*X"
FONT = {"title": 9, "label": 8, "tick": 7, "legend": 7, "note": 8}
plt.rcParams.update(
    {
        "font.size": FONT["label"],
        "axes.titlesize": FONT["title"],
        "axes.labelsize": FONT["label"],
        "xtick.labelsize": FONT["tick"],
        "ytick.labelsize": FONT["tick"],
        "legend.fontsize": FONT["legend"],
    }
)


@dataclass
class Context:
    """What every figure gets besides its tables: size, resolution, the title prefix (the
    config's name), a one-line description of the grid (config, budget, depths, LRs, seeds) and
    the probe thresholds."""

    width: float = 6.0
    height: float = 4.0
    dpi: int = 150
    experiment: str = "experiment"
    grid_line: str = ""
    budget: float | None = None
    matrix_n_layer: int | None = None  # depth of the score matrices (None: the deepest)
    thresholds: dict = field(
        default_factory=lambda: {
            "causal_threshold": 0.45,
            "permutation_threshold": 0.15,
            "usefulness_threshold": 1.1,
            "dead_zone_threshold": 0.05,
        }
    )


def arch_order() -> list[str]:
    """Every registered architecture in the registry's order (registration_order, read without
    importing the architectures: a figure job builds no model and imports no torch): a fixed
    order, so an architecture keeps its colour across figures and grids (a grid's own sorted
    list would recolour pre_ln when hc is added), and a new one, registered last, takes the
    next colour."""
    from depthbench.models.registry import style_order

    return style_order()


def arch_style(arch: str, offset: int = 0) -> dict:
    """Colour and marker of an architecture (names the registry does not know after the
    registered ones)."""
    order = arch_order()
    i = order.index(arch) if arch in order else len(order) + offset
    return {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)], "markersize": 5}


def label(arch: str, knobs: str = "{}") -> str:
    return arch if knobs in ("{}", "", None) else f"{arch} {knobs}"


def panels(n: int, ctx: Context, cols: int | None = None, scale: float = 1.0, **kw):
    """A figure of n panels in a grid of at most `cols` columns, each panel about half the
    configured width, with room between rows for titles (constrained layout)."""
    n = max(1, n)
    cols = min(n, cols or 3)
    rows = math.ceil(n / cols)
    size = (
        max(ctx.width, ctx.width * 0.55 * cols) * scale,
        ctx.height * (0.55 + 0.45 * rows) * scale,
    )
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False, layout="constrained", **kw)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def title(fig, ctx: Context, text: str, depth: str = "") -> None:
    """Figure title: the config name and what is shown, then the grid line and depth shown."""
    second = " | ".join(p for p in (ctx.grid_line, depth) if p)
    fig.suptitle(
        f"{ctx.experiment}: {text}" + (f"\n{second}" if second else ""), fontsize=FONT["title"] + 1
    )


def note(ax, text: str, y: float = 0.5) -> None:
    """A message inside a panel saying what is missing (or why lines coincide)."""
    ax.text(
        0.5,
        y,
        text,
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=FONT["note"],
        color="0.25",
        wrap=True,
        bbox={"boxstyle": "round", "fc": "0.95", "ec": "0.7"},
    )


def fig_note(fig, text: str) -> None:
    """A note under the panels (e.g. which encodings coincide)."""
    fig.text(
        0.5, -0.01, text, ha="center", va="top", fontsize=FONT["note"], color="0.25", wrap=True
    )


def message_figure(ctx: Context, what: str, message: str):
    """The figure drawn when there is nothing to plot: it says what it would show and what is
    missing, so the workflow finishes and the report explains the gap."""
    fig, (ax,) = panels(1, ctx)
    ax.set_axis_off()
    note(ax, f"Nothing to draw: {message}")
    title(fig, ctx, what)
    return fig


def log_ticks(ax, values, axis: str = "x") -> None:
    """Log axis labelled at the values actually used, in plain notation."""
    ticks = sorted({round(float(v), 6) for v in values if v == v and v > 0})
    getattr(ax, f"set_{axis}scale")("log")
    if ticks:
        getattr(ax, f"set_{axis}ticks")(ticks)
        getattr(ax, f"set_{axis}ticklabels")(
            [f"{v:g}" for v in ticks], rotation=45 if axis == "x" else 0
        )
    ax.minorticks_off()


def count_axis(ax, axis: str = "x") -> None:
    """Large counts (tokens, steps) as 100k, 1.5M with at most 5 ticks, so labels never touch."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(MaxNLocator(5))
    target.set_major_formatter(EngFormatter(sep=""))


def floor_line(ax, floor: float | None) -> None:
    """The unigram loss floor: a run near it has collapsed."""
    if floor is None or floor != floor:
        return
    ax.axhline(floor, color="0.4", linestyle="--", linewidth=1, label=f"unigram floor {floor:.2f}")


def coinciding(curves: "dict[str, pandas.Series]", rel: float = 0.002) -> list[list[str]]:
    """Groups of labels whose curves (Series indexed by x) agree within rel of the value range
    at every common x: drawn, only the last one's colour would show, so figures say so."""
    names = list(curves)
    values = [v for c in curves.values() for v in c.tolist() if v == v]
    span = (max(values) - min(values)) if values else 0.0
    tol = rel * span if span > 0 else 1e-12
    groups: list[list[str]] = []
    for name in names:
        for g in groups:
            a, b = curves[g[0]], curves[name]
            common = a.index.intersection(b.index)
            if (
                len(common)
                and len(common) == len(a) == len(b)
                and float((a[common] - b[common]).abs().max()) <= tol
            ):
                g.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def coincide_text(groups: list[list[str]]) -> str:
    return "; ".join(" = ".join(g) for g in groups) + (
        " coincide (within 0.2% of the range): their markers overlap" if groups else ""
    )


def legend(ax_or_fig, **kw) -> None:
    handles, labels = (
        ax_or_fig.get_legend_handles_labels()
        if hasattr(ax_or_fig, "get_legend_handles_labels")
        else ([], [])
    )
    if labels:
        ax_or_fig.legend(fontsize=FONT["legend"], **kw)


def legend_over(fig, axes) -> None:
    """One legend right of the panels of the labelled artists of every panel in `axes`, each
    label once: a label drawn in one panel only (a curve marked as not learned) is still
    explained, and no panel's curves lie under it."""
    entries: dict = {}
    for a in axes:
        for handle, text in zip(*a.get_legend_handles_labels()):
            entries.setdefault(text, handle)
    if entries:
        fig.legend(
            list(entries.values()),
            list(entries),
            loc="outside right center",
            fontsize=FONT["legend"],
        )


def save(fig, png: str | Path, pdf: str | Path, dpi: int) -> None:
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight"))
    # the PDF keeps the layout constrained layout found for the PNG: laying the figure out again
    # at the PDF's 72 dpi moved its axes by a fraction of a point and took about a sixth of a
    # figure job
    fig.set_layout_engine("none")
    atomic_write(pdf, lambda tmp: fig.savefig(tmp, format="pdf", bbox_inches="tight"))
    plt.close(fig)


def arch_depth_grid(data, archs: list[str], depths: list[int], ctx: "Context", missing: str):
    """A panel per (architecture, depth) of a probe's rows, architectures as rows and depths as
    columns: the figure, its axes, and (ax, arch, L, rows) for every panel with rows; an empty
    panel says `missing` ("no trained run") and is switched off."""
    fig, axes = panels(len(archs) * len(depths), ctx, cols=len(depths), scale=0.9)
    cells = []
    for r, arch in enumerate(archs):
        for c, L in enumerate(depths):
            ax = axes[r * len(depths) + c]
            rows = data[(data["arch"] == arch) & (data["n_layer"] == L)]
            if rows.empty:
                note(ax, f"{arch} L={L}: {missing}")
                ax.set_axis_off()
                continue
            cells.append((ax, arch, L, rows))
    return fig, axes, cells
