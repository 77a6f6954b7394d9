"""The claims table: every claim's four outcomes (holds, contradicted, inconclusive at this scale,
not testable in this grid) on synthetic tables whose answer is known, the intervals behind them
(seeds, or a table's own ci_low / ci_high), the single-seed flag, and the cells left out
because their best run did not learn."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from depthbench.analysis import readers as R
from depthbench.analysis.claims.table import COLUMNS, claims_table, load_claims
from depthbench.analysis.claims.verdict import (
    CLAIMS,
    CONTRADICTED,
    HOLDS,
    INCONCLUSIVE,
    NOT_TESTABLE,
    OUTCOMES,
)
from depthbench.analysis.tables import best_learning_rates
from depthbench.util.errors import DepthBenchError
from tests.analysis_tables import FLOOR, HALF_WIDTH, JITTER, synthetic_tables

CLAIMS_FILE = Path(__file__).resolve().parents[2] / "config" / "claims.yaml"
ALL = ("pre_ln", "post_ln", "lns", "hc", "mhc", "attnres_full", "attnres_block")


@pytest.fixture(scope="module")
def two_seeds():
    return synthetic_tables(archs=ALL, lrs=(2e-3,), seeds=(0, 1))


@pytest.fixture(scope="module")
def one_seed():
    return synthetic_tables(archs=ALL, lrs=(2e-3,))


def fresh(t: dict) -> dict:
    return {k: v.copy() for k, v in t.items()}


def run(claim_id: str, t: dict, settings: dict | None = None):
    return CLAIMS[claim_id].fn(t, settings or {})


def verdict(claim_id: str, t: dict, settings: dict | None = None) -> str:
    return run(claim_id, t, settings).verdict


def set_probe(t: dict, probe: str, fn, where=None) -> dict:
    """Probe rows' values from fn(row) plus the seed's jitter (rows matching `where` only)."""
    p = t["probes"]
    mask = (p["probe"] == probe) & (where(p) if where else True)
    p.loc[mask, "value"] = [fn(r) + JITTER * r.seed for r in p[mask].itertuples()]
    return t


def set_loss(t: dict, fn) -> dict:
    """Every finished run's final loss fn(arch, n_layer) plus its seed's jitter; `learned` and
    best_lr follow."""
    runs = t["runs"]
    ok = runs["status"] == "ok"
    runs.loc[ok, "final_val_loss"] = [
        fn(r.arch, r.n_layer) + JITTER * r.seed for r in runs[ok].itertuples()
    ]
    runs["learned"] = [R.learned(v, FLOOR, 0.1) for v in runs["final_val_loss"]]
    t["best_lr"] = best_learning_rates(runs)
    return t


def drop(t: dict, archs=(), keep_depths=None) -> dict:
    """The tables without the rows of `archs`, and with only `keep_depths` (every table with an
    arch / n_layer column; dynamics by run)."""
    out = {}
    for name, df in t.items():
        if "arch" in df.columns:
            df = df[~df["arch"].isin(archs)]
        if keep_depths is not None and "n_layer" in df.columns:
            df = df[df["n_layer"].isin(keep_depths)]
        out[name] = df
    out["dynamics"] = t["dynamics"][t["dynamics"]["run_id"].isin(set(out["runs"]["run_id"]))]
    return out


def run_ids(t: dict, arch: str) -> set:
    return set(t["runs"].loc[t["runs"]["arch"] == arch, "run_id"])


# -- (a) and (b): best-LR loss against depth -------------------------------------------------------
def test_a_depth_helps_hc_and_full_attnres_only(two_seeds, one_seed):
    a = "a_depth_helps_hc_attnres_not_pre_ln"
    # synthetic: Pre-LN flat at 4.0, the others 4 - 0.02 L; seeds 1e-3 apart
    assert verdict(a, fresh(two_seeds)) == HOLDS
    assert verdict(a, set_loss(fresh(two_seeds), lambda arch, L: 4.0 - 0.02 * L)) == CONTRADICTED
    assert verdict(a, set_loss(fresh(two_seeds), lambda arch, L: 4.0 + 0.02 * L)) == CONTRADICTED
    flat = run(a, set_loss(fresh(two_seeds), lambda arch, L: 4.0))
    assert flat.verdict == INCONCLUSIVE and not flat.single_seed  # the intervals overlap
    single = run(a, fresh(one_seed))  # one seed, no interval: nothing separates
    assert single.verdict == INCONCLUSIVE and single.single_seed
    assert "no attnres_full in best_lr" in verdict(a, drop(two_seeds, ["attnres_full"]))
    assert verdict(a, drop(two_seeds, keep_depths=[8])).endswith("depth(s) in best_lr, needs 2")


def test_b_intermediate_best_depth(two_seeds):
    b = "b_intermediate_best_depth"
    valley = lambda arch, L: 4.0 + (L - 4) ** 2 * 0.01  # noqa: E731  best at L = 4 of 2, 4, 8
    result = run(b, set_loss(fresh(two_seeds), valley))
    assert result.verdict == HOLDS and result.ours == "attnres_block best at L=4, mhc best at L=4"
    down = lambda arch, L: 4.0 - 0.01 * L  # noqa: E731  the deepest end is best
    assert verdict(b, set_loss(fresh(two_seeds), down)) == CONTRADICTED
    assert verdict(b, set_loss(fresh(two_seeds), lambda arch, L: 4.0)) == INCONCLUSIVE
    two_depths = drop(two_seeds, keep_depths=[2, 4])
    assert verdict(b, two_depths).startswith(NOT_TESTABLE) and "needs 3" in verdict(b, two_depths)


# -- probes: (c) to (f), (j) -----------------------------------------------------------------------
def _adjacent(t: dict, contrast: float, norms: float, bump_at=()) -> dict:
    def value(r):
        base = contrast if r.arch in ("hc", "attnres_full", "attnres_block") else norms
        return base + (0.2 if r.arch == "attnres_block" and r.i in bump_at else 0.0)

    return set_probe(t, "angular_distance_last", value, lambda p: p["j"] == 1)


def test_c_late_angular_distance_and_its_block_note(two_seeds, one_seed):
    c, blocks = "c_late_angular_distance", {"arch_options": {"n_blocks": 4}}  # ends 2, 4, 6 at L=8
    result = run(c, _adjacent(fresh(two_seeds), 0.3, 0.1, bump_at=(2, 4, 6)), blocks)
    assert result.verdict == HOLDS and "pre_ln 0.10" in result.ours
    assert result.note.startswith("block part: d at block boundaries") and result.note.endswith(
        f": {HOLDS}"
    )
    result = run(c, _adjacent(fresh(two_seeds), 0.1, 0.3, bump_at=(1, 3, 5)), blocks)
    assert result.verdict == CONTRADICTED and result.note.endswith(f": {CONTRADICTED}")
    result = run(c, _adjacent(fresh(two_seeds), 0.2, 0.2), blocks)
    assert result.verdict == INCONCLUSIVE and result.note.endswith(f": {INCONCLUSIVE}")
    result = run(c, _adjacent(fresh(one_seed), 0.3, 0.1, bump_at=(2, 4, 6)), blocks)
    assert result.verdict == INCONCLUSIVE and result.note.endswith(f": {INCONCLUSIVE}")
    every_layer = run(c, _adjacent(fresh(two_seeds), 0.3, 0.1), {"arch_options": {"n_blocks": 8}})
    assert every_layer.note == (
        f"block part {NOT_TESTABLE}: n_blocks 8 >= L 8, every layer is a block"
    )
    no_block = run(c, _adjacent(drop(two_seeds, ["attnres_block"]), 0.3, 0.1), blocks)
    assert no_block.verdict == HOLDS
    assert no_block.note == f"block part {NOT_TESTABLE}: no attnres_block rows at L=8"
    norms_only = drop(two_seeds, ["hc", "attnres_full", "attnres_block"])
    assert verdict(c, norms_only).startswith(NOT_TESTABLE)


def test_d_causal_and_permutation_shares(two_seeds):
    d = "d_causal_permutation_shares"
    paper = fresh(two_seeds)
    set_probe(paper, "causal_share", lambda r: {"attnres_full": 0.16, "hc": 0.07}.get(r.arch, 0.01))
    set_probe(
        paper, "permutation_share", lambda r: {"attnres_full": 0.46, "hc": 0.35}.get(r.arch, 0.08)
    )
    result = run(d, paper)
    assert result.verdict == HOLDS
    assert result.ours.startswith("causal 16% / 7% / 1%; permutation 46% / 35% / 8%")
    opposite = set_probe(fresh(paper), "causal_share", lambda r: 0.5 if r.arch == "pre_ln" else 0.1)
    assert verdict(d, opposite) == CONTRADICTED
    # synthetic permutation shares: hc 0.4, attnres_full and pre_ln both 0.1
    assert verdict(d, fresh(two_seeds)) == INCONCLUSIVE
    assert verdict(d, drop(two_seeds, ["hc"])) == f"{NOT_TESTABLE}: no trained share rows of hc"


def test_e_dead_zone_grows_is_a_chain_over_depth(two_seeds):
    e = "e_dead_zone_grows"
    assert verdict(e, fresh(two_seeds)) == HOLDS  # L // 4: 0, 1, 2

    def zone(by_depth):
        return set_probe(fresh(two_seeds), "dead_zone_layers", lambda r: by_depth[r.n_layer])

    assert verdict(e, zone({2: 2.0, 4: 1.0, 8: 0.0})) == CONTRADICTED
    assert verdict(e, zone({2: 0.0, 4: 1.0, 8: 1.0})) == INCONCLUSIVE  # one step does not separate
    assert verdict(e, zone({2: 0.0, 4: 2.0, 8: 1.0})) == CONTRADICTED  # one step goes down
    assert verdict(e, drop(two_seeds, keep_depths=[8])).startswith(NOT_TESTABLE)


def test_f_mhc_rank_below_hc(two_seeds):
    f = "f_mhc_rank_below_hc"
    result = run(f, fresh(two_seeds))  # synthetic: mhc 1.5, hc 2.6 at every depth
    assert result.verdict == HOLDS
    assert (
        result.ours
        == "L=2: mhc 1.50 vs hc 2.60; L=4: mhc 1.50 vs hc 2.60; L=8: mhc 1.50 vs hc 2.60"
    )
    swap = lambda r: 1.5 if r.arch == "hc" else 2.6  # noqa: E731
    assert verdict(f, set_probe(fresh(two_seeds), "residual_product_rank", swap)) == CONTRADICTED
    same = set_probe(fresh(two_seeds), "residual_product_rank", lambda r: 2.0)
    assert verdict(f, same) == INCONCLUSIVE
    assert verdict(f, drop(two_seeds, ["mhc"])).startswith(NOT_TESTABLE)


def test_j_post_ln_token_similarity_at_init(two_seeds):
    j = "j_post_ln_token_similarity"

    def tsim(fast):
        def value(r):  # seeds differ in their growth, by JITTER per layer
            return r.i * (0.1 if (r.arch, r.stage) == fast else 0.02) + r.i * JITTER * r.seed

        return set_probe(fresh(two_seeds), "token_similarity", value)

    assert verdict(j, tsim(("post_ln", "init"))) == HOLDS
    assert verdict(j, tsim(("pre_ln", "init"))) == CONTRADICTED
    assert verdict(j, fresh(two_seeds)) == INCONCLUSIVE  # synthetic: 0.1 l for every model
    assert verdict(j, drop(two_seeds, ["post_ln"])).startswith(NOT_TESTABLE)


# -- (g) and (h): cost and NLL ---------------------------------------------------------------------
def test_g_cost_is_exact_and_needs_two_depths(one_seed):
    g = "g_cost_grows_with_depth"
    result = run(g, fresh(one_seed))  # analytic: exact numbers separate on one seed
    assert (
        result.verdict == HOLDS and not result.single_seed and "(exact)" in result.estimates_text()
    )
    t = fresh(one_seed)
    t["cost"]["prefill_flops_4096"] = 1e9 / t["cost"]["n_layer"]
    t["cost"]["kv_cache_bytes_4096"] = 2**20 / t["cost"]["n_layer"]
    assert verdict(g, t) == CONTRADICTED
    t["cost"]["prefill_flops_4096"] = t["cost"]["kv_cache_bytes_4096"] = 1e9
    assert verdict(g, t) == INCONCLUSIVE


def test_g_with_one_trained_shape_and_a_pretrained_model_is_not_testable(one_seed):
    """A grid of one trained depth beside a pretrained model has one depth to compare."""
    t = drop(one_seed, keep_depths=[4])
    pretrained = {"run_id": "pretrained_x", "arch": "llama", "n_layer": 30, "d_model": 576}
    pretrained |= {"knobs": "{}", "status": "pretrained", "ratio": 19.2, "params": 1.3e8}
    t["runs"] = pd.concat([t["runs"], pd.DataFrame([pretrained])], ignore_index=True)
    cost = {
        **pretrained,
        "prefill_flops_4096": 3e13,
        "kv_cache_bytes_4096": 2**30,
        "arch": "pre_ln",
    }
    t["cost"] = pd.concat([t["cost"], pd.DataFrame([cost])], ignore_index=True)
    table = claims_table(load_claims(CLAIMS_FILE), t, {}).set_index("claim_id")
    assert table.loc["g_cost_grows_with_depth", "verdict"] == (
        f"{NOT_TESTABLE}: pre_ln at 1 depth(s) in the cost rows, needs 2"
    )
    assert table.loc["g_cost_grows_with_depth", "scale"].endswith("L = 4")  # trained runs only


def test_h_deep_nll_on_stem_and_math(two_seeds):
    h = "h_deep_nll_stem_math"

    def bits(pre, others):
        t = fresh(two_seeds)
        nll = t["nll"]
        nll["bits_per_byte"] = np.where(nll["arch"] == "pre_ln", pre, others) + JITTER * nll["seed"]
        return t

    assert verdict(h, bits(1.5, 1.4)) == HOLDS
    assert verdict(h, bits(1.3, 1.4)) == CONTRADICTED
    assert verdict(h, fresh(two_seeds)) == INCONCLUSIVE  # synthetic: equal for every architecture
    assert verdict(h, drop(two_seeds, ["attnres_full"])).startswith(NOT_TESTABLE)
    assert verdict(h, {**fresh(two_seeds), "nll": pd.DataFrame()}) == (
        f"{NOT_TESTABLE}: no NLL table (nll disabled)"
    )


# -- dynamics: (i), (k), (l) -----------------------------------------------------------------------
def _rms(t: dict, arch: str, value: float) -> dict:
    dyn = t["dynamics"]
    mask = dyn["run_id"].isin(run_ids(t, arch)) & (dyn["quantity"] == "residual_rms")
    seeds = dyn.loc[mask, "run_id"].str.endswith("_s1").astype(float)
    dyn.loc[mask, "value"] = value + JITTER * seeds
    return t


def test_i_pre_ln_rms_grows_and_lns_holds_it_down(two_seeds):
    i = "i_pre_ln_rms_grows_lns_holds"
    assert verdict(i, _rms(fresh(two_seeds), "lns", 1.0)) == HOLDS  # pre_ln RMS(h_L) 3 -> 9
    assert verdict(i, _rms(fresh(two_seeds), "lns", 20.0)) == CONTRADICTED
    assert verdict(i, fresh(two_seeds)) == INCONCLUSIVE  # synthetic: lns as pre_ln
    assert verdict(i, drop(two_seeds, ["lns"])).startswith(NOT_TESTABLE)


def _collapse(t: dict, arch: str, loss: float, grad_last: float | None) -> dict:
    """The runs of `arch` at `loss`, marked as not learned; their ||dL/dh_1|| at the last step
    about `grad_last` (None: about the first step's), the runs a little apart."""
    runs, dyn = t["runs"], t["dynamics"]
    ids = run_ids(t, arch)
    runs.loc[runs["run_id"].isin(ids), ["final_val_loss", "learned"]] = [loss, False]
    last = dyn["run_id"].isin(ids) & (dyn["quantity"] == "grad_norm_h") & (dyn["step"] == 100)
    last &= dyn["index"] == 1
    level = dyn.loc[last, "value"] if grad_last is None else grad_last
    dyn.loc[last, "value"] = level * (1 + dyn.loc[last, "value"])  # seeds differ a little
    return t


def test_k_collapse_signature(two_seeds, one_seed):
    k = "k_collapse_signature"
    assert verdict(k, _collapse(fresh(two_seeds), "post_ln", FLOOR + 0.02, 1e-6)) == HOLDS
    assert verdict(k, _collapse(fresh(two_seeds), "post_ln", FLOOR + 0.02, None)) == CONTRADICTED
    lone = _collapse(fresh(one_seed), "post_ln", FLOOR + 0.02, 1e-6)
    lone["runs"].loc[lone["runs"]["n_layer"] != 8, ["final_val_loss", "learned"]] = [4.0, True]
    result = run(k, lone)  # one collapsed run: no interval over runs
    assert result.verdict == INCONCLUSIVE and result.single_seed
    assert "no run collapsed" in verdict(k, fresh(two_seeds))
    no_dyn = {**_collapse(fresh(two_seeds), "post_ln", FLOOR, 1e-6), "dynamics": pd.DataFrame()}
    assert verdict(k, no_dyn) == f"{NOT_TESTABLE}: no dynamics rows for the 6 collapsed run(s)"
    # the margin (analysis.learned_margin) bounds how far from the floor a collapsed run sits
    below = _collapse(fresh(two_seeds), "post_ln", FLOOR - 0.15, 1e-6)
    assert verdict(k, below, {"analysis": {"learned_margin": 0.2}}) == HOLDS
    assert "no run collapsed" in verdict(k, below, {"analysis": {"learned_margin": 0.1}})


def _variant(t: dict, arch: str, knobs: str, n_kv_head: int, scale: float, base=True) -> dict:
    """Copies of `arch`'s runs as another cell (`knobs`, `n_kv_head`) whose residual RMS is
    `scale` times the base's; best_lr follows. base=False drops the base runs."""
    runs, dyn = t["runs"], t["dynamics"]
    ids = run_ids(t, arch)
    copies = runs[runs["run_id"].isin(ids)].assign(
        run_id=lambda d: d["run_id"] + "_v", knobs=knobs, n_kv_head=n_kv_head
    )
    rows = dyn[dyn["run_id"].isin(ids)].assign(run_id=lambda d: d["run_id"] + "_v")
    rows.loc[rows["quantity"] == "residual_rms", "value"] *= scale
    if not base:
        runs, dyn = runs[~runs["run_id"].isin(ids)], dyn[~dyn["run_id"].isin(ids)]
    t["runs"] = pd.concat([runs, copies], ignore_index=True)
    t["dynamics"] = pd.concat([dyn, rows], ignore_index=True)
    t["best_lr"] = best_learning_rates(t["runs"])
    return t


def test_l_gqa_and_moe_lower_the_residual_variance(two_seeds):
    l_ = "l_gqa_moe_lower_variance"
    gqa = '{"model.n_kv_head": 2}'
    result = run(l_, _variant(fresh(two_seeds), "hc", gqa, 2, 0.5))
    assert result.verdict == HOLDS and result.ours == "gqa/base variance 0.25"
    assert verdict(l_, _variant(fresh(two_seeds), "hc", '{"model.moe": true}', 4, 0.5)) == HOLDS
    assert verdict(l_, _variant(fresh(two_seeds), "hc", gqa, 2, 2.0)) == CONTRADICTED
    assert verdict(l_, _variant(fresh(two_seeds), "hc", gqa, 2, 1.0)) == INCONCLUSIVE
    assert "no GQA runs" in verdict(l_, fresh(two_seeds))
    alone = _variant(fresh(two_seeds), "hc", gqa, 2, 0.5, base=False)
    assert "no MHA/dense run of the same architecture and depth" in verdict(l_, alone)


# -- (m) and the one removable reader --------------------------------------------------------------
def _removable(t: dict, fractions: dict, default: float) -> dict:
    depth = t["effective_depth"]
    ranked = depth["ranking"] != "random"
    depth.loc[ranked, "effective_fraction"] = [
        fractions.get(r.arch, default) + JITTER * r.seed for r in depth[ranked].itertuples()
    ]
    depth.loc[~ranked, "effective_fraction"] = 0.1
    return t


def test_m_fewer_layers_removable_than_pre_ln(two_seeds):
    m = "m_fewer_layers_removable_than_pre_ln"
    result = run(m, _removable(fresh(two_seeds), {"pre_ln": 0.5}, 0.25))
    assert result.verdict == HOLDS and "pre_ln 0.50 of L = 8 removable" in result.ours
    assert verdict(m, _removable(fresh(two_seeds), {"pre_ln": 0.125}, 0.5)) == CONTRADICTED
    assert verdict(m, _removable(fresh(two_seeds), {}, 0.25)) == INCONCLUSIVE
    assert verdict(m, drop(two_seeds, ["pre_ln"])).startswith(NOT_TESTABLE)
    assert verdict(m, {}) == f"{NOT_TESTABLE}: no effective-depth rows (removal or probes disabled)"


def test_one_removable_reader_behind_the_claim_the_headline_and_the_profile(two_seeds):
    """The largest fraction over non-random rankings, best-LR first seed: the same number in
    the claim's estimates (first seed alone), the headline's panel and the layer profile."""
    from depthbench.analysis.loss_figures import _removable_by_shape
    from depthbench.analysis.profile import layer_profile

    t = fresh(two_seeds)
    depth = t["effective_depth"]
    fractions = {"angular_block": 0.25, "causal": 0.5, "last": 0.375, "random": 0.75}
    depth["effective_fraction"] = (
        depth["ranking"].map(fractions).fillna(0.0) + 0.125 * depth["seed"]
    )
    first = R.removable(depth)
    assert set(first["seed"]) == {0} and (first["removable"] == 0.5).all()  # causal, not random
    assert (first["best_ranking"] == "causal").all() and (first["random_removable"] == 0.75).all()
    assert set(R.removable(depth, all_seeds=True)["removable"]) == {0.5, 0.625}
    assert (_removable_by_shape(depth)["effective_fraction"] == 0.5).all()
    assert (layer_profile(t["probes"], depth)["removable"] == 0.5).all()
    one = run("m_fewer_layers_removable_than_pre_ln", {"effective_depth": first})
    assert all(e.value == 0.5 for e in one.estimates.values())


# -- the intervals and tests behind the verdicts --------------------------------------------------
def test_two_seeds_give_the_pooled_interval_and_one_seed_the_tables_own():
    """Two seeds: the rank's seed variance pooled over hc's and mhc's cells (1 df each), the
    difference's t test with those 2 df. One seed with the probe's own bootstrap interval
    (ci_low / ci_high): a z test on it, flagged single seed."""
    t = synthetic_tables(archs=("hc", "mhc"), depths=(2,), lrs=(2e-3,), seeds=(0, 1))
    row = (
        claims_table(load_claims(CLAIMS_FILE), t, {})
        .set_index("claim_id")
        .loc["f_mhc_rank_below_hc"]
    )
    mhc, hc = np.array([1.5, 1.5 + JITTER]), np.array([2.6, 2.6 + JITTER])
    pooled = (mhc.var(ddof=1) + hc.var(ddof=1)) / 2  # 2 df
    half = 4.303 * math.sqrt(pooled / 2)  # t(0.975, 2) from a printed table
    assert row["lhs"] == "mhc L=2" and row["rhs"] == "hc L=2" and row["lhs_n"] == 2
    assert row["lhs_value"] == pytest.approx(mhc.mean())
    assert (row["lhs_low"], row["lhs_high"]) == pytest.approx(
        (mhc.mean() - half, mhc.mean() + half), abs=1e-6
    )
    ref = stats.ttest_ind(mhc, hc, equal_var=True)
    assert row["estimate"] == pytest.approx(mhc.mean() - hc.mean())
    assert row["df"] == 2 and row["p_value"] == pytest.approx(ref.pvalue)
    assert row["ci_high"] < 0 and row["verdict"] == HOLDS and not row["single_seed"]
    assert row["effect"] == "mhc L=2 - hc L=2" and "pooled" in row["test"]
    one = synthetic_tables(archs=("hc", "mhc"), depths=(2,), lrs=(2e-3,), intervals=True)
    row = (
        claims_table(load_claims(CLAIMS_FILE), one, {})
        .set_index("claim_id")
        .loc["f_mhc_rank_below_hc"]
    )
    assert (row["lhs_low"], row["lhs_high"]) == pytest.approx((1.5 - HALF_WIDTH, 1.5 + HALF_WIDTH))
    assert row["verdict"] == HOLDS and row["single_seed"] and row["df"] == math.inf
    assert row["estimates"] == "mhc L=2 1.5 [1.495, 1.505] (n=1); hc L=2 2.6 [2.595, 2.605] (n=1)"


def test_one_seed_of_the_loss_has_no_test():
    """A final loss carries no interval of its own: one seed in every cell leaves the loss claims
    without a test, and best_lr without an interval."""
    t = synthetic_tables(archs=("pre_ln", "hc", "attnres_full"), lrs=(2e-3,))
    assert t["best_lr"]["ci_low"].isna().all() and (t["best_lr"]["pooled_df"] == 0).all()
    result = run("a_depth_helps_hc_attnres_not_pre_ln", t)
    assert result.verdict == INCONCLUSIVE and result.single_seed
    assert "no test" in result.contrasts_text()


def test_every_testable_claim_row_has_an_estimate_interval_p_value_and_df(two_seeds):
    table = claims_table(load_claims(CLAIMS_FILE), two_seeds, {"arch_options": {"n_blocks": 4}})
    testable = table[~table["verdict"].str.startswith(NOT_TESTABLE)]
    assert len(testable) >= 9
    for column in ("estimate", "ci_low", "ci_high", "p_value", "df"):
        assert testable[column].notna().all(), column
    assert (testable["ci_low"] <= testable["estimate"]).all()
    assert (testable["estimate"] <= testable["ci_high"]).all()
    assert testable["test"].str.len().gt(0).all() and testable["variance"].str.len().gt(0).all()


# -- the table -------------------------------------------------------------------------------------
def test_claim_file_and_registry_match():
    rows = load_claims(CLAIMS_FILE)
    ids = [r["id"] for r in rows]
    assert set(ids) == set(CLAIMS) and ids == sorted(ids) and len(ids) >= 13


def test_a_claim_id_without_a_function_is_refused(tmp_path):
    path = tmp_path / "claims.yaml"
    path.write_text("- {id: z_unknown, claim: c, source: s, paper: p, method: m}\n")
    with pytest.raises(DepthBenchError, match=r"claims.yaml: claim id 'z_unknown' has no function"):
        load_claims(path)


def test_the_table_states_every_outcome_with_its_numbers(two_seeds, one_seed):
    table = claims_table(load_claims(CLAIMS_FILE), two_seeds, {})
    assert list(table.columns) == COLUMNS and len(table) == len(CLAIMS)
    assert table["verdict"].map(lambda v: v in OUTCOMES or v.startswith(NOT_TESTABLE + ": ")).all()
    a = table.set_index("claim_id").loc["a_depth_helps_hc_attnres_not_pre_ln"]
    # the seed SD JITTER / sqrt(2) pooled over 21 cells (21 df): 4.0005 +- t(21) JITTER / 2
    assert a["estimates"].startswith("pre_ln L=2 4.001 [3.999, 4.002] (n=2); pre_ln L=8 4.001")
    assert a["effect"] == "hc slope per doubling of L" and a["df"] == 21
    assert not a["single_seed"] and a["excluded_cells"] == 0
    single = claims_table(load_claims(CLAIMS_FILE), one_seed, {}).set_index("claim_id")
    assert single.loc["a_depth_helps_hc_attnres_not_pre_ln", "single_seed"]
    assert not single.loc["g_cost_grows_with_depth", "single_seed"]  # exact
    assert not single.loc["k_collapse_signature", "single_seed"]  # not testable: no numbers
    empty = claims_table(load_claims(CLAIMS_FILE), {}, {})
    assert len(empty) == len(CLAIMS) and empty["verdict"].str.startswith(NOT_TESTABLE).all()


def test_cells_whose_best_run_did_not_learn_are_left_out(two_seeds):
    """hc at L=8 stuck near the floor would contradict (a); left out, hc's deepest is L=4."""
    t = fresh(two_seeds)
    runs = t["runs"]
    stuck = (runs["arch"] == "hc") & (runs["n_layer"] == 8)
    runs.loc[stuck, ["final_val_loss", "learned"]] = [FLOOR - 0.05, False]
    t["best_lr"] = best_learning_rates(runs)
    assert verdict("a_depth_helps_hc_attnres_not_pre_ln", t) == CONTRADICTED  # kept, it would
    table = claims_table(load_claims(CLAIMS_FILE), t, {}).set_index("claim_id")
    a = table.loc["a_depth_helps_hc_attnres_not_pre_ln"]
    assert a["verdict"] == HOLDS and "hc L=4" in a["estimates"] and "hc L=8" not in a["estimates"]
    assert a["excluded_cells"] == 1
    assert "left out 1 cell(s) whose best-LR run did not learn" in a["note"]
    assert a["note"].endswith("not 0.1 nats below the unigram floor 5.50): hc L=8")
    assert "hc L=8" not in table.loc["f_mhc_rank_below_hc", "estimates"]  # probes too
    for untouched in ("g_cost_grows_with_depth", "j_post_ln_token_similarity"):
        assert table.loc[untouched, "excluded_cells"] == 0  # analytic / at init


def test_report_shows_the_numbers_and_flags_single_seed_verdicts(two_seeds, one_seed):
    from depthbench.analysis.report import claims_html

    both = pd.concat(
        [
            claims_table(load_claims(CLAIMS_FILE), two_seeds, {}).iloc[[5]],  # f, two seeds
            claims_table(load_claims(CLAIMS_FILE), one_seed, {}).iloc[[0]],  # a, one seed
        ]
    )
    page = claims_html(both)
    f_row, a_row = page.split("<tr")[2:]
    assert 'class="holds"' in f_row and "single seed" not in f_row and "(n=2)" in f_row
    assert 'class="inconclusive"' in a_row and "single seed" in a_row
    assert "(n=1, no interval)" in a_row
    f = both.iloc[0]
    assert f"<b>mhc L=2 - hc L=2</b>: {f['estimate']:.3g} [" in f_row
    assert f"df {f['df']:.3g}, p = {f['p_value']:.2g}" in f_row


def test_report_states_the_model_pooled_df_and_test_above_the_claims(two_seeds):
    from depthbench.analysis.report import claims_method

    text = claims_method(two_seeds["best_lr"])
    df = int(two_seeds["best_lr"]["pooled_df"].max())
    assert df == 21 and f"<b>{df} degrees of freedom</b>" in text  # 21 cells of two seeds
    assert "least-squares slope" in text and "two-sided t test" in text and "Bonferroni" in text


def test_run_rows_mark_the_runs_that_did_not_learn(wiki_jsonl, tmp_path):
    """runs.parquet `learned`: the final loss more than the margin below the floor; a diverged
    run did not learn."""
    from depthbench.analysis.tables import run_rows
    from tests.conftest import status_grid, tiny_config
    from tests.run_outputs import fake_summary

    config = tiny_config(wiki_jsonl, learning_rates=[1e-3, 3e-3, 1e-2])
    _, exp, res = status_grid(config, tmp_path)
    losses = dict(zip(sorted(exp.runs, key=lambda rid: exp.runs[rid].lr), [5.85, 5.95, None]))
    paths = [
        fake_summary(res, exp.runs[rid], "diverged" if loss is None else "ok", final_val_loss=loss)
        for rid, loss in losses.items()
    ]
    runs = run_rows([str(p) for p in paths], 6.0, "tiny").set_index("run_id")["learned"]
    assert runs.to_dict() == dict(zip(losses, [True, False, False]))  # the default margin, 0.1
    wide = run_rows([str(p) for p in paths], 6.0, "tiny", learned_margin=0.2)
    assert not wide["learned"].any()
