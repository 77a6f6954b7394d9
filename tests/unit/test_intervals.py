"""95% intervals (depthbench.analysis.intervals) against their definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from depthbench.analysis.intervals import (
    bootstrap_mean,
    cell_interval,
    seed_interval,
    t_quantile,
)


def student_cdf(x: float, df: int) -> float:
    """Student's t CDF by Simpson's rule on its density (independent of the table)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    n = 20000
    h = x / n
    f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
    return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


@pytest.mark.parametrize("df", [1, 2, 3, 5, 10, 30, 31, 200])
def test_t_quantile_is_students(df):
    assert student_cdf(t_quantile(df), df) == pytest.approx(0.975, abs=2e-5)


def test_t_quantile_at_infinite_df_is_the_normal_one():
    assert 0.5 * (1 + math.erf(t_quantile(math.inf) / math.sqrt(2))) == pytest.approx(0.975)


def test_seed_interval_is_the_t_interval():
    x = np.array([5.1, 5.3, 5.2, 5.6])
    e = seed_interval(x)
    half = 3.182 * x.std(ddof=1) / math.sqrt(len(x))  # t(0.975, 3) from a printed table
    lo, hi = x.mean() - half, x.mean() + half
    assert (e.value, e.n) == (pytest.approx(x.mean()), 4)
    assert e.low == pytest.approx(lo, abs=1e-3) and e.high == pytest.approx(hi, abs=1e-3)


def test_one_seed_has_no_interval_of_its_own():
    e = seed_interval([5.2])
    assert e.n == 1 and not e.has_interval and "no interval" in e.text()


def test_bootstrap_is_seeded_and_covers_the_mean():
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 0.5, size=200)
    a, b = bootstrap_mean(x, seed=3), bootstrap_mean(x, seed=3)
    assert a == b
    assert a.low < x.mean() < a.high
    # the percentile interval of a mean is close to mean +- 1.96 s/sqrt(n)
    half = 1.96 * x.std(ddof=1) / math.sqrt(x.size)
    assert (a.high - a.low) / 2 == pytest.approx(half, rel=0.15)


def test_bootstrap_coverage_is_near_95_percent():
    rng = np.random.default_rng(1)
    covered = 0
    for i in range(200):
        e = bootstrap_mean(rng.normal(0.0, 1.0, 50), seed=i, samples=400)
        covered += e.low < 0.0 < e.high
    assert 0.89 <= covered / 200 <= 0.99


def test_cell_interval_uses_seeds_when_there_are_several_else_the_runs_own():
    several = cell_interval([1.0, 1.2, 1.1], lows=[0.0, 0.0, 0.0], highs=[9.0, 9.0, 9.0])
    assert several == seed_interval([1.0, 1.2, 1.1])
    single = cell_interval([1.0, math.nan], lows=[0.9, math.nan], highs=[1.1, math.nan])
    assert (single.value, single.low, single.high, single.n) == (1.0, 0.9, 1.1, 1)


def test_seeds_that_agree_are_said_to_agree_not_shown_as_an_interval():
    e = seed_interval([1.0, 1.0])
    assert e.identical and e.text() == "1 (n=2, identical in all 2 seeds)"


def test_bootstrap_mean_is_the_percentile_interval_of_seeded_resampled_means():
    """Written apart from the code: B resamples of the values drawn with
    default_rng(seed).integers(0, n, (B, n)), their means, the 2.5% and 97.5% quantiles. The
    stages' tables draw the same way (util.resample), so their intervals and this one agree."""
    x = np.random.default_rng(7).normal(2.0, 0.5, 40)
    draws = np.random.default_rng(11).integers(0, x.size, size=(300, x.size))
    low, high = np.quantile(x[draws].mean(axis=1), [0.025, 0.975])
    got = bootstrap_mean(x, seed=11, samples=300)
    assert got.value == pytest.approx(x.mean(), abs=1e-15)
    assert (got.low, got.high) == pytest.approx((low, high), abs=1e-12)
