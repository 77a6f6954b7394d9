"""Verdicts of the claims of the source papers, and the registry of the functions that reach them.

A verdict is one of four outcomes, the `verdict` column of results/tables/claims.parquet:

- "holds": every effect the claim states goes the paper's way, each significant at 5%;
- "contradicted": some effect goes the opposite way, significant at 5% after a Bonferroni
  correction over the claim's effects;
- "inconclusive at this scale": neither (an effect not significant, or without a test: one
  seed and no bootstrap interval, or seeds that never differ);
- "not testable in this grid: <what it lacks>": the grid lacks what the claim compares (an
  architecture, a probe, a stage, or a second shape, depth or architecture to compare with).

A claim function states one or more Steps, each an effect with the direction the paper gives
it: a contrast of cell means (a difference of two cells, or a slope over depths) estimated by a
cell-means model of every run of the quantity with a pooled seed variance
(depthbench.analysis.stats.CellModel), with its 95% interval and two-sided t test. Strict steps
state an effect; a non-strict step states an absence ("Pre-LN's loss does not fall") and can
only contradict. `decide` reaches the verdict from the steps' p-values:

- contradicted when min p over the steps that go the opposite way, times the number of steps,
  is below 5% (Bonferroni: under no effect at all the chance of a false contradiction is at
  most 2.5%);
- otherwise holds when every strict step goes the paper's way with p below 5% (an
  intersection-union test, which needs no correction: its false-holds rate under no effect is
  at most that of one step, 2.5%);
- otherwise inconclusive.

So under no effect a verdict other than inconclusive comes up at most 5% of the time, which
tests/unit/test_verdict_calibration.py checks by simulation. The claim's p-value is that of its
verdict's test (the corrected minimum for a contradiction, else the largest strict p), and its
estimate, interval and degrees of freedom are those of the decisive step: the step that
contradicts, else the strict step with the largest p (the weakest link of "holds").

Each Step also carries the two cells it reads (`a`, `b`: the cells compared, or a slope's
shallowest and deepest) with their pooled intervals, which the table shows. Analytic numbers
(the cost model) are exact: width-zero intervals, n = 0, and an exact comparison (p 0 unless
equal). A verdict is `single_seed` when some cell compared rests on one seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from depthbench.analysis.intervals import Estimate
from depthbench.analysis.readers import INTERVAL
from depthbench.analysis.cell_model import CellModel
from depthbench.analysis.stats import ALPHA, Test, exact_test

HOLDS = "holds"
CONTRADICTED = "contradicted"
INCONCLUSIVE = "inconclusive at this scale"
NOT_TESTABLE = "not testable in this grid"
OUTCOMES = (HOLDS, CONTRADICTED, INCONCLUSIVE, NOT_TESTABLE)


def not_testable(lacks: str) -> str:
    return f"{NOT_TESTABLE}: {lacks}"


@dataclass(frozen=True)
class Step:
    """One effect: `test` (the contrast `effect`, by default lhs - rhs, and its test); the paper
    has it positive when `expect` is +1, negative when -1. `a` (named `lhs`) and `b` (`rhs`)
    are the cells it reads."""

    lhs: str
    a: Estimate
    rhs: str
    b: Estimate
    expect: int
    strict: bool = True
    test: Test | None = None
    effect: str = ""

    @property
    def contrast(self) -> Test:
        if self.test is not None:
            return self.test
        return exact_test(self.a.value - self.b.value)  # exact numbers (n = 0)

    @property
    def label(self) -> str:
        return self.effect or f"{self.lhs} - {self.rhs}"

    @property
    def way(self) -> int:
        """+1: the estimate goes the paper's way; -1: the opposite; 0: zero or NaN."""
        e = self.contrast.estimate
        return int(np.sign(e) * self.expect) if e == e else 0

    @property
    def p(self) -> float:
        p = self.contrast.p
        return p if p == p else 1.0


def diff_step(model: CellModel, a, b, lhs: str, rhs: str, expect: int, strict=True) -> Step:
    """The step "cell a minus cell b has the sign `expect`" on a model's cells."""
    return Step(lhs, model[a], rhs, model[b], expect, strict, model.difference(a, b))


def decide(steps) -> tuple[str, float, int]:
    """(verdict, the claim's p-value, index of the decisive step) by the module docstring's rule."""
    steps = list(steps)
    against = [(s.p, i) for i, s in enumerate(steps) if s.way < 0]
    if against:
        p, i = min(against)
        if min(1.0, p * len(steps)) < ALPHA:
            return CONTRADICTED, min(1.0, p * len(steps)), i
    strict = [(s.p if s.way > 0 else 1.0, i) for i, s in enumerate(steps) if s.strict]
    if not strict:
        return INCONCLUSIVE, 1.0, 0
    p, i = max(strict, key=lambda t: (t[0], -t[1]))
    return (HOLDS if p < ALPHA else INCONCLUSIVE), p, i


def text(e: Estimate) -> str:
    """An estimate as the claims table prints it: value [low, high] (n=seeds)."""
    if e.n == 0 and e.low == e.high == e.value:
        return f"{e.value:.4g} (exact)"
    return e.text(4)


@dataclass(frozen=True)
class Result:
    """A claim's outcome: its verdict, the steps that decided it, its p-value, a short summary of
    our numbers (`ours`) and a note."""

    verdict: str
    steps: tuple[Step, ...] = ()
    ours: str = ""
    note: str = ""
    p: float = math.nan
    decisive_index: int = 0
    variance: str = ""  # the seed variance the tests use (stats.Pool.text)

    @property
    def estimates(self) -> dict[str, Estimate]:
        """Every cell compared, by label, in the order the steps name them."""
        out: dict[str, Estimate] = {}
        for s in self.steps:
            out.setdefault(s.lhs, s.a)
            out.setdefault(s.rhs, s.b)
        return out

    @property
    def decisive(self) -> Step | None:
        return self.steps[self.decisive_index] if self.steps else None

    @property
    def single_seed(self) -> bool:
        return any(e.n == 1 for e in self.estimates.values())

    def estimates_text(self) -> str:
        return "; ".join(f"{label} {text(e)}" for label, e in self.estimates.items())

    def contrasts_text(self) -> str:
        return "; ".join(f"{s.label}: {s.contrast.text(4)}" for s in self.steps)


def judge(steps, ours: str = "", note: str = "", variance: str = "") -> Result:
    steps = tuple(steps)
    if not steps:
        raise ValueError("a claim with nothing to compare is not testable: return untestable()")
    verdict, p, i = decide(steps)
    return Result(verdict, steps, ours, note, p, i, variance)


def untestable(lacks: str, ours: str = "", note: str = "") -> Result:
    return Result(not_testable(lacks), (), ours, note)


# -- registry --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Claim:
    """A registered claim: its id (config/claims.yaml) and function. `trained`: it reads trained
    models, so the cells whose best-LR run did not learn are left out of its tables."""

    id: str
    fn: Callable[[dict, dict], Result]
    trained: bool = True


CLAIMS: dict[str, Claim] = {}  # by id, in registration order


def claim(claim_id: str, trained: bool = True):
    """Register the decorated function fn(tables, settings) -> Result as the claim `claim_id`."""

    def register(fn: Callable[[dict, dict], Result]) -> Callable[[dict, dict], Result]:
        if claim_id in CLAIMS:
            raise ValueError(f"claim {claim_id!r} is registered twice")
        CLAIMS[claim_id] = Claim(claim_id, fn, trained)
        return fn

    return register


# -- the numbers of cells --------------------------------------------------------------------------
def exact(value: float) -> Estimate:
    """An analytic number: no sampling error, no seed behind it."""
    return Estimate(float(value), float(value), float(value), n=0)


def default_knobs(df: pd.DataFrame) -> pd.DataFrame:
    """Per architecture, the rows of its default knobs ("{}"), or of its first knobs (by text)
    where the grid sweeps it without the default: a claim compares one cell per depth."""
    if df.empty or not {"arch", "knobs"} <= set(df.columns) or (df["knobs"] == "{}").all():
        return df
    chosen = {
        arch: "{}" if "{}" in set(g["knobs"]) else sorted(g["knobs"].astype(str))[0]
        for arch, g in df.groupby("arch")
    }
    return df[df["knobs"] == df["arch"].map(chosen)]


def _mean_or_nan(s: pd.Series) -> float:
    return float(s.mean()) if s.notna().all() else np.nan


def per_run(df: pd.DataFrame, keys: list[str], value: str = "value") -> pd.DataFrame:
    """One row per run and group of `keys`: the mean of its rows' `value` (and of their ci_low /
    ci_high where present: a run's number that averages several rows, layers say, takes the
    mean of their bounds as its interval, wider than the mean's own unless the rows' errors
    move together), as `value`."""
    bounds = [c for c in INTERVAL if c in df.columns]
    agg = {"value": (value, "mean"), **{c: (c, _mean_or_nan) for c in bounds}}
    return df.groupby([*keys, "run_id"], as_index=False, dropna=False).agg(**agg)


def cell_model(df: pd.DataFrame, keys: list[str], value: str = "value", bounds=None) -> CellModel:
    """The cell-means model (stats.CellModel) of `df`'s rows, one number per run (`per_run`),
    pooled per architecture or over every cell of `df`."""
    if df.empty:
        return CellModel(pd.DataFrame(columns=[*keys, "value"]), keys, bounds=bounds)
    return CellModel(per_run(df, keys, value), keys, bounds=bounds)


def lacking(found: dict[str, dict], needs: int, where: str, hint: str = "") -> str | None:
    """What a claim over `found` ({arch: {depth: ...}}) lacks for `needs` depths of each
    architecture, or None; `hint` says why an architecture may be missing."""
    missing = [a for a, d in found.items() if not d]
    if missing:
        return f"no {'/'.join(missing)} in {where}{hint}"
    few = [f"{a} at {len(d)}" for a, d in found.items() if len(d) < needs]
    return f"{', '.join(few)} depth(s) in {where}, needs {needs}" if few else None
