"""Claims on the cost of depth (g, from the analytic cost model in results/tables/cost.parquet)
and on held-out NLL by domain (h, results/tables/nll.parquet)."""

from __future__ import annotations

import math

import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis.claims.verdict import (
    Step,
    cell_model,
    claim,
    default_knobs,
    diff_step,
    exact,
    judge,
    untestable,
)


@claim("g_cost_grows_with_depth", trained=False)
def cost_grows_with_depth(t: dict, s: dict):
    """Pre-LN's (or the first architecture's) analytic prefill FLOPs and KV-cache bytes per
    4096-token sequence against depth: each depth's below the next deeper depth's, for both (a
    chain of strict steps between exact numbers). Not testable with fewer than two depths of
    that architecture."""
    cost = default_knobs(t.get("cost", pd.DataFrame()))
    if not R.has(cost, "arch", "n_layer", "prefill_flops_4096", "kv_cache_bytes_4096"):
        return untestable("no cost rows")
    arch = "pre_ln" if "pre_ln" in set(cost["arch"]) else R.archs(cost)[0]
    g = (
        cost[cost["arch"] == arch]
        .groupby("n_layer")[["prefill_flops_4096", "kv_cache_bytes_4096", "ratio"]]
        .mean()
        .sort_index()
    )
    if len(g) < 2:
        return untestable(f"{arch} at {len(g)} depth(s) in the cost rows, needs 2")
    steps = []
    for column, name, unit in (
        ("prefill_flops_4096", "TFLOPs", 1e12),
        ("kv_cache_bytes_4096", "KV MiB", 2**20),
    ):
        v = {int(L): exact(x / unit) for L, x in g[column].items()}
        depths = sorted(v)
        steps += [
            Step(f"{arch} {name} L={a}", v[a], f"{arch} {name} L={b}", v[b], -1)
            for a, b in zip(depths, depths[1:])
        ]
    f, kv = g["prefill_flops_4096"], g["kv_cache_bytes_4096"]
    ours = (
        f"{arch}: {f.iloc[0] / 1e12:.3g} -> {f.iloc[-1] / 1e12:.3g} TFLOPs, "
        f"KV x{kv.iloc[-1] / kv.iloc[0]:.2f} from ratio {g['ratio'].iloc[0]:.1f} "
        f"to {g['ratio'].iloc[-1]:.1f}"
    )
    return judge(steps, ours, variance="none: analytic numbers, exact")


@claim("h_deep_nll_stem_math")
def deep_nll_stem_math(t: dict, s: dict):
    """At the deepest depth with HC, Full AttnRes and Pre-LN NLL rows: on each of the stem and
    math domains, HC's and Full AttnRes's bits per byte below Pre-LN's (four strict steps:
    differences of cell means, the seed variance pooled over every architecture, domain and
    depth). With one seed a run's interval is its row's ci_low / ci_high, the bootstrap over
    documents of bits_per_byte (depthbench.evals.nll)."""
    nll = t.get("nll", pd.DataFrame())
    if not R.has(nll, "level", "domain", "bits_per_byte", "is_best_lr", "status"):
        return untestable("no NLL table (nll disabled)")
    d = nll[
        (nll["level"] == "domain")
        & nll["is_best_lr"].fillna(False).astype(bool)
        & (nll["status"] == "ok")
        & nll["domain"].isin(["stem", "math"])
    ]
    d = default_knobs(d)
    archs = ("hc", "attnres_full", "pre_ln")
    depths = [
        L
        for L, g in d.groupby("n_layer")
        if all(
            ((g["arch"] == a) & (g["domain"] == dom)).any()
            for a in archs
            for dom in ("stem", "math")
        )
    ]
    if not depths:
        missing = ", ".join(a for a in archs if a not in set(d["arch"]))
        return untestable(f"no stem/math NLL at a common depth for {missing or ', '.join(archs)}")
    L = max(depths)
    model = cell_model(d.astype({"n_layer": int}), ["arch", "domain", "n_layer"], "bits_per_byte",
                       (0.0, math.inf))  # fmt: skip
    steps = [
        diff_step(model, (a, dom, L), ("pre_ln", dom, L), f"{a} {dom}", f"pre_ln {dom}", -1)
        for dom in ("stem", "math")
        for a in archs[:2]
    ]
    ours = "; ".join(
        f"{dom}: " + ", ".join(f"{a} {model[a, dom, L].value:.3f}" for a in archs)
        for dom in ("stem", "math")
    )
    return judge(steps, f"{ours} bits/byte at L={L}", variance=model.pool_text())
