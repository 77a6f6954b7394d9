"""Claims on the residual stream's probes (results/tables/probes.parquet): late-layer angular
distance (c), causal and permutation shares (d), the dead zone (e), the residual-product rank
(f) and token similarity at init (j).

Each quantity is one number per run, modelled over every cell (architecture, depth) that has it,
so that its seed variance is pooled over all of them (verdict.cell_model), with its range:
angular distances and shares in [0, 1], a dead zone of 0 to L layers, a residual-product rank
from 1 to the number of streams."""

from __future__ import annotations

import numpy as np
import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis.claims.verdict import (
    cell_model,
    claim,
    decide,
    default_knobs,
    diff_step,
    judge,
    not_testable,
    text,
    untestable,
)
from depthbench.analysis.cell_model import CellModel

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
    last-token d(l, l+1) over l >= L/2 (per run, in [0, 1]; modelled over every depth) of every
    HC / AttnRes architecture above that of every normalization-family one (one strict step per
    pair). The block part is a note with its own verdict: Block AttnRes's d at the pairs that
    straddle a block boundary (layer l ends a block, the model's block_ends) above its d
    elsewhere (one strict step, the two sets of pairs as two cells of its runs)."""
    d = _rows(t, "angular_distance_last")
    d = d[d["j"] == 1]
    L = _deepest_with(d, CONTRAST, NORM_FAMILY)
    if L is None:
        return untestable(
            "needs trained angular-distance rows of hc or attnres and of a normalization-family "
            "architecture at a common depth"
        )
    late = d[d["i"] >= d["n_layer"] // 2].astype({"n_layer": int})
    model = cell_model(late, ["arch", "n_layer"], bounds=(0.0, 1.0))
    at = d[d["n_layer"] == L]
    contrast = [a for a in R.archs(at) if a in CONTRAST]
    norms = [a for a in R.archs(at) if a in NORM_FAMILY]
    steps = [diff_step(model, (c, L), (n, L), c, n, 1) for c in contrast for n in norms]
    ours = ", ".join(f"{a} {model[a, L].value:.3f}" for a in contrast + norms)
    note = _block_jump(at, L, int(s.get("arch_options", {}).get("n_blocks", 8)))
    return judge(steps, ours + f" (mean d(l, l+1), l >= {L // 2}, L={L})", note, model.pool_text())


def _block_jump(d: pd.DataFrame, L: int, n_blocks: int) -> str:
    """Claim (c)'s block part, as a note with its own verdict."""
    from depthbench.models.archs.attnres_block import block_ends

    blk = d[d["arch"] == "attnres_block"]
    if blk.empty:
        return f"block part {not_testable(f'no attnres_block rows at L={L}')}"
    if n_blocks >= L:
        return f"block part {not_testable(f'n_blocks {n_blocks} >= L {L}, every layer is a block')}"
    ends = set(block_ends(L, n_blocks)) - {L}
    where = blk.assign(where=np.where(blk["i"].isin(ends), "at", "off"))
    model = cell_model(where, ["where"], bounds=(0.0, 1.0))
    if len(model) < 2:
        return f"block part {not_testable('no attnres_block rows at and off the boundaries')}"
    verdict, p, _ = decide([diff_step(model, "at", "off", "at", "off", 1)])
    return (
        f"block part: d at block boundaries {text(model['at'])} vs elsewhere "
        f"{text(model['off'])} (p = {p:.2g}): {verdict}"
    )


@claim("d_causal_permutation_shares")
def causal_permutation_shares(t: dict, s: dict):
    """At the deepest depth with Full AttnRes, HC and Pre-LN: for each of the causal and the
    permutation share (in [0, 1], each modelled over every depth), Full AttnRes's and HC's
    above Pre-LN's (four strict steps)."""
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
    steps, parts, pools = [], [], []
    for p, df in shares.items():
        model = cell_model(df.astype({"n_layer": int}), ["arch", "n_layer"], bounds=(0.0, 1.0))
        name = p.split("_")[0]
        steps += [
            diff_step(model, (a, L), ("pre_ln", L), f"{a} {name}", f"pre_ln {name}", 1)
            for a in archs[:2]
        ]
        parts.append(name + " " + " / ".join(f"{100 * model[a, L].value:.0f}%" for a in archs))
        pools.append(f"{name}: {model.pool_text()}")
    ours = "; ".join(parts) + f" (Full AttnRes / HC / Pre-LN at L={L})"
    return judge(steps, ours, variance="; ".join(pools))


@claim("e_dead_zone_grows")
def dead_zone_grows(t: dict, s: dict):
    """Block AttnRes's dead-zone layer count (0 to L) against depth: each depth's below the next
    deeper depth's (a chain of strict steps, differences of cell means; holds only if every
    step is significant upwards, contradicted if one is downwards). Not testable with fewer than
    two depths."""
    dz = _rows(t, "dead_zone_layers")
    dz = dz[dz["arch"] == "attnres_block"].astype({"n_layer": int})
    model = cell_model(dz, ["n_layer"], bounds=lambda L: (0.0, float(L)))
    if len(model) < 2:
        return untestable(
            f"needs dead_zone_layers rows of attnres_block at 2 or more depths, has {len(model)}"
        )
    depths = sorted(model)
    steps = [diff_step(model, a, b, f"L={a}", f"L={b}", -1) for a, b in zip(depths, depths[1:])]
    ours = ", ".join(f"L={L}: {model[L].value:g}" for L in depths)
    return judge(steps, ours, variance=model.pool_text())


@claim("f_mhc_rank_below_hc")
def mhc_rank_below_hc(t: dict, s: dict):
    """At every depth with both: mHC's residual-product rank (in [1, n_streams]) below HC's (one
    strict step per depth, the seed variance pooled over both architectures' cells). Not
    testable without both architectures at a common depth."""
    r = _rows(t, "residual_product_rank")
    r = r[r["arch"].isin(["hc", "mhc"])].astype({"n_layer": int})
    streams = float(s.get("arch_options", {}).get("n_streams", 4))
    model = cell_model(r, ["arch", "n_layer"], bounds=(1.0, streams))
    depths = sorted({L for a, L in model if ("hc", L) in model and ("mhc", L) in model})
    if not depths:
        return untestable(
            "needs trained residual_product_rank rows of both hc and mhc at a common depth"
        )
    steps = [diff_step(model, ("mhc", L), ("hc", L), f"mhc L={L}", f"hc L={L}", -1) for L in depths]
    ours = "; ".join(
        f"L={L}: mhc {model['mhc', L].value:.2f} vs hc {model['hc', L].value:.2f}" for L in depths
    )
    return judge(steps, ours, variance=model.pool_text())


def _growth(t: dict, stages) -> pd.DataFrame:
    """tsim(h_L) - tsim(h_0) at init at each architecture's deepest depth, one row per run and
    stage (arch, stage, run_id, value; its range is [-1, 1]), with the interval of a difference
    of two rows, [low_L - high_0, high_L - low_0], where the rows have theirs."""
    rows = pd.concat([_rows(t, "token_similarity", st) for st in stages])
    columns = ["arch", "stage", "run_id", "value", "ci_low", "ci_high"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    deepest = rows.groupby("arch")["n_layer"].max()
    out = []
    for (arch, stage, run_id), g in rows.groupby(["arch", "stage", "run_id"]):
        g = g.sort_values("i")
        if len(g) < 2 or g["n_layer"].iloc[0] != deepest[arch]:
            continue
        first, last = g.iloc[0], g.iloc[-1]
        low = last.get("ci_low", np.nan) - first.get("ci_high", np.nan)
        high = last.get("ci_high", np.nan) - first.get("ci_low", np.nan)
        out.append((arch, stage, run_id, last["value"] - first["value"], low, high))
    return pd.DataFrame(out, columns=columns)


@claim("j_post_ln_token_similarity", trained=False)
def post_ln_token_similarity(t: dict, s: dict):
    """At init, at the deepest depth: Post-LN's token-similarity growth tsim(h_L) - tsim(h_0)
    above Pre-LN's, and Post-LN's without the prefix-average part of attention below Post-LN's
    (two strict steps; the three as cells of one model, the seed variance pooled over them)."""
    stages = ("init", "init_no_prefix_avg")
    growth = _growth(t, stages)
    cells = [("post_ln", "init"), ("pre_ln", "init"), ("post_ln", "init_no_prefix_avg")]
    model = CellModel(growth, ["arch", "stage"], bounds=(-1.0, 1.0))
    if any(c not in model for c in cells):
        return untestable(
            "needs init token-similarity rows of post_ln and pre_ln (with the prefix-average stage)"
        )
    post, pre, post_np = cells
    steps = [
        diff_step(model, post, pre, "post_ln growth", "pre_ln growth", 1),
        diff_step(
            model, post_np, post, "post_ln growth without prefix average", "post_ln growth", -1
        ),
    ]
    ours = (
        f"tsim(h_L) - tsim(h_0) at init: post_ln {model[post].value:+.3f}, pre_ln "
        f"{model[pre].value:+.3f}, post_ln without prefix average {model[post_np].value:+.3f}"
    )
    return judge(steps, ours, variance=model.pool_text())
