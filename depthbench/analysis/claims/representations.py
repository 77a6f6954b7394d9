"""Claims on the residual stream's probes (results/tables/probes.parquet): late-layer angular
distance (c), causal and permutation shares (d), the dead zone (e), the residual-product rank
(f) and token similarity at init (j)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis.claims.verdict import (
    Step,
    cell_estimates,
    claim,
    decide,
    default_knobs,
    judge,
    not_testable,
    text,
    untestable,
)
from depthbench.analysis.intervals import cell_interval

NORM_FAMILY = ("pre_ln", "post_ln", "peri_ln", "lns", "deepnorm", "keel")
CONTRAST = ("hc", "attnres_full", "attnres_block")


def _rows(t: dict, name: str, stage: str = "trained") -> pd.DataFrame:
    """Every seed's rows of one probe at one stage (trained: the best-LR runs; init: the
    lowest-LR runs), the default knobs of each architecture."""
    probes = t.get("probes", pd.DataFrame())
    return default_knobs(R.probe(probes, name, stage, best_only=True, all_seeds=True))


def _deepest_with(df: pd.DataFrame, *groups) -> int | None:
    """The deepest n_layer at which every group of architectures has one present, or None."""
    found = [
        int(L)
        for L, g in df.groupby("n_layer")
        if all(set(group) & set(g["arch"]) for group in groups)
    ]
    return max(found) if found else None


@claim("c_late_angular_distance")
def late_angular_distance(t: dict, s: dict):
    """At the deepest depth with HC or AttnRes and a normalization-family architecture: the mean
    last-token d(l, l+1) over l >= L/2 of every HC / AttnRes architecture above that of every
    normalization-family one (one strict step per pair). The block part is a note with its own
    verdict: Block AttnRes's d at the pairs that straddle a block boundary (layer l ends a
    block, the model's block_ends) above its d elsewhere (one strict step)."""
    d = _rows(t, "angular_distance_last")
    d = d[d["j"] == 1]
    L = _deepest_with(d, CONTRAST, NORM_FAMILY)
    if L is None:
        return untestable(
            "needs trained angular-distance rows of hc or attnres and of a normalization-family "
            "architecture at a common depth"
        )
    at = d[d["n_layer"] == L]
    est = cell_estimates(at[at["i"] >= L // 2], ["arch"])
    contrast = [a for a in R.archs(at) if a in CONTRAST]
    norms = [a for a in R.archs(at) if a in NORM_FAMILY]
    steps = [Step(c, est[c], n, est[n], 1) for c in contrast for n in norms]
    ours = ", ".join(f"{a} {est[a].value:.3f}" for a in contrast + norms)
    note = _block_jump(at, L, int(s.get("arch_options", {}).get("n_blocks", 8)))
    return judge(steps, ours + f" (mean d(l, l+1), l >= {L // 2}, L={L})", note)


def _block_jump(d: pd.DataFrame, L: int, n_blocks: int) -> str:
    """Claim (c)'s block part, as a note with its own verdict."""
    from depthbench.models.archs.attnres_block import block_ends

    blk = d[d["arch"] == "attnres_block"]
    if blk.empty:
        return f"block part {not_testable(f'no attnres_block rows at L={L}')}"
    if n_blocks >= L:
        return f"block part {not_testable(f'n_blocks {n_blocks} >= L {L}, every layer is a block')}"
    ends = set(block_ends(L, n_blocks)) - {L}
    at = cell_estimates(blk[blk["i"].isin(ends)], ["arch"]).get("attnres_block")
    off = cell_estimates(blk[~blk["i"].isin(ends)], ["arch"]).get("attnres_block")
    if at is None or off is None:
        return f"block part {not_testable('no attnres_block rows at and off the boundaries')}"
    verdict = decide([Step("at", at, "off", off, 1)])
    return f"block part: d at block boundaries {text(at)} vs elsewhere {text(off)}: {verdict}"


@claim("d_causal_permutation_shares")
def causal_permutation_shares(t: dict, s: dict):
    """At the deepest depth with Full AttnRes, HC and Pre-LN: for each of the causal and the
    permutation share, Full AttnRes's and HC's above Pre-LN's (four strict steps)."""
    archs = ("attnres_full", "hc", "pre_ln")
    shares = {p: _rows(t, p) for p in ("causal_share", "permutation_share")}
    common = set.intersection(
        *(
            {int(L) for L, g in df.groupby("n_layer") if set(archs) <= set(g["arch"])}
            for df in shares.values()
        )
    )
    if not common:
        have = {a for df in shares.values() for a in set(df["arch"])}
        missing = ", ".join(a for a in archs if a not in have)
        return untestable(
            f"no trained share rows of {missing}"
            if missing
            else "no depth with trained share rows of all of attnres_full, hc, pre_ln"
        )
    L = max(common)
    steps, parts = [], []
    for p, df in shares.items():
        est = cell_estimates(df[df["n_layer"] == L], ["arch"])
        name = p.split("_")[0]
        steps += [
            Step(f"{a} {name}", est[a], f"pre_ln {name}", est["pre_ln"], 1) for a in archs[:2]
        ]
        parts.append(name + " " + " / ".join(f"{100 * est[a].value:.0f}%" for a in archs))
    return judge(steps, "; ".join(parts) + f" (Full AttnRes / HC / Pre-LN at L={L})")


@claim("e_dead_zone_grows")
def dead_zone_grows(t: dict, s: dict):
    """Block AttnRes's dead-zone layer count against depth: each depth's below the next deeper
    depth's (a chain of strict steps; holds only if every step separates upwards, contradicted
    if one separates downwards). Not testable with fewer than two depths."""
    dz = _rows(t, "dead_zone_layers")
    est = cell_estimates(dz[dz["arch"] == "attnres_block"], ["n_layer"])
    if len(est) < 2:
        return untestable(
            f"needs dead_zone_layers rows of attnres_block at 2 or more depths, has {len(est)}"
        )
    depths = sorted(est)
    steps = [Step(f"L={a}", est[a], f"L={b}", est[b], -1) for a, b in zip(depths, depths[1:])]
    return judge(steps, ", ".join(f"L={L}: {est[L].value:g}" for L in depths))


@claim("f_mhc_rank_below_hc")
def mhc_rank_below_hc(t: dict, s: dict):
    """At every depth with both: mHC's residual-product rank below HC's (one strict step per
    depth). Not testable without both architectures at a common depth."""
    r = _rows(t, "residual_product_rank")
    est = cell_estimates(r[r["arch"].isin(["hc", "mhc"])], ["n_layer", "arch"])
    depths = sorted({L for L, a in est if (L, "hc") in est and (L, "mhc") in est})
    if not depths:
        return untestable(
            "needs trained residual_product_rank rows of both hc and mhc at a common depth"
        )
    steps = [Step(f"mhc L={L}", est[L, "mhc"], f"hc L={L}", est[L, "hc"], -1) for L in depths]
    ours = "; ".join(
        f"L={L}: mhc {est[L, 'mhc'].value:.2f} vs hc {est[L, 'hc'].value:.2f}" for L in depths
    )
    return judge(steps, ours)


def _growth(t: dict, arch: str, stage: str):
    """tsim(h_L) - tsim(h_0) at init at the architecture's deepest depth, one number per seed
    (the interval of a difference of two rows: [low_L - high_0, high_L - low_0]), or None."""
    rows = _rows(t, "token_similarity", stage)
    rows = rows[rows["arch"] == arch]
    if rows.empty:
        return None
    rows = rows[rows["n_layer"] == rows["n_layer"].max()]
    values, lows, highs = [], [], []
    for _, g in rows.groupby("run_id"):
        g = g.sort_values("i")
        if len(g) < 2:
            continue
        first, last = g.iloc[0], g.iloc[-1]
        values.append(last["value"] - first["value"])
        lows.append(last.get("ci_low", np.nan) - first.get("ci_high", np.nan))
        highs.append(last.get("ci_high", np.nan) - first.get("ci_low", np.nan))
    return cell_interval(values, lows, highs) if values else None


@claim("j_post_ln_token_similarity", trained=False)
def post_ln_token_similarity(t: dict, s: dict):
    """At init, at the deepest depth: Post-LN's token-similarity growth tsim(h_L) - tsim(h_0)
    above Pre-LN's, and Post-LN's without the prefix-average part of attention below Post-LN's
    (two strict steps)."""
    post, pre, post_np = (
        _growth(t, a, st)
        for a, st in (("post_ln", "init"), ("pre_ln", "init"), ("post_ln", "init_no_prefix_avg"))
    )
    if post is None or pre is None or post_np is None:
        return untestable(
            "needs init token-similarity rows of post_ln and pre_ln (with the prefix-average stage)"
        )
    steps = [
        Step("post_ln growth", post, "pre_ln growth", pre, 1),
        Step("post_ln growth without prefix average", post_np, "post_ln growth", post, -1),
    ]
    ours = (
        f"tsim(h_L) - tsim(h_0) at init: post_ln {post.value:+.3f}, pre_ln {pre.value:+.3f}, "
        f"post_ln without prefix average {post_np.value:+.3f}"
    )
    return judge(steps, ours)
