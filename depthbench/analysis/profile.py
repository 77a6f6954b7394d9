"""The layer profile: per model (each architecture and depth at its best learning rate, first
seed, and each pretrained model) the few numbers that say how much of its depth does work, side
by side: effective depth by layer removal, the causal and permutation shares, the late-layer
angular distance and the logit lens's halfway point. The report opens with it."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from depthbench.analysis import readers as R

COLUMNS = [
    "arch",
    "n_layer",
    "d_model",
    "status",
    "removable",
    "best_ranking",
    "random_removable",
    "causal_share",
    "permutation_share",
    "late_angular_distance",
    "lens_half_agreement",
]


def layer_profile(probes: pd.DataFrame, effective_depth: pd.DataFrame) -> pd.DataFrame:
    """One row per model (see the module docstring). `removable`: the largest fraction of layers
    a non-random ranking removes within the tolerance (`best_ranking` names it); the rest are
    the probe summaries: shares above their thresholds, mean last-token d(l, l+1) over the
    second half of the layers, and the logit lens's top-1 agreement with the final prediction
    at l = L/2 (rounded down)."""
    rows: dict[tuple, dict] = {}

    def row(r) -> dict:
        key = (
            r["arch"],
            int(r["n_layer"]),
            int(r["d_model"]) if r["d_model"] == r["d_model"] else -1,
        )
        return rows.setdefault(
            key,
            {"arch": key[0], "n_layer": key[1], "d_model": key[2], "status": r.get("status", "ok")},
        )

    if R.has(effective_depth, "arch", "n_layer", "d_model", "ranking", "effective_fraction"):
        removable = R.removable(effective_depth).sort_values(
            ["removable", "best_ranking"], ascending=[True, False], na_position="first"
        )  # a model of several knobs cells keeps the largest, as one group of its rows would
        for r in removable.to_dict("records"):
            out = row(r)
            if r["removable"] == r["removable"]:  # NaN: no non-random ranking
                out["removable"], out["best_ranking"] = r["removable"], r["best_ranking"]
            if r["random_removable"] == r["random_removable"]:
                out["random_removable"] = r["random_removable"]
    for share in ("causal_share", "permutation_share"):
        for _, r in R.probe(probes, share).iterrows():
            row(r)[share] = float(r["value"])
    adjacent = R.probe(probes, "angular_distance_last")
    if not adjacent.empty:
        adjacent = adjacent[adjacent["j"] == 1]
        for _, g in adjacent.groupby(["arch", "n_layer", "d_model"], sort=False):
            L = int(g["n_layer"].iloc[0])
            row(g.iloc[0])["late_angular_distance"] = float(g[g["i"] >= L // 2]["value"].mean())
    lens = R.probe(probes, "lens_top1_agreement")
    if not lens.empty:
        for _, g in lens.groupby(["arch", "n_layer", "d_model"], sort=False):
            L = int(g["n_layer"].iloc[0])
            half = g[g["i"] == L // 2]["value"]
            if not half.empty:
                row(g.iloc[0])["lens_half_agreement"] = float(half.iloc[0])
    table = pd.DataFrame(list(rows.values()), columns=COLUMNS)
    order = R.archs(table)
    return table.sort_values(
        ["status", "arch", "n_layer"],
        key=lambda c: c.map(order.index) if c.name == "arch" else c,
        ignore_index=True,
    )


def layer_profile_html(profile: pd.DataFrame, tolerance: float) -> str:
    if profile.empty:
        return "<p>No layer profile: probes disabled, or every run diverged.</p>"
    head = [
        "model",
        "L",
        "d",
        f"removable ({tolerance:.0%} tol.)",
        "random",
        "causal share",
        "perm. share",
        "late d(l,l+1)",
        "lens top-1 at L/2",
    ]

    def num(v, fmt="{:.2f}") -> str:
        return fmt.format(v) if isinstance(v, float) and not np.isnan(v) else "-"

    rows = []
    for r in profile.to_dict("records"):
        model = html.escape(r["arch"]) + (
            " <i>(pretrained)</i>" if r["status"] == "pretrained" else ""
        )
        removable = num(r["removable"]) + (
            f' <span class="small">{html.escape(r["best_ranking"])}</span>'
            if isinstance(r["best_ranking"], str)
            else ""
        )
        cells = [
            model,
            r["n_layer"],
            r["d_model"] if r["d_model"] >= 0 else "-",
            removable,
            num(r["random_removable"]),
            num(r["causal_share"]),
            num(r["permutation_share"]),
            num(r["late_angular_distance"], "{:.3f}"),
            num(r["lens_half_agreement"]),
        ]
        rows.append(
            "<tr>"
            + "".join(
                f'<td class="num">{c}</td>' if i else f"<td>{c}</td>" for i, c in enumerate(cells)
            )
            + "</tr>"
        )
    return (
        "<table><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )
