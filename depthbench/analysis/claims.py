"""The claims table: each claim of the source papers (config/claims.yaml) with our number, the
scale at which it was measured and a verdict, computed from results/tables by one small
function per claim.

A claim function gets the tables and the grid settings and returns (ours, verdict, note):
`ours` is our number as text, the verdict one of HOLDS, FAILS or untestable(what is missing).
"Does not hold" is always "at this scale": the grids are tiny next to the papers'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import yaml

from depthbench.analysis import readers as R
from depthbench.util.errors import DepthBenchError

HOLDS, FAILS = "holds", "does not hold at this scale"
NORM_FAMILY = ("pre_ln", "post_ln", "peri_ln", "lns", "deepnorm", "keel")
EPS = 0.01  # nats: a loss change smaller than this is "no change" at these sizes


def untestable(missing: str) -> str:
    return f"not testable in this grid: {missing}"


def verdict(ok: bool) -> str:
    return HOLDS if ok else FAILS


def _best_loss(t: dict, arch: str) -> pd.Series:
    """Best-LR validation loss by n_layer of one architecture (default knobs first)."""
    best = t.get("best_lr", pd.DataFrame())
    if not R.has(best, "arch", "n_layer", "final_val_loss"):
        return pd.Series(dtype=float)
    return best[best["arch"] == arch].groupby("n_layer")["final_val_loss"].mean().sort_index()


def _lacking(t: dict, archs, depths: int = 2, table: str = "best_lr") -> str | None:
    """What the grid lacks for a claim over `archs` at `depths` or more shapes, or None."""
    df = t.get(table, pd.DataFrame())
    have = set(df["arch"]) if R.has(df, "arch") else set()
    missing = [a for a in archs if a not in have]
    if missing:
        return f"no {'/'.join(missing)} in {table}" + (
            " (not in the grid, or every run diverged)" if table == "best_lr" else ""
        )
    n = df["n_layer"].nunique() if R.has(df, "n_layer") else 0
    return f"{n} depth(s) in {table}, needs {depths}" if n < depths else None


def claim_a(t: dict, s: dict):
    archs = ("pre_ln", "hc", "attnres_full")
    if why := _lacking(t, archs):
        return "", untestable(why), ""
    delta = {a: float(_best_loss(t, a).iloc[-1] - _best_loss(t, a).iloc[0]) for a in archs}
    ours = ", ".join(f"{a} {v:+.3f}" for a, v in delta.items()) + " nats (deepest - shallowest)"
    return (
        ours,
        verdict(delta["pre_ln"] > -EPS and delta["hc"] < -EPS and delta["attnres_full"] < -EPS),
        "",
    )


def claim_b(t: dict, s: dict):
    archs = ("attnres_block", "mhc")
    if why := _lacking(t, archs, depths=3):
        return "", untestable(why), ""
    best = {a: int(_best_loss(t, a).idxmin()) for a in archs}
    interior = {
        a: _best_loss(t, a).index[0] < L < _best_loss(t, a).index[-1] for a, L in best.items()
    }
    return (
        ", ".join(f"{a} best at L={L}" for a, L in best.items()),
        verdict(all(interior.values())),
        "",
    )


def _adjacent(t: dict) -> pd.DataFrame:
    return R.deepest(R.probe(t.get("probes", pd.DataFrame()), "angular_distance_last"))


def claim_c(t: dict, s: dict):
    d = _adjacent(t)
    d = d[d["j"] == 1] if not d.empty else d
    contrast = [a for a in ("hc", "attnres_full", "attnres_block") if a in set(d.get("arch", []))]
    norms = [a for a in NORM_FAMILY if a in set(d.get("arch", []))]
    if not contrast or not norms:
        return (
            "",
            untestable(
                "needs trained angular-distance rows of hc or attnres and of a normalization-family architecture"
            ),
            "",
        )
    L = int(d["n_layer"].iloc[0])
    late = {
        a: float(d[(d["arch"] == a) & (d["i"] >= L // 2)]["value"].mean()) for a in contrast + norms
    }
    ours = (
        ", ".join(f"{a} {v:.3f}" for a, v in late.items())
        + f" (mean d(l, l+1), l >= {L // 2}, L={L})"
    )
    holds = min(late[a] for a in contrast) > max(late[a] for a in norms)
    note = _block_jump(d, L, int(s.get("arch_options", {}).get("n_blocks", 8)))
    return ours, verdict(holds), note


def _block_jump(d: pd.DataFrame, L: int, n_blocks: int) -> str:
    """The block-boundary part of claim (c), as a note: the pair (h_e, h_e+1) straddles a
    boundary when layer e ends a block (the model's own block_ends)."""
    from depthbench.models.archs.attnres_block import block_ends

    blk = d[d["arch"] == "attnres_block"].set_index("i")["value"]
    if blk.empty:
        return "block part not testable: no attnres_block rows"
    if n_blocks >= L:
        return f"block part not testable: n_blocks {n_blocks} >= L {L}, every layer is a block"
    ends = set(block_ends(L, n_blocks)) - {L}
    at, off = blk[blk.index.isin(ends)].mean(), blk[~blk.index.isin(ends)].mean()
    return f"block part: d at boundaries {at:.3f} vs elsewhere {off:.3f} ({HOLDS if at > off else FAILS})"


def claim_d(t: dict, s: dict):
    probes = t.get("probes", pd.DataFrame())
    shares = {p: R.deepest(R.probe(probes, p)) for p in ("causal_share", "permutation_share")}
    archs = ("attnres_full", "hc", "pre_ln")
    values = {
        p: df.groupby("arch")["value"].mean() if not df.empty else pd.Series(dtype=float)
        for p, df in shares.items()
    }
    missing = sorted({a for v in values.values() for a in archs if a not in v.index})
    if missing:
        return "", untestable(f"no trained share rows of {', '.join(missing)}"), ""
    L = int(shares["causal_share"]["n_layer"].iloc[0])
    ours = "; ".join(
        p.split("_")[0] + " " + " / ".join(f"{100 * values[p][a]:.0f}%" for a in archs)
        for p in values
    )
    holds = all(
        min(values[p]["attnres_full"], values[p]["hc"]) > values[p]["pre_ln"] for p in values
    )
    return ours + f" (Full AttnRes / HC / Pre-LN at L={L})", verdict(holds), ""


def claim_e(t: dict, s: dict):
    dz = R.probe(t.get("probes", pd.DataFrame()), "dead_zone_layers")
    if dz.empty or dz["n_layer"].nunique() < 2:
        return (
            "",
            untestable("needs dead_zone_layers rows of attnres_block at 2 or more depths"),
            "",
        )
    g = dz.groupby("n_layer")["value"].mean().sort_index()
    ours = ", ".join(f"L={L}: {v:g}" for L, v in g.items())
    return ours, verdict(bool((np.diff(g.values) >= 0).all() and g.iloc[-1] > g.iloc[0])), ""


def claim_f(t: dict, s: dict):
    r = R.probe(t.get("probes", pd.DataFrame()), "residual_product_rank")
    g = r.groupby(["n_layer", "arch"])["value"].mean().unstack() if not r.empty else pd.DataFrame()
    if not {"hc", "mhc"} <= set(g.columns) or g[["hc", "mhc"]].dropna().empty:
        return "", untestable("needs trained residual_product_rank rows of both hc and mhc"), ""
    g = g[["hc", "mhc"]].dropna()
    ours = "; ".join(f"L={L}: mhc {r.mhc:.2f} vs hc {r.hc:.2f}" for L, r in g.iterrows())
    return ours, verdict(bool((g["mhc"] < g["hc"]).all())), ""


def claim_g(t: dict, s: dict):
    cost = t.get("cost", pd.DataFrame())
    if (
        not R.has(cost, "prefill_flops_4096", "kv_cache_bytes_4096")
        or cost["n_layer"].nunique() < 2
    ):
        return "", untestable("needs cost rows at 2 or more depths"), ""
    arch = "pre_ln" if "pre_ln" in set(cost["arch"]) else R.archs(cost)[0]
    g = (
        cost[cost["arch"] == arch]
        .groupby("n_layer")[["prefill_flops_4096", "kv_cache_bytes_4096", "ratio"]]
        .mean()
        .sort_index()
    )
    f, kv = g["prefill_flops_4096"], g["kv_cache_bytes_4096"]
    ours = (
        f"{arch}: {f.iloc[0] / 1e12:.3g} -> {f.iloc[-1] / 1e12:.3g} TFLOPs, KV x{kv.iloc[-1] / kv.iloc[0]:.2f} "
        f"from ratio {g['ratio'].iloc[0]:.1f} to {g['ratio'].iloc[-1]:.1f}"
    )
    return ours, verdict(bool((np.diff(f.values) > 0).all() and (np.diff(kv.values) > 0).all())), ""


def claim_h(t: dict, s: dict):
    nll = t.get("nll", pd.DataFrame())
    if not R.has(nll, "level", "domain", "bits_per_byte", "is_best_lr"):
        return "", untestable("no NLL table (nll disabled)"), ""
    d = R.deepest(
        nll[
            (nll["level"] == "domain")
            & nll["is_best_lr"].fillna(False).astype(bool)
            & (nll["status"] == "ok")
        ]
    )
    g = (
        d[d["domain"].isin(["stem", "math"])]
        .groupby(["arch", "domain"])["bits_per_byte"]
        .mean()
        .unstack()
        if not d.empty
        else pd.DataFrame()
    )
    missing = [a for a in ("pre_ln", "hc", "attnres_full") if a not in g.index]
    if missing or not {"stem", "math"} <= set(g.columns):
        return (
            "",
            untestable(
                f"no stem/math NLL at the deepest shape for {', '.join(missing) or 'the domains'}"
            ),
            "",
        )
    ours = "; ".join(
        f"{dom}: " + ", ".join(f"{a} {g.loc[a, dom]:.3f}" for a in ("hc", "attnres_full", "pre_ln"))
        for dom in ("stem", "math")
    )
    holds = all(
        g.loc[a, dom] < g.loc["pre_ln", dom]
        for a in ("hc", "attnres_full")
        for dom in ("stem", "math")
    )
    return ours + " bits/byte", verdict(holds), ""


def _final_rms(t: dict) -> pd.DataFrame:
    """Residual RMS of h_L at the last dynamics step of each best-LR run (first seed)."""
    dyn = t.get("dynamics", pd.DataFrame())
    chosen = R.first_seed(
        R.best_runs(t.get("runs", pd.DataFrame()), t.get("best_lr", pd.DataFrame()))
    )
    if not R.has(dyn, "quantity") or chosen.empty:
        return pd.DataFrame(columns=["run_id", "arch", "n_layer", "value"])
    rms = dyn[dyn["quantity"] == "residual_rms"]
    rms = rms[rms["step"] == rms.groupby("run_id")["step"].transform("max")]
    rms = rms[rms["index"] == rms.groupby("run_id")["index"].transform("max")]
    return chosen.merge(rms[["run_id", "value"]], on="run_id")


def claim_i(t: dict, s: dict):
    rms = _final_rms(t)
    pre, lns = rms[rms["arch"] == "pre_ln"], rms[rms["arch"] == "lns"]
    if pre["n_layer"].nunique() < 2 or lns.empty:
        return "", untestable("needs dynamics of pre_ln at 2 or more depths and of lns"), ""
    g = pre.groupby("n_layer")["value"].mean().sort_index()
    L = g.index[-1]
    lns_at = lns[lns["n_layer"] == L]["value"].mean()
    ours = f"pre_ln RMS(h_L) {g.iloc[0]:.2f} (L={g.index[0]}) -> {g.iloc[-1]:.2f} (L={L}); lns {lns_at:.2f} at L={L}"
    return ours, verdict(bool(g.iloc[-1] > g.iloc[0] and lns_at < g.iloc[-1])), ""


def _tsim_growth(t: dict, arch: str, stage: str) -> float:
    rows = R.deepest(
        R.probe(t.get("probes", pd.DataFrame()), "token_similarity", stage, best_only=False)
    )
    rows = rows[rows["arch"] == arch]
    rows = rows[rows["run_id"] == rows["run_id"].min()] if not rows.empty else rows
    v = rows.set_index("i")["value"].sort_index()
    return float(v.iloc[-1] - v.iloc[0]) if len(v) > 1 else float("nan")


def claim_j(t: dict, s: dict):
    post, pre, post_np = (
        _tsim_growth(t, a, st)
        for a, st in (("post_ln", "init"), ("pre_ln", "init"), ("post_ln", "init_no_prefix_avg"))
    )
    if np.isnan([post, pre, post_np]).any():
        return (
            "",
            untestable(
                "needs init token-similarity rows of post_ln and pre_ln (with the prefix-average stage)"
            ),
            "",
        )
    ours = f"tsim(h_L) - tsim(h_0) at init: post_ln {post:+.3f}, pre_ln {pre:+.3f}, post_ln without prefix average {post_np:+.3f}"
    return ours, verdict(post > pre and post_np < post), ""


def claim_k(t: dict, s: dict):
    runs, dyn = t.get("runs", pd.DataFrame()), t.get("dynamics", pd.DataFrame())
    floor = R.unigram_floor(runs)
    if floor is None:
        return "", untestable("no runs"), ""
    collapsed = runs[(runs["status"] == "ok") & ((runs["final_val_loss"] - floor).abs() < 0.1)]
    if collapsed.empty:
        return (
            "",
            untestable(
                "no run collapsed to the unigram floor (config/presets/postnorm_collapse.yaml makes them)"
            ),
            "",
        )
    if not R.has(dyn, "quantity"):
        return (
            f"{len(collapsed)} run(s) at the floor",
            untestable("no dynamics rows for the collapsed runs"),
            "",
        )
    d = dyn[dyn["run_id"].isin(set(collapsed["run_id"]))]
    g = (
        d[(d["quantity"] == "grad_norm_h") & (d["index"] == 1)]
        .sort_values("step")
        .groupby("run_id")["value"]
    )
    fall = (g.last() / g.first()).min() if not g.size().empty else float("nan")
    nf = d[d["quantity"] == "norm_factor"]["value"].min()
    ours = f"{len(collapsed)} run(s) within 0.1 nats of the floor {floor:.2f}; ||dL/dh_1|| last/first {fall:.2g}; min norm factor {nf:.3g}"
    return ours, verdict(bool(fall < 1e-2 and nf < 1)), ""


def claim_l(t: dict, s: dict):
    rms, runs = _final_rms(t), t.get("runs", pd.DataFrame())
    if rms.empty or not R.has(runs, "n_kv_head", "n_head"):
        return "", untestable("no dynamics rows"), ""
    rms = rms.merge(runs[["run_id", "n_head", "n_kv_head"]], on="run_id", suffixes=("_x", ""))
    rms["variant"] = np.where(
        rms["knobs"].str.contains("moe"),
        "moe",
        np.where(rms["n_kv_head"] < rms["n_head"], "gqa", "base"),
    )
    found = [v for v in ("gqa", "moe") if v in set(rms["variant"])]
    if not found:
        return (
            "",
            untestable(
                "no GQA runs (model.n_kv_head < n_head) and no MoE runs (model.moe) in the grid"
            ),
            "",
        )
    piv = (
        rms.assign(var=rms["value"] ** 2)
        .groupby(["arch", "n_layer", "variant"])["var"]
        .mean()
        .unstack()
    )
    parts, ok = [], True
    for v in found:
        both = piv[["base", v]].dropna() if "base" in piv else pd.DataFrame()
        if both.empty:
            return (
                "",
                untestable(f"no MHA/dense run of the same architecture and depth as the {v} runs"),
                "",
            )
        parts.append(f"{v}/base variance {float((both[v] / both['base']).mean()):.2f}")
        ok &= bool((both[v] < both["base"]).all())
    return "; ".join(parts), verdict(ok), ""


def _removable(t: dict) -> pd.DataFrame:
    """Per architecture at its deepest shape (best-LR runs, first seed, trained runs only): the
    largest fraction of layers any non-random ranking can remove within the tolerance, and the
    random baseline's."""
    depth = t.get("effective_depth", pd.DataFrame())
    if not R.has(depth, "arch", "n_layer", "ranking", "effective_fraction"):
        return pd.DataFrame()
    if "is_best_lr" in depth.columns:
        depth = R.first_seed(depth[depth["is_best_lr"].fillna(False).astype(bool)])
    depth = depth[depth["n_layer"] == depth.groupby("arch")["n_layer"].transform("max")]
    ranked = (
        depth[depth["ranking"] != "random"].groupby(["arch", "n_layer"])["effective_fraction"].max()
    )
    random = (
        depth[depth["ranking"] == "random"].groupby(["arch", "n_layer"])["effective_fraction"].max()
    )
    return pd.DataFrame({"removable": ranked, "random": random}).reset_index()


def claim_m(t: dict, s: dict):
    removable = _removable(t)
    if removable.empty:
        return "", untestable("no effective-depth rows (removal or probes disabled)"), ""
    if "pre_ln" not in set(removable["arch"]) or len(removable) < 2:
        return (
            "",
            untestable("needs pre_ln and another architecture in the effective-depth rows"),
            "",
        )
    by_arch = removable.set_index("arch")
    if by_arch["n_layer"].nunique() > 1:
        return "", untestable("the architectures' deepest shapes differ in depth"), ""
    pre = float(by_arch.loc["pre_ln", "removable"])
    others = by_arch.drop(index="pre_ln")
    ours = ", ".join(f"{a} {v:.2f}" for a, v in by_arch["removable"].items())
    ours += f" of L = {int(by_arch['n_layer'].iloc[0])} removable (best ranking; random baseline up to {by_arch['random'].max():.2f})"
    keeps_more = [a for a, v in others["removable"].items() if v < pre]
    note = f"keep more layers necessary than pre_ln: {', '.join(keeps_more) or 'none'}"
    return ours, verdict(len(keeps_more) == len(others)), note


CLAIMS: dict[str, Callable] = dict(
    zip(
        [
            "a_depth_helps_hc_attnres_not_pre_ln",
            "b_intermediate_best_depth",
            "c_late_angular_distance",
            "d_causal_permutation_shares",
            "e_dead_zone_grows",
            "f_mhc_rank_below_hc",
            "g_cost_grows_with_depth",
            "h_deep_nll_stem_math",
            "i_pre_ln_rms_grows_lns_holds",
            "j_post_ln_token_similarity",
            "k_collapse_signature",
            "l_gqa_moe_lower_variance",
            "m_fewer_layers_removable_than_pre_ln",
        ],
        [
            claim_a,
            claim_b,
            claim_c,
            claim_d,
            claim_e,
            claim_f,
            claim_g,
            claim_h,
            claim_i,
            claim_j,
            claim_k,
            claim_l,
            claim_m,
        ],
    )
)


def load_claims(path: str | Path) -> list[dict]:
    """The claim rows of the data file, checked against the claim functions."""
    rows = yaml.safe_load(Path(path).read_text()) or []
    for n, row in enumerate(rows):
        missing = {"id", "claim", "source", "paper", "method"} - set(row)
        if missing:
            raise DepthBenchError(f"{path}: claim {n} lacks {sorted(missing)}")
        if row["id"] not in CLAIMS:
            raise DepthBenchError(
                f"{path}: claim id {row['id']!r} has no function; valid: {sorted(CLAIMS)}"
            )
    return rows


def scale(t: dict) -> str:
    """The scale at which our numbers were measured: parameters, depths, tokens per run."""
    runs = t.get("runs", pd.DataFrame())
    if not R.has(runs, "params", "n_layer"):
        return "no runs"
    tokens = f", {runs['tokens_seen'].max():.3g} tokens per run" if "tokens_seen" in runs else ""
    depths = ",".join(str(L) for L in sorted(runs["n_layer"].unique()))
    return f"{runs['params'].median():.3g} params, L = {depths}{tokens}"


def claims_table(rows: list[dict], tables: dict, settings: dict) -> pd.DataFrame:
    out = []
    for row in rows:
        ours, v, note = CLAIMS[row["id"]](tables, settings)
        out.append(
            {
                "claim_id": row["id"],
                "claim": row["claim"],
                "source": row["source"],
                "paper": row["paper"],
                "ours": ours,
                "method": row["method"],
                "scale": scale(tables),
                "verdict": v,
                "note": note,
            }
        )
    return pd.DataFrame(
        out,
        columns=[
            "claim_id",
            "claim",
            "source",
            "paper",
            "ours",
            "method",
            "scale",
            "verdict",
            "note",
        ],
    )
