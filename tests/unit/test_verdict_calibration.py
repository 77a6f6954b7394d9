"""The verdict machinery calibrated by simulation: synthetic grids in the shape of the default
(6 architectures x 3 depths x 3 learning rates, the sweep at seed 0 and a second seed at each
cell's best LR, chosen on seed 0), with the default's seed noise, go through the whole chain
(best_learning_rates, the claims' cell-means model, the verdict) under a null and under planted
effects of known size.

- Null (no depth effect, no architecture difference): a verdict other than inconclusive (a false
  holds or contradiction) at most 5% of the time, plus twice the simulation's standard error.
- A planted effect of 2 pooled seed standard deviations: the depth claim (2 sigma per doubling
  of L for HC and Full AttnRes) holds at least 80% of the time; a difference of two cells at one
  depth (2 sigma, two seeds each) is found more often than the t test of those two cells alone
  finds it (about 0.2). Without the pooling (each cell's variance from its own two seeds) both
  power checks fail.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from depthbench.analysis.claims.depth import depth_verdict, loss_model
from depthbench.analysis.claims.verdict import CONTRADICTED, HOLDS, decide, diff_step
from depthbench.analysis.stats import ALPHA
from depthbench.analysis.tables import best_learning_rates

ARCHS = ("pre_ln", "lns", "hc", "mhc", "attnres_full", "attnres_block")
DEPTHS = (2, 4, 8)
LRS = (2e-3, 5e-3, 1.25e-2)  # the default's spacing, a factor 2.5
# The default grid's noise (docs/design/budget.md, "The verdicts' calibration"): the seed
# standard deviation of the best-LR validation loss pooled over its 18 cells, and the loss's rise
# over its optimum, RISE (k - k_opt)^2 nats at LR k (in steps of the grid), each cell's optimum
# k_opt drawn within half a step of the middle LR.
SIGMA = 0.107
RISE = 0.2
NULL_GRIDS, POWER_GRIDS = 250, 100
CELLS = [(a, L, d) for a in ARCHS for L, d in zip(DEPTHS, (160, 112, 80))]


def simulate(rng: np.random.Generator, mean, grids: int) -> list[dict]:
    """`grids` grids' runs and best_lr: each cell's loss mean(arch, L) at its optimum, its rise
    away from it, plus N(0, SIGMA) per run; the sweep at seed 0, seed 1 at the LR seed 0 chose."""
    k = np.arange(len(LRS)) - 1.0
    opt = rng.uniform(-0.5, 0.5, size=(grids, len(CELLS), 1))
    loss = np.array([mean(a, L) for a, L, _ in CELLS])[None, :, None] + RISE * (k - opt) ** 2
    seed0 = loss + rng.normal(0.0, SIGMA, size=loss.shape)
    chosen = seed0.argmin(axis=2)
    seed1 = np.take_along_axis(loss, chosen[..., None], 2)[..., 0]
    seed1 = seed1 + rng.normal(0.0, SIGMA, size=seed1.shape)
    rows = []
    for g in range(grids):
        for c, (arch, L, d) in enumerate(CELLS):
            base = (f"sim{g}", arch, L, d, "{}", d / L, 2.6e5, "ok", True)
            for j, lr in enumerate(LRS):
                rows.append((*base, f"{arch}_L{L}_lr{lr:g}_s0", lr, 0, seed0[g, c, j]))
            lr = LRS[chosen[g, c]]
            rows.append((*base, f"{arch}_L{L}_lr{lr:g}_s1", lr, 1, seed1[g, c]))
    columns = ["experiment", "arch", "n_layer", "d_model", "knobs", "ratio", "params", "status"]
    columns += ["learned", "run_id", "lr", "seed", "final_val_loss"]
    runs = pd.DataFrame(rows, columns=columns)
    best = best_learning_rates(runs, [0], intervals=False)  # one call: a grid is an experiment
    return [
        {"runs": r.drop(columns="experiment"), "best_lr": best[best["experiment"] == e]}
        for e, r in runs.groupby("experiment", sort=False)
    ]


def verdicts(tables: dict) -> tuple[str, str]:
    """The depth claim's verdict, and that of "lns differs from mhc at L = 8" (the difference of
    their cells on the claims' loss model, as the claims on probes and NLL compare cells)."""
    model = loss_model(tables)  # what CLAIMS[DEPTH_CLAIM] reads
    depth = depth_verdict(model).verdict
    pair = decide([diff_step(model, ("lns", 8), ("mhc", 8), "lns", "mhc", 1)])[0]
    return depth, pair


def rates(grids: int, seed: int, mean) -> np.ndarray:
    """Per check (depth claim, pair): the fraction of grids that held, and that contradicted."""
    seen = np.array([verdicts(t) for t in simulate(np.random.default_rng(seed), mean, grids)])
    return np.array([[np.mean(seen[:, j] == v) for v in (HOLDS, CONTRADICTED)] for j in (0, 1)])


def error(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


@pytest.fixture(scope="module")
def null():
    return rates(NULL_GRIDS, 1, lambda arch, L: 4.5)


def test_false_positive_rate_on_null_grids_is_at_most_five_percent(null):
    ceiling = ALPHA + 2 * error(ALPHA, NULL_GRIDS)
    depth, pair = null.sum(axis=1)  # holds or contradicted, when nothing differs
    assert depth <= ceiling and pair <= ceiling, (null, ceiling)


def planted(arch: str, L: int) -> float:
    """Effects of 2 pooled seed SDs: HC's and Full AttnRes's loss falls by 2 sigma per doubling
    of L (Pre-LN's is flat), and LNS at L = 8 sits 2 sigma above mHC."""
    slope = -2 * SIGMA if arch in ("hc", "attnres_full") else 0.0
    return 4.5 + slope * math.log2(L) + (2 * SIGMA if (arch, L) == ("lns", 8) else 0.0)


def test_power_on_planted_effects_of_two_pooled_standard_deviations():
    got = rates(POWER_GRIDS, 2, planted)
    depth, pair = got[:, 0]
    assert depth >= 0.8, got
    # a 2-sigma difference of two 2-seed cells: more often found than by the t test on those
    # two cells alone (2 df), whose exact power is the noncentral t's (scipy.stats.nct)
    crit = stats.t.ppf(1 - ALPHA / 2, 2)
    alone = stats.nct.sf(crit, 2, 2 / math.sqrt(1 / 2 + 1 / 2))
    assert pair > alone, (got, alone)


if __name__ == "__main__":  # the rates on more grids, as docs/design/budget.md quotes them
    for name, mean, grids in (("null", lambda arch, L: 4.5, 2000), ("planted", planted, 1000)):
        held, contradicted = rates(grids, 3, mean).T
        for check, h, c in zip(("depth claim (a)", "lns - mhc at L=8"), held, contradicted):
            print(f"{name} {check}: holds {h:.3f}, contradicted {c:.3f} over {grids} grids")
