"""Claims on the training dynamics (results/tables/dynamics.parquet): the residual RMS of Pre-LN
and LNS (i), the collapse signature of runs that did not learn (k), and the residual variance
of GQA and MoE runs (l)."""

from __future__ import annotations

import math

import numpy as np
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
from depthbench.analysis.cell_model import CellModel


def _final_rms(t: dict) -> pd.DataFrame:
    """Residual RMS of h_L at the last dynamics step of each best-LR run (every seed)."""
    dyn = t.get("dynamics", pd.DataFrame())
    chosen = R.best_runs(t.get("runs", pd.DataFrame()), t.get("best_lr", pd.DataFrame()))
    if not R.has(dyn, "quantity") or chosen.empty:
        return pd.DataFrame(columns=["run_id", *R.SHAPE_KEYS, "value"])
    rms = dyn[dyn["quantity"] == "residual_rms"]
    rms = rms[rms["step"] == rms.groupby("run_id")["step"].transform("max")]
    rms = rms[rms["index"] == rms.groupby("run_id")["index"].transform("max")]
    return chosen.merge(rms[["run_id", "value"]], on="run_id")


@claim("i_pre_ln_rms_grows_lns_holds")
def pre_ln_rms_grows_lns_holds(t: dict, s: dict):
    """ln RMS(h_L) at the last dynamics step: Pre-LN's at its deepest depth above its
    shallowest, and LNS's at that deepest depth below Pre-LN's (two strict steps: differences of
    cell means, log ratios of RMS, the seed variance pooled over every architecture's cells).
    On the log scale because the RMS of the architectures spans orders of magnitude (HC's
    streams reach 1e4 where Pre-LN's stay below 1) and a seed's spread grows with it: one
    variance for all fits the logs. Not testable without Pre-LN at two depths and LNS at Pre-LN's
    deepest."""
    rms = default_knobs(_final_rms(t)).astype({"n_layer": int})
    rms = rms.assign(value=np.log(rms["value"].where(rms["value"] > 0)))
    model = cell_model(rms, ["arch", "n_layer"])
    pre = sorted(L for a, L in model if a == "pre_ln")
    if len(pre) < 2 or ("lns", pre[-1]) not in model:
        return untestable(
            "needs dynamics of pre_ln at 2 or more depths and of lns at pre_ln's deepest"
        )
    lo, hi = pre[0], pre[-1]
    steps = [
        diff_step(model, ("pre_ln", hi), ("pre_ln", lo), f"pre_ln L={hi}", f"pre_ln L={lo}", 1),
        diff_step(model, ("lns", hi), ("pre_ln", hi), f"lns L={hi}", f"pre_ln L={hi}", -1),
    ]
    rms_of = {key: math.exp(model[key].value) for key in (("pre_ln", lo), ("pre_ln", hi))}
    ours = (
        f"pre_ln RMS(h_L) {rms_of['pre_ln', lo]:.2f} (L={lo}) -> {rms_of['pre_ln', hi]:.2f} "
        f"(L={hi}); lns {math.exp(model['lns', hi].value):.2f} at L={hi} (geometric means over "
        "seeds; the tests on ln RMS)"
    )
    return judge(steps, ours, variance=model.pool_text())


def _collapsed(t: dict, s: dict) -> tuple[pd.DataFrame, float | None, float]:
    """The finished runs that did not learn and sit at the unigram floor (within the learned
    margin of it, above or below), the floor and the margin."""
    from depthbench.spec.schema import with_defaults

    runs = t.get("runs", pd.DataFrame())
    margin = with_defaults("analysis", s.get("analysis", {}))["learned_margin"]
    floor = R.unigram_floor(runs)
    if floor is None or not R.has(runs, "status", "final_val_loss"):
        return runs.iloc[0:0] if runs is not None else pd.DataFrame(), floor, margin
    near = (runs["final_val_loss"] - floor).abs() <= margin
    return runs[(runs["status"] == "ok") & R.not_learned(runs) & near], floor, margin


@claim("k_collapse_signature", trained=False)
def collapse_signature(t: dict, s: dict):
    """Over the runs that did not learn and sit at the unigram floor (one number per run; a
    one-sample t test over the runs, df = runs - 1): log10 of ||dL/dh_1|| at the last dynamics
    step over the first below -2 (a fall by more than two orders of magnitude), and the smallest
    RMSNorm backward factor below 1 (two strict steps against exact thresholds). Not testable
    without such runs or their dynamics."""
    collapsed, floor, margin = _collapsed(t, s)
    if floor is None:
        return untestable("no runs")
    if collapsed.empty:
        return untestable(
            "no run collapsed to the unigram floor (config/presets/postnorm_collapse.yaml "
            "makes them)"
        )
    dyn = t.get("dynamics", pd.DataFrame())
    d = dyn[dyn["run_id"].isin(set(collapsed["run_id"]))] if R.has(dyn, "quantity") else dyn
    grad = d[(d["quantity"] == "grad_norm_h") & (d["index"] == 1)] if not d.empty else d
    if grad.empty:
        return untestable(f"no dynamics rows for the {len(collapsed)} collapsed run(s)")
    grad = grad.sort_values("step").groupby("run_id")["value"]
    fall = np.log10(grad.last() / grad.first())
    factor = d[d["quantity"] == "norm_factor"].groupby("run_id")["value"].min()
    # the collapsed runs are the units: one cell each, its variance over the runs (df n - 1)
    falls = CellModel(pd.DataFrame({"c": "fall", "value": fall}), ["c"])
    factors = CellModel(pd.DataFrame({"c": "factor", "value": factor}), ["c"], bounds=(0, math.inf))
    if "fall" not in falls or "factor" not in factors:
        return untestable(f"no dynamics rows for the {len(collapsed)} collapsed run(s)")
    n, nf = len(collapsed), factors["factor"]
    steps = [
        Step(
            f"log10 ||dL/dh_1|| last/first over {falls['fall'].n} run(s)",
            falls["fall"],
            "log10 of a 100x fall",
            exact(-2),
            -1,
            test=falls.versus("fall", -2.0),
        ),
        Step(
            f"min norm factor over {nf.n} run(s)",
            nf,
            "unit factor",
            exact(1),
            -1,
            test=factors.versus("factor", 1.0),
        ),  # fmt: skip
    ]
    ours = (
        f"{n} run(s) within {margin:g} nats of the floor {floor:.2f}; ||dL/dh_1|| last/first "
        f"{10 ** falls['fall'].value:.2g}; min norm factor {nf.value:.3g}"
    )
    return judge(steps, ours, variance=f"over the collapsed runs: {falls.pool_text()}")


@claim("l_gqa_moe_lower_variance")
def gqa_moe_lower_variance(t: dict, s: dict):
    """Residual variance RMS(h_L)^2 at the last dynamics step, per architecture and depth: GQA
    runs (n_kv_head < n_head) and MoE runs (model.moe in the knobs) below the MHA, dense runs
    (one strict step per variant, architecture and depth with both: differences of cell means
    of ln RMS^2, log variance ratios, as in (i); the runs of one variant its seeds, the seed
    variance pooled over every cell). Not testable without a variant and its base at a common
    cell."""
    rms, runs = _final_rms(t), t.get("runs", pd.DataFrame())
    if rms.empty or not R.has(runs, "n_kv_head", "n_head"):
        return untestable("no dynamics rows")
    rms = rms.drop(columns=["n_head", "n_kv_head"], errors="ignore").merge(
        runs[["run_id", "n_head", "n_kv_head"]], on="run_id"
    )
    rms["variant"] = np.where(
        rms["knobs"].str.contains("moe"),
        "moe",
        np.where(rms["n_kv_head"] < rms["n_head"], "gqa", "base"),
    )
    found = [v for v in ("gqa", "moe") if v in set(rms["variant"])]
    if not found:
        return untestable(
            "no GQA runs (model.n_kv_head < n_head) and no MoE runs (model.moe) in the grid"
        )
    rms = rms.assign(value=2 * np.log(rms["value"].where(rms["value"] > 0)))
    model = cell_model(rms.astype({"n_layer": int}), ["arch", "n_layer", "variant"])
    steps, parts = [], []
    for v in found:
        cells = sorted((a, L) for a, L, w in model if w == v and (a, L, "base") in model)
        if not cells:
            return untestable(
                f"no MHA/dense run of the same architecture and depth as the {v} runs"
            )
        steps += [
            diff_step(model, (a, L, v), (a, L, "base"), f"{a} L={L} {v}", f"{a} L={L} base", -1)
            for a, L in cells
        ]
        ratio = np.mean(
            [math.exp(model[a, L, v].value - model[a, L, "base"].value) for a, L in cells]
        )
        parts.append(f"{v}/base variance {ratio:.2f}")
    return judge(steps, "; ".join(parts), variance=model.pool_text())
