"""Every probe of one model on one token sample, as tidy rows (the form depthbench.probes.run
documents): the final model, its initialisation and each snapshot go through `probe_model`."""

from __future__ import annotations

import math

import torch

from depthbench.probes import core, interventions, lens, removal


def _rows(probe: str, stage: str, matrix: torch.Tensor) -> list[dict]:
    rows = []
    if matrix.dim() == 1:
        for i, v in enumerate(matrix.tolist()):
            if not math.isnan(v):
                rows.append({"probe": probe, "stage": stage, "i": i, "j": -1, "value": v})
        return rows
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            v = float(matrix[i, j])
            if not math.isnan(v):
                rows.append({"probe": probe, "stage": stage, "i": i, "j": j, "value": v})
    return rows


def _scalar(probe: str, stage: str, value: float) -> dict:
    return {"probe": probe, "stage": stage, "i": -1, "j": -1, "value": float(value)}


def _per_layer_rows(stage: str, hidden: list[torch.Tensor]) -> list[dict]:
    """Token similarity (with and without position 0) and effective rank at every layer: the
    per-layer curves drawn at init, at init without the prefix-average part, and trained."""
    return (
        _rows("token_similarity", stage, torch.tensor(core.token_similarity_by_layer(hidden)))
        + _rows(
            "token_similarity_no_pos0",
            stage,
            torch.tensor(core.token_similarity_by_layer(hidden, skip_first=True)),
        )
        + _rows("effective_rank", stage, torch.tensor(core.effective_rank_by_layer(hidden)))
    )


def _matrix_probe(
    rows: list[dict], name: str, stage: str, matrix: torch.Tensor, threshold: float
) -> None:
    rows += _rows(f"{name}_score", stage, matrix)
    rows.append(_scalar(f"{name}_share", stage, core.share_above(matrix, threshold)))


@torch.no_grad()
def probe_model(adapter, idx: torch.Tensor, stage: str, settings: dict, full: bool) -> list[dict]:
    """Every probe that applies to the model (`adapter.probes`) on the sample `idx` (N, T + 1),
    as tidy rows. `full=False` (an initialisation) computes only the cheap per-layer probes."""
    rows: list[dict] = []
    applies = adapter.probes
    inputs = idx[:, :-1]
    hidden = core.residual_stream(adapter, inputs)
    rows += _per_layer_rows(stage, hidden)
    if stage == "init" and "prefix_average" in applies:
        with interventions.without_prefix_average(adapter):
            rows += _per_layer_rows("init_no_prefix_avg", core.residual_stream(adapter, inputs))
    records = adapter.records(inputs) if applies & {"residual_product_rank", "depth_weight"} else {}
    if "residual_product_rank" in applies:  # at init too: the trained rank means little without it
        rows.append(
            _scalar(
                "residual_product_rank", stage, core.residual_product_rank(records["stream_mixing"])
            )
        )
    if not full:
        return rows
    rows += _rows(
        "angular_distance_last", stage, core.angular_distance(hidden, last_token_only=True)
    )
    rows += _rows(
        "angular_distance_all", stage, core.angular_distance(hidden, last_token_only=False)
    )
    # ShortGPT's block influence BI_l = 1 - mean cos(h_(l-1), h_l), one of the removal rankings
    rows += _rows(
        "block_influence",
        stage,
        torch.tensor([float("nan")] + removal.block_influence(hidden).tolist()),
    )
    if "logit_lens" in applies:
        for name, per_layer in lens.logit_lens(adapter, idx).items():
            rows += _rows(name, stage, per_layer)
    workers = int(settings["threads"])  # the passes of one probe are shared among that many workers
    _matrix_probe(
        rows,
        "causal",
        stage,
        interventions.causal_scores(adapter, inputs, workers),
        settings["causal_threshold"],
    )
    _matrix_probe(
        rows,
        "permutation",
        stage,
        interventions.permutation_scores(adapter, idx, workers),
        settings["permutation_threshold"],
    )
    if "usefulness_ratio" in applies:
        r = interventions.usefulness_ratios(adapter, idx, workers)
        rows += _rows("usefulness_ratio", stage, r)
        rows.append(
            _scalar(
                "useful_fraction",
                stage,
                float((r[1:] > settings["usefulness_threshold"]).float().mean()),
            )
        )
    if "depth_weight" in applies:
        for s, w in enumerate(records["depth_weights"], start=1):
            rows += [
                {"probe": "depth_weight", "stage": stage, "i": s, "j": i, "value": v}
                for i, v in enumerate(w.tolist())
            ]
    if "dead_zone_layers" in applies:
        length, weights = adapter.dead_zone(
            records["depth_weights"], settings["dead_zone_threshold"]
        )
        rows += _rows("partial_sum_weight", stage, torch.tensor([float("nan")] + weights))
        rows.append(_scalar("dead_zone_layers", stage, length))
    return rows
