"""Claims on what depth buys at a fixed budget: the best-LR loss against depth (a, b) and the
fraction of layers that can be removed (m)."""

from __future__ import annotations

import pandas as pd

from depthbench.analysis.intervals import Estimate
from depthbench.analysis import readers as R
from depthbench.analysis.claims.verdict import (
    Step,
    cell_estimates,
    claim,
    default_knobs,
    judge,
    lacking,
    untestable,
)

HINT = " (not in the grid, or every run diverged or did not learn)"


def _loss_by_depth(t: dict, archs) -> dict[str, dict[int, Estimate]]:
    """Per architecture, {n_layer: best-LR validation loss} of its default-knobs cells."""
    loss = R.best_loss(t.get("runs", pd.DataFrame()), t.get("best_lr", pd.DataFrame()))
    loss = default_knobs(loss)
    out = {}
    for arch in archs:
        rows = loss[loss["arch"] == arch].sort_values("n_layer")
        out[arch] = {
            int(r.n_layer): Estimate(float(r.value), float(r.low), float(r.high), int(r.n))
            for r in rows.itertuples()
        }
    return out


@claim("a_depth_helps_hc_attnres_not_pre_ln")
def depth_helps_hc_attnres_not_pre_ln(t: dict, s: dict):
    """Per architecture, the best-LR loss at its shallowest against its deepest shape: for HC and
    Full AttnRes the shallowest above the deepest (strict steps); for Pre-LN not above (a
    non-strict step: a Pre-LN loss that falls with depth with separated intervals contradicts
    the claim). Not testable with fewer than two depths of any of the three."""
    archs = ("pre_ln", "hc", "attnres_full")
    loss = _loss_by_depth(t, archs)
    if why := lacking(loss, 2, "best_lr", HINT):
        return untestable(why)
    steps, parts = [], []
    for arch, d in loss.items():
        deep, shallow = max(d), min(d)
        pre = arch == "pre_ln"
        a, b = f"{arch} L={shallow}", f"{arch} L={deep}"
        steps.append(Step(a, d[shallow], b, d[deep], -1 if pre else 1, not pre))
        parts.append(f"{arch} {d[deep].value - d[shallow].value:+.3f}")
    return judge(steps, ", ".join(parts) + " nats (deepest - shallowest)")


@claim("b_intermediate_best_depth")
def intermediate_best_depth(t: dict, s: dict):
    """Per architecture (Block AttnRes, mHC), the best-LR loss at the shallowest and at the
    deepest depth against the lowest among the interior depths: both above it (two strict steps
    each). Not testable with fewer than three depths of either."""
    loss = _loss_by_depth(t, ("attnres_block", "mhc"))
    if why := lacking(loss, 3, "best_lr", HINT):
        return untestable(why)
    steps, parts = [], []
    for arch, d in loss.items():
        depths = sorted(d)
        best = min(depths[1:-1], key=lambda L: d[L].value)
        for end in (depths[0], depths[-1]):
            steps.append(Step(f"{arch} L={end}", d[end], f"{arch} L={best}", d[best], 1))
        parts.append(f"{arch} best at L={min(depths, key=lambda L: d[L].value)}")
    return judge(steps, ", ".join(parts))


@claim("m_fewer_layers_removable_than_pre_ln")
def fewer_layers_removable_than_pre_ln(t: dict, s: dict):
    """At the deepest depth where Pre-LN and another architecture both have effective-depth rows:
    each other architecture's removable fraction (the best non-random ranking's, per seed)
    below Pre-LN's (one strict step each). Not testable without Pre-LN and another
    architecture at a common depth."""
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
    L = max(common)
    at = rem[rem["n_layer"] == L]
    est = cell_estimates(at, ["arch"], "removable")
    order = [a for a in R.archs(at) if a != "pre_ln"]
    steps = [Step(f"{a} L={L}", est[a], f"pre_ln L={L}", est["pre_ln"], -1) for a in order]
    ours = ", ".join(f"{a} {est[a].value:.2f}" for a in [*order, "pre_ln"])
    ours += f" of L = {L} removable (best ranking; random up to {at['random_removable'].max():.2f})"
    return judge(steps, ours)
