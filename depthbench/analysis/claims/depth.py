"""Claims on what depth buys at a fixed budget: the best-LR loss against depth (a, b) and the
fraction of layers that can be removed (m)."""

from __future__ import annotations

import math

import pandas as pd

from depthbench.analysis import best_loss
from depthbench.analysis import readers as R
from depthbench.analysis.claims.verdict import (
    Step,
    cell_model,
    claim,
    default_knobs,
    diff_step,
    judge,
    lacking,
    untestable,
)
from depthbench.analysis.cell_model import CellModel

HINT = " (not in the grid, or every run diverged or did not learn)"


def loss_model(t: dict) -> CellModel:
    """The best-LR validation loss of every seed of every default-knobs cell, cells (arch,
    n_layer): depthbench.analysis.best_loss (the seed variance pooled over them, each cell's
    LR-choice variance added)."""
    runs, best = t.get("runs", pd.DataFrame()), t.get("best_lr", pd.DataFrame())
    if not R.has(best, *R.SHAPE_KEYS, "best_lr") or not R.has(runs, "run_id", "lr"):
        return CellModel(pd.DataFrame(columns=["arch", "n_layer", "value"]), ["arch", "n_layer"])
    return best_loss.loss_model(default_knobs(runs), default_knobs(best))


def _depths(model: CellModel, archs) -> dict[str, list[int]]:
    return {a: sorted(L for arch, L in model if arch == a) for a in archs}


@claim("a_depth_helps_hc_attnres_not_pre_ln")
def depth_helps_hc_attnres_not_pre_ln(t: dict, s: dict):
    """Per architecture, the slope of the best-LR validation loss on log2(n_layer), fitted by least
    squares over every depth and seed (a contrast of its cells' means, the seed variance pooled
    over every cell of the grid): for HC and Full AttnRes negative (strict steps); for Pre-LN not
    negative (a non-strict step: a Pre-LN loss that falls significantly with depth contradicts
    the claim). Not testable with fewer than two depths of any of the three."""
    return depth_verdict(loss_model(t))


def depth_verdict(model: CellModel):
    """Claim (a) on a loss model (loss_model)."""
    archs = ("pre_ln", "hc", "attnres_full")
    depths = _depths(model, archs)
    if why := lacking(depths, 2, "best_lr", HINT):
        return untestable(why)
    steps, parts = [], []
    for arch, ds in depths.items():
        pre = arch == "pre_ln"
        test = model.slope({(arch, L): math.log2(L) for L in ds})
        lo, hi = (arch, ds[0]), (arch, ds[-1])
        effect = f"{arch} slope per doubling of L"
        steps.append(
            Step(
                f"{arch} L={ds[0]}",
                model[lo],
                f"{arch} L={ds[-1]}",
                model[hi],
                1 if pre else -1,
                not pre,
                test,
                effect,
            )  # fmt: skip
        )
        parts.append(f"{arch} {test.estimate:+.3f}")
    ours = ", ".join(parts) + " nats per doubling of L (least-squares slope over every run)"
    return judge(steps, ours, variance=model.pool_text())


@claim("b_intermediate_best_depth")
def intermediate_best_depth(t: dict, s: dict):
    """Per architecture (Block AttnRes, mHC), the best-LR loss at the shallowest and at the
    deepest depth against the lowest among the interior depths: both above it (two strict
    steps each: differences of cell means, the seed variance pooled over every cell of the
    grid). Not testable with fewer than three depths of either."""
    model = loss_model(t)
    depths = _depths(model, ("attnres_block", "mhc"))
    if why := lacking(depths, 3, "best_lr", HINT):
        return untestable(why)
    steps, parts = [], []
    for arch, ds in depths.items():
        best = min(ds[1:-1], key=lambda L: model[arch, L].value)
        for end in (ds[0], ds[-1]):
            steps.append(
                diff_step(
                    model, (arch, end), (arch, best), f"{arch} L={end}", f"{arch} L={best}", 1
                )
            )
        parts.append(f"{arch} best at L={min(ds, key=lambda L: model[arch, L].value)}")
    return judge(steps, ", ".join(parts), variance=model.pool_text())


@claim("m_fewer_layers_removable_than_pre_ln")
def fewer_layers_removable_than_pre_ln(t: dict, s: dict):
    """At the deepest depth where Pre-LN and another architecture both have effective-depth rows:
    each other architecture's removable fraction (the best non-random ranking's, per seed)
    below Pre-LN's (one strict step each: differences of cell means, a fraction in [0, 1], the
    seed variance pooled over every cell at every depth). Not testable without Pre-LN and
    another architecture at a common depth."""
    rem = default_knobs(R.removable(t.get("effective_depth", pd.DataFrame()), all_seeds=True))
    if rem.empty:
        return untestable("no effective-depth rows (removal or probes disabled)")
    common = [
        L
        for L, g in rem.groupby("n_layer")
        if "pre_ln" in set(g["arch"]) and g["arch"].nunique() > 1
    ]
    if not common:
        return untestable(
            "needs pre_ln and another architecture at a common depth in the effective-depth rows"
        )
    L = int(max(common))
    model = cell_model(rem.astype({"n_layer": int}), ["arch", "n_layer"], "removable", (0.0, 1.0))
    at = rem[rem["n_layer"] == L]
    order = [a for a in R.archs(at) if a != "pre_ln" and (a, L) in model]
    steps = [
        diff_step(model, (a, L), ("pre_ln", L), f"{a} L={L}", f"pre_ln L={L}", -1) for a in order
    ]
    if not steps:
        return untestable(f"no removable fraction of another architecture at L={L}")
    ours = ", ".join(f"{a} {model[a, L].value:.2f}" for a in [*order, "pre_ln"])
    random = at["random_removable"].max()
    ours += f" of L = {L} removable (best ranking; random up to {random:.2f})"
    return judge(steps, ours, variance=model.pool_text())
