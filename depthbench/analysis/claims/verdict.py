"""Verdicts of the claims of the source papers, and the registry of the functions that reach them.

A verdict is one of four outcomes, the `verdict` column of results/tables/claims.parquet:

- "holds": our numbers go the paper's direction and their 95% intervals separate;
- "contradicted": they go the opposite direction and their intervals separate;
- "inconclusive at this scale": the intervals overlap, or a number has no interval (one seed,
  and the table holds no bootstrap interval for it);
- "not testable in this grid: <what it lacks>": the grid lacks what the claim compares (an
  architecture, a probe, a stage, or a second shape, depth or architecture to compare with).

A claim function compares Estimates (depthbench.analysis.intervals: a value, its 95% interval
and the n seeds behind it) in one or more Steps, each stating the paper's direction between two
of them, and `judge` decides from all the steps with `separated`: the claim is contradicted if
some step separates the opposite way, holds if every strict step separates the paper's way,
and is inconclusive otherwise. A non-strict step states an absence ("Pre-LN's loss does not
fall"): it contradicts the claim when it separates the opposite way and never needs to
separate. Each claim's docstring gives its steps.

The numbers of a cell (architecture, depth and width, knobs) come from its best-LR runs: with
several seeds the t interval over the seeds' values (intervals.seed_interval); with one, that
run's own bootstrap interval where its table has `ci_low` / `ci_high` (intervals.cell_interval);
otherwise none. A run's number that averages several rows of a table (layers, say) takes the
mean of their bounds as its interval, which is wider than the mean's own interval unless the
rows' errors move together. Analytic numbers (the cost model) are exact: an interval of width
zero and n = 0. A verdict is `single_seed` when some number compared rests on one seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from depthbench.analysis.intervals import Estimate, separated
from depthbench.analysis.readers import INTERVAL
from depthbench.analysis.summaries import cells

HOLDS = "holds"
CONTRADICTED = "contradicted"
INCONCLUSIVE = "inconclusive at this scale"
NOT_TESTABLE = "not testable in this grid"
OUTCOMES = (HOLDS, CONTRADICTED, INCONCLUSIVE, NOT_TESTABLE)


def not_testable(lacks: str) -> str:
    return f"{NOT_TESTABLE}: {lacks}"


@dataclass(frozen=True)
class Step:
    """One comparison: the paper has `a` (named `lhs`) above `b` (`rhs`) when `expect` is +1,
    below when -1."""

    lhs: str
    a: Estimate
    rhs: str
    b: Estimate
    expect: int
    strict: bool = True

    @property
    def seen(self) -> int:
        """+1: separated the paper's way; -1: separated the opposite way; 0: not separated."""
        return separated(self.a, self.b) * self.expect


def decide(steps) -> str:
    """The verdict of a claim made of `steps` (the module docstring's rule)."""
    steps = list(steps)
    if any(s.seen < 0 for s in steps):
        return CONTRADICTED
    strict = [s for s in steps if s.strict]
    return HOLDS if strict and all(s.seen > 0 for s in strict) else INCONCLUSIVE


def text(e: Estimate) -> str:
    """An estimate as the claims table prints it: value [low, high] (n=seeds)."""
    if e.n == 0 and e.low == e.high == e.value:
        return f"{e.value:.4g} (exact)"
    return e.text(4)


@dataclass(frozen=True)
class Result:
    """A claim's outcome: its verdict, the steps that decided it, a short summary of our
    numbers (`ours`) and a note."""

    verdict: str
    steps: tuple[Step, ...] = ()
    ours: str = ""
    note: str = ""

    @property
    def estimates(self) -> dict[str, Estimate]:
        """Every number compared, by label, in the order the steps name them."""
        out: dict[str, Estimate] = {}
        for s in self.steps:
            out.setdefault(s.lhs, s.a)
            out.setdefault(s.rhs, s.b)
        return out

    @property
    def decisive(self) -> Step | None:
        """The step the verdict turns on: the first that separates the opposite way, else the
        first strict step that does not separate, else the first step."""
        for test in (lambda s: s.seen < 0, lambda s: s.strict and s.seen == 0, lambda s: True):
            found = [s for s in self.steps if test(s)]
            if found:
                return found[0]
        return None

    @property
    def single_seed(self) -> bool:
        return any(e.n == 1 for e in self.estimates.values())

    def estimates_text(self) -> str:
        return "; ".join(f"{label} {text(e)}" for label, e in self.estimates.items())


def judge(steps, ours: str = "", note: str = "") -> Result:
    steps = tuple(steps)
    if not steps:
        raise ValueError("a claim with nothing to compare is not testable: return untestable()")
    return Result(decide(steps), steps, ours, note)


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
    if df.empty or not {"arch", "knobs"} <= set(df.columns):
        return df
    chosen = {
        arch: "{}" if "{}" in set(g["knobs"]) else sorted(g["knobs"].astype(str))[0]
        for arch, g in df.groupby("arch")
    }
    return df[df["knobs"] == df["arch"].map(chosen)]


def _mean_or_nan(s: pd.Series) -> float:
    return float(s.mean()) if s.notna().all() else np.nan


def cell_estimates(df: pd.DataFrame, keys: list[str], value: str = "value") -> dict:
    """{key: Estimate} per group of `keys` (a tuple key for several, the value for one): one
    number per run (the mean of its rows, and of their ci_low / ci_high where present), then the
    cell over the runs as the figures combine it (summaries.cells: intervals.cell_interval)."""
    if df.empty:
        return {}
    bounds = [c for c in INTERVAL if c in df.columns]
    agg = {value: (value, "mean"), **{c: (c, _mean_or_nan) for c in bounds}}
    per_run = df.groupby([*keys, "run_id"], as_index=False, dropna=False).agg(**agg)
    table = cells(per_run, keys, value, bounds=INTERVAL, carry=())  # the figures' cells too
    return {
        (row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)): Estimate(
            row["value"], row["ci_low"], row["ci_high"], int(row["n"])
        )
        for row in table.to_dict("records")
    }


def by_depth(df: pd.DataFrame, arch: str, value: str = "value") -> dict[int, Estimate]:
    """{n_layer: Estimate} of one architecture's rows, shallow to deep."""
    rows = df[df["arch"] == arch] if "arch" in df.columns else df.iloc[0:0]
    return {int(L): e for L, e in cell_estimates(rows, ["n_layer"], value).items()}


def lacking(found: dict[str, dict], needs: int, where: str, hint: str = "") -> str | None:
    """What a claim over `found` ({arch: {depth: Estimate}}) lacks for `needs` depths of each
    architecture, or None; `hint` says why an architecture may be missing."""
    missing = [a for a, d in found.items() if not d]
    if missing:
        return f"no {'/'.join(missing)} in {where}{hint}"
    few = [f"{a} at {len(d)}" for a, d in found.items() if len(d) < needs]
    return f"{', '.join(few)} depth(s) in {where}, needs {needs}" if few else None
