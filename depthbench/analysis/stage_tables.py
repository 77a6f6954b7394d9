"""The tables of the stages that read a run's weights (probes, the logit lens, layer removal,
NLL, cost): each stage's per-run files joined with the runs' config columns and the best-LR
flag. The runs' own tables (runs, curves, best LR, dynamics) are depthbench.analysis.tables."""

from __future__ import annotations

from typing import Iterable

import pandas as pd

from depthbench.analysis.summaries import NLL_INTERVAL_COLUMNS, with_interval_columns
from depthbench.analysis.tables import RUN_CONFIG_COLUMNS
from depthbench.util.errors import DataError
from depthbench.train.runcheck import read_summary


def with_run_columns(rows: pd.DataFrame, runs: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    out = rows.drop(columns=["status"], errors="ignore").merge(
        runs[RUN_CONFIG_COLUMNS], on="run_id", how="left"
    )
    keys = best[["arch", "n_layer", "d_model", "knobs", "best_lr"]]
    out = out.merge(keys, on=["arch", "n_layer", "d_model", "knobs"], how="left")
    # a pretrained run is its model's only recipe: it stands for its model as the best LR does
    out["is_best_lr"] = (out["lr"] == out["best_lr"]) | (out["status"] == "pretrained")
    return out.drop(columns=["best_lr"])


def probe_rows(probe_paths: Iterable[str], runs: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """All runs' tidy probe rows with the runs' config columns and an `is_best_lr` flag.

    `step`: updates of the weights probed (depthbench.probes.run): stage "trained" rows are the
    final model at its last step, "snapshot" rows the probes over training (probes.at_steps);
    <NA> for files written without it (pretrained models, older probe files). `ci_low`,
    `ci_high`: the row's 95% bootstrap interval over the probe sequences (depthbench.probes.run),
    NaN where the row has none or its file was written without intervals."""
    frames = [pd.read_parquet(p) for p in probe_paths]
    probes = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["run_id", "probe", "stage", "i", "j", "value"])
    )
    probes = with_interval_columns(probes, ("ci_low", "ci_high"))
    probes["step"] = (
        probes["step"] if "step" in probes.columns else pd.Series(pd.NA, index=probes.index)
    ).astype("Int64")
    return with_run_columns(probes, runs, best)


LENS_PROBES = {
    "lens_cross_entropy": "cross_entropy",
    "lens_kl_to_final": "kl_to_final",
    "lens_top1_agreement": "top1_agreement",
}


def lens_table(probes: pd.DataFrame) -> pd.DataFrame:
    """The logit lens (depthbench.probes.lens) of every probed model, one row per (run, layer):
    cross_entropy, kl_to_final and top1_agreement beside the run's config columns, from the
    trained probe rows (the merged probes table)."""
    rows = probes[probes["probe"].isin(LENS_PROBES) & (probes["stage"] == "trained")]
    keys = [c for c in rows.columns if c not in ("probe", "i", "j", "value", "stage")]
    if rows.empty:
        return pd.DataFrame(columns=[*keys, "layer", *LENS_PROBES.values()])
    # pivoted on (run, layer) alone, the run's columns joined after: a pivot over every config
    # column would form their product
    wide = (
        rows.assign(layer=rows["i"])
        .pivot(index=["run_id", "layer"], columns="probe", values="value")
        .reset_index()
    )
    wide = wide.rename(columns=LENS_PROBES)
    wide.columns.name = None
    columns = rows[keys].drop_duplicates("run_id")
    return wide.merge(columns, on="run_id", how="left")[
        [*keys, "layer", *LENS_PROBES.values()]
    ].sort_values(["run_id", "layer"], ignore_index=True)


def removal_tables(
    removal_paths: Iterable[str], runs: pd.DataFrame, best: pd.DataFrame, tolerance: float
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """All runs' removal rows (depthbench.probes.removal_run) and their effective depths per
    ranking, each with the runs' config columns and `is_best_lr`."""
    from depthbench.probes.effective_depth import COLUMNS, effective_depth

    frames = [pd.read_parquet(p) for p in removal_paths]
    removal = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["run_id", *COLUMNS, "status"])
    )
    removal = with_run_columns(removal, runs, best)
    depth = effective_depth(
        removal[["run_id", "ranking", "k", "fraction", "domain", "loss", "full_loss", "n_layer"]],
        tolerance,
    )
    return removal, with_run_columns(depth, runs, best)


def nll_rows(nll_paths: Iterable[str], runs: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """Every run's per-set and per-domain NLL rows with the runs' config columns. `ci_low`,
    `ci_high` (of bits_per_byte) and `nats_per_token_ci_low`, `nats_per_token_ci_high`: the 95%
    bootstrap intervals over the row's documents (depthbench.evals.nll), NaN for files written
    without them."""
    frames = [pd.read_parquet(p) for p in nll_paths]
    columns = ["run_id", "level", "set", "domain", "nats_per_token", "bits_per_byte"]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    table = with_interval_columns(table, NLL_INTERVAL_COLUMNS)
    return with_run_columns(table, runs, best)  # config columns also when there are no rows


def cost_rows(
    summary_paths: Iterable[str],
    runs: pd.DataFrame,
    best: pd.DataFrame,
    expected: dict[str, str] | None = None,
    pretrained_paths: Iterable[str] = (),
    seq_len: int | None = None,
) -> pd.DataFrame:
    """One row per run: analytic parameters, FLOPs and KV-cache bytes, and the measured cost;
    pretrained models (their summaries in `pretrained_paths`) with the analytic columns only, at
    the grid's training sequence length `seq_len`."""
    from depthbench.spec.run import RunSpec
    from depthbench.models.cost import analytic_cost, measured_cost, pretrained_cost
    from depthbench.pretrained.stages import read_summary as read_pretrained_summary

    rows = []
    for path in summary_paths:
        s = read_summary(path, expected)
        spec = RunSpec.from_dict(s["spec"])
        rows.append(
            {
                "run_id": s["run_id"],
                **analytic_cost(spec.model, spec.train.seq_len),
                **measured_cost(s),
            }
        )
    for path in pretrained_paths:
        s = read_pretrained_summary(path)
        if "matmul_params" not in s:  # written before the cost fields: say which file to redo
            raise DataError(
                f"{path} has no cost fields (matmul_params): "
                "delete it, and the pretrained_summary rule writes it again"
            )
        rows.append({"run_id": s["run_id"], **pretrained_cost(s, seq_len or s["context_length"])})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    return with_run_columns(
        out.drop(columns=["tokens_per_s", "wall_seconds", "device"]).merge(
            runs[["run_id", "tokens_per_s", "wall_seconds", "device"]], on="run_id"
        ),
        runs,
        best,
    )
