"""The cell-means models behind the claims (depthbench.analysis.stats, best_loss) against
computations that do not share their code: scipy's two-sample t test, least squares on a
dummy-coded design with numpy, scipy.stats.linregress, Welch-Satterthwaite by hand, and the
closed form of a two-LR choice's penalty."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from depthbench.analysis.best_loss import lr_choice_variance
from depthbench.analysis.cell_model import CellModel
from depthbench.analysis.stats import MIN_GROUP_DF

RNG = np.random.default_rng(4)


def frame(cells: dict) -> pd.DataFrame:
    """One row per run from {(arch, L): values}."""
    return pd.DataFrame(
        [(a, L, v) for (a, L), vs in cells.items() for v in vs],
        columns=["arch", "n_layer", "value"],
    )


def test_two_cells_give_the_pooled_two_sample_t_test():
    a, b = RNG.normal(1.0, 0.2, 3), RNG.normal(1.3, 0.2, 4)
    m = CellModel(frame({("x", 2): a, ("x", 4): b}), ["arch", "n_layer"])
    test = m.difference(("x", 2), ("x", 4))
    ref = sps.ttest_ind(a, b, equal_var=True)
    assert test.estimate == pytest.approx(a.mean() - b.mean())
    assert test.df == 5 and test.p == pytest.approx(ref.pvalue)
    half = sps.t.ppf(0.975, 5) * abs(test.estimate) / abs(ref.statistic)
    assert (test.low, test.high) == pytest.approx((test.estimate - half, test.estimate + half))


def test_a_contrast_of_many_cells_is_least_squares_on_the_cell_means_design():
    spread = {2: [-0.2, 0.3], 3: [-0.3, 0.1, 0.25]}  # alike enough for one variance
    cells = {
        (a, L): 0.1 * L + np.array(spread[2 + (L == 8)]) * (1 + (a == "q"))
        for a in "pq"
        for L in (2, 4, 8)
    }
    df = frame(cells)
    m = CellModel(df, ["arch", "n_layer"])
    assert m.pool_of(("p", 2)).scope == "grid"
    keys = list(cells)
    X = np.array([[float((r.arch, r.n_layer) == k) for k in keys] for r in df.itertuples()])
    y = df["value"].to_numpy()
    beta, rss, *_ = np.linalg.lstsq(X, y, rcond=None)
    sigma2 = float(rss[0]) / (len(y) - len(keys))
    c = np.zeros(len(keys))
    c[keys.index(("p", 8))], c[keys.index(("q", 2))] = 1.0, -1.0
    se = math.sqrt(sigma2 * c @ np.linalg.inv(X.T @ X) @ c)
    test = m.difference(("p", 8), ("q", 2))
    assert test.estimate == pytest.approx(c @ beta) and test.se == pytest.approx(se)
    assert test.df == len(y) - len(keys)  # 14 runs, 6 cells: 8 df, not 1 or 2
    assert test.p == pytest.approx(2 * sps.t.sf(abs(c @ beta) / se, len(y) - len(keys)))


def test_the_depth_slope_is_linregress_over_every_run_with_the_pooled_variance():
    cells = {
        ("x", L): RNG.normal(4.0 - 0.1 * math.log2(L), 0.1, n) for L, n in ((2, 2), (4, 3), (8, 2))
    }
    cells |= {("y", L): RNG.normal(4.0, 0.1, 2) for L in (2, 4, 8)}
    m = CellModel(frame(cells), ["arch", "n_layer"])
    test = m.slope({("x", L): math.log2(L) for L in (2, 4, 8)})
    x = np.concatenate([[math.log2(L)] * len(cells["x", L]) for L in (2, 4, 8)])
    y = np.concatenate([cells["x", L] for L in (2, 4, 8)])
    assert test.estimate == pytest.approx(sps.linregress(x, y).slope)
    within = sum(((v - v.mean()) ** 2).sum() for v in cells.values()) / (13 - 6)
    assert test.se == pytest.approx(math.sqrt(within / ((x - x.mean()) ** 2).sum()))
    assert test.df == pytest.approx(7)  # a float (pooled degrees of freedom): 7 up to rounding


def test_an_architecture_with_enough_degrees_of_freedom_keeps_its_own_variance():
    rich = {("big", L): np.array([-1.0, 0.5, 0.0, 1.0, -0.5]) + L for L in (1, 2, 3)}  # 12 df
    poor = {("small", L): np.array([0.6, -0.6]) for L in (1, 2)}  # 2 df: the grid's
    assert 12 >= MIN_GROUP_DF > 2
    m = CellModel(frame(rich | poor), ["arch", "n_layer"])
    assert m.pool_of(("big", 1)).bartlett_p > 0.05  # one variance fits them all
    big, small = m.pool_of(("big", 1)), m.pool_of(("small", 1))
    assert (big.scope, big.df, small.scope, small.df) == ("architecture", 12, "grid", 14)
    own = np.mean([v.var(ddof=1) for v in rich.values()])
    assert big.variance == pytest.approx(own)
    test = m.difference(("big", 1), ("small", 1))
    va, vb = big.variance / 5, small.variance / 2  # Welch-Satterthwaite, written out
    assert test.df == pytest.approx((va + vb) ** 2 / (va**2 / 12 + vb**2 / 14))
    assert "Bartlett p = " in m.pool_text() and "big: " in m.pool_text()


def test_bounded_intervals_stay_in_range_and_agreeing_seeds_say_so():
    shares = {("hc", 8): [1.0, 1.0], ("pre_ln", 8): [0.02, 0.3], ("lns", 8): [0.5, 0.9]}
    m = CellModel(frame(shares), ["arch", "n_layer"], bounds=(0.0, 1.0))
    for key in shares:
        e = m[key]
        assert 0.0 <= e.low <= e.value <= e.high <= 1.0, (key, e)
    assert m["hc", 8].identical and m["hc", 8].high == 1.0 and m["hc", 8].low < 1.0
    assert "identical in all 2 seeds" in m["hc", 8].text()
    d = m.difference(("hc", 8), ("pre_ln", 8))
    assert -1.0 <= d.low <= d.high <= 1.0
    counts = CellModel(
        pd.DataFrame({"n_layer": [2, 2, 8, 8], "value": [0.0, 1.0, 8.0, 7.0]}),
        ["n_layer"],
        bounds=lambda L: (0.0, float(L)),
    )
    assert counts[2].low >= 0 and counts[2].high <= 2 and counts[8].high <= 8
    assert counts.pool_of(2).scope == "grid"  # no architecture column: one group


def test_without_seed_variance_the_runs_own_intervals_or_else_an_exact_comparison():
    same = CellModel(frame({("a", 2): [1.0, 1.0], ("a", 4): [2.0, 2.0]}), ["arch", "n_layer"])
    exact = same.difference(("a", 2), ("a", 4))  # seeds never differ: the t test's limit
    assert (exact.estimate, exact.p, exact.low, exact.high) == (-1.0, 0.0, -1.0, -1.0)
    assert exact.text() == "-1 (exact: identical in every seed)"
    assert not same["a", 2].has_interval and "identical in all 2 seeds" in same["a", 2].text()
    tied = frame({("a", 2): [1.0, 1.0], ("a", 4): [2.0, 2.0]}).assign(ci_low=0.9, ci_high=1.1)
    z = CellModel(tied, ["arch", "n_layer"]).difference(("a", 2), ("a", 4))
    assert z.df == math.inf and z.method == "z test, runs' bootstrap (seeds identical)"
    one = pd.DataFrame({"arch": ["a", "b"], "value": [1.0, 1.2]})
    assert not CellModel(one, ["arch"]).difference("a", "b").tested
    boot = one.assign(ci_low=[0.9, 1.15], ci_high=[1.1, 1.25])
    test = CellModel(boot, ["arch"]).difference("a", "b")
    se = math.hypot(0.2, 0.1) / (2 * sps.norm.ppf(0.975))
    assert test.df == math.inf and test.se == pytest.approx(se)
    assert test.p == pytest.approx(2 * sps.norm.sf(0.2 / se))


def test_lr_choice_variance_is_the_penalty_variance_of_a_noisy_choice():
    sd, gap = 0.1, 0.1
    wrong = sps.norm.cdf(-gap / (sd * math.sqrt(2)))  # P(the worse of two LRs looks better)
    got = lr_choice_variance(np.array([4.0, 4.0 + gap]), np.array([1.0, 1.0]), sd)
    assert got == pytest.approx(gap**2 * wrong * (1 - wrong), rel=0.2)
    assert lr_choice_variance(np.array([4.0, 5.0]), np.array([1.0, 1.0]), sd) == 0.0  # clear
    assert lr_choice_variance(np.array([4.0]), np.array([1.0]), sd) == 0.0  # no choice
    extra = CellModel(frame({("a", 2): [1.0, 1.2], ("a", 4): [1.1, 1.3]}), ["arch", "n_layer"])
    base = extra.difference(("a", 2), ("a", 4)).se
    extra.extra[("a", 2)] = 0.01
    assert extra.difference(("a", 2), ("a", 4)).se == pytest.approx(math.sqrt(base**2 + 0.01))


def test_when_bartlett_rejects_one_variance_each_architecture_keeps_its_own():
    noisy = {("noisy", L): np.array([-1.0, 1.0]) + L for L in (1, 2, 3)}
    quiet = {("quiet", L): np.array([-0.01, 0.01]) + L for L in (1, 2, 3)}
    m = CellModel(frame(noisy | quiet), ["arch", "n_layer"])
    every = sps.bartlett(*(noisy | quiet).values()).pvalue
    assert every < 0.05
    assert (
        m.pool_of(("quiet", 1)).variance == pytest.approx(2e-4) and m.pool_of(("quiet", 1)).df == 3
    )
    assert m.pool_of(("noisy", 1)).variance == pytest.approx(2.0)
    assert m.pool_text().startswith(f"per architecture (Bartlett p = {every:.2g} rejects")


def test_cells_left_out_of_the_pool_take_the_pooled_cells_variance():
    """best_loss pools only the cells that learned; one that did not still gets an interval."""
    cells = {("a", 2): [1.0, 1.2], ("a", 4): [2.0, 2.2], ("flat", 2): [5.3, 5.3]}
    m = CellModel(frame(cells), ["arch", "n_layer"], pool_cells={("a", 2), ("a", 4)})
    assert m.pool_of(("flat", 2)).variance == pytest.approx(0.02) and m.pool_of(("flat", 2)).df == 2
    assert m["flat", 2].has_interval
