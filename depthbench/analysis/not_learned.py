"""The marks of a cell that did not learn (readers.not_learned_keys), shared by the figures.

Such a cell's final loss sits at the unigram floor: its probes and NLL describe a model that
learned unigram statistics only, so a trend across shapes through it would compare it with
models that learned. Trend figures leave it off their lines and cross it (`trend`); per-layer
figures keep its curve, that depth's only data, drawn apart (`curve_style`); `not_learned_text`
is the note that says so.
"""

from __future__ import annotations

import numpy as np

NOT_LEARNED = "did not learn (final loss within the learned margin of the unigram floor)"
NOT_LEARNED_LABEL = " (did not learn)"


def cross(ax, x, y, color) -> None:
    """An unconnected cross at each (x, y): a cell that did not learn. Not clipped: at a fixed
    axis limit (a fraction of 0) half a cross would read as a tick."""
    ax.scatter(x, y, s=80, marker="x", color=color, linewidths=1.5, zorder=3, clip_on=False)


def trend(ax, x, y, flat, st: dict, label: str | None = None) -> int:
    """A line of `st` (arch_style) through the points, x sorted by the caller, whose `flat` is
    False, and a cross in its colour at each other (a cell that did not learn). The number of
    crosses drawn."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    flat = np.asarray(flat, dtype=bool)
    ax.plot(x[~flat], y[~flat], label=label, **st)
    if flat.any():
        cross(ax, x[flat], y[flat], st["color"])
    return int(flat.sum())


def curve_style(st: dict, flat: bool, label: str | None, linestyle: str = "-") -> dict:
    """plot() keywords of one cell's per-layer curve: `st` with `linestyle` and `label`, or for
    a cell that did not learn a thinner line with x markers, dotted where it would be solid (a
    dashed line keeps its own meaning), its label saying so."""
    if not flat:
        return {**st, "linestyle": linestyle, "label": label}
    return {
        **st,
        "linestyle": ":" if linestyle == "-" else linestyle,
        "linewidth": 1.0,
        "marker": "x",
        "label": f"{label}{NOT_LEARNED_LABEL}" if label else label,
    }


def not_learned_text(crosses: int = 0, curves: int = 0, bars: bool = False) -> str:
    """The note on the marks drawn for cells that did not learn ('' where none is drawn): the
    crosses of `trend` (drawn without their interval bars where `bars`), the curves of
    `curve_style`. The reason first, what it means on the next line: one short line each, so
    the note fits under the narrowest figure unwrapped."""
    if crosses and curves:
        return (
            f"x: {NOT_LEARNED}: left off the line;\n"
            "dotted, x markers: a curve of such a cell, kept (its depth's only data); "
            "the claims leave both out"
        )
    if crosses:
        bar = ", no bar" if bars else ""
        return f"x: {NOT_LEARNED}:\nleft off the line{bar}; the claims leave it out"
    if curves:
        kept = "its depth's only curve, kept; the claims leave it out"
        return f"dotted, x markers: {NOT_LEARNED}:\n{kept}"
    return ""
