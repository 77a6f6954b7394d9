"""Every probe of one model on one token sample, as tidy rows (the form depthbench.probes.run
documents): the final model, its initialisation and each snapshot go through `probe_model`.

Each row carries `ci_low` and `ci_high`, its 95% interval from a bootstrap over the sample's
sequences (depthbench.probes.spread; NaN where a row has none), seeded by
settings["bootstrap_seed"]."""

from __future__ import annotations

import math

import numpy as np
import torch

from depthbench.probes import core, interventions, lens, removal, spread
from depthbench.util.resample import resample_counts

NO_BOUNDS = (None, None)


def _rows(probe: str, stage: str, matrix, bounds=NO_BOUNDS) -> list[dict]:
    """One row per defined (non-NaN) entry of a vector (j = -1) or matrix, with its interval
    from `bounds` (two arrays of the matrix's shape; NaN without them)."""
    values = matrix.detach().cpu() if isinstance(matrix, torch.Tensor) else torch.tensor(matrix)
    shape = tuple(values.shape)
    low, high = (
        (np.full(shape, math.nan), np.full(shape, math.nan))
        if bounds[0] is None
        else (np.broadcast_to(bounds[0], shape), np.broadcast_to(bounds[1], shape))
    )
    rows = []
    if values.dim() == 1:
        for i, v in enumerate(values.tolist()):
            if not math.isnan(v):
                rows.append(_row(probe, stage, i, -1, v, low[i], high[i]))
        return rows
    for i in range(shape[0]):
        for j in range(shape[1]):
            v = float(values[i, j])
            if not math.isnan(v):
                rows.append(_row(probe, stage, i, j, v, low[i, j], high[i, j]))
    return rows


def _row(probe: str, stage: str, i: int, j: int, value: float, low, high) -> dict:
    return {
        "probe": probe,
        "stage": stage,
        "i": i,
        "j": j,
        "value": value,
        "ci_low": float(low),
        "ci_high": float(high),
    }


def _scalar(probe: str, stage: str, value: float, bounds=NO_BOUNDS) -> dict:
    low, high = (math.nan, math.nan) if bounds[0] is None else bounds
    return _row(probe, stage, -1, -1, float(value), low, high)


def _per_layer_rows(stage: str, hidden: list[torch.Tensor], counts: np.ndarray) -> list[dict]:
    """Token similarity (with and without position 0) and effective rank at every layer: the
    per-layer curves drawn at init, at init without the prefix-average part, and trained."""
    rows = []
    for probe, skip in (("token_similarity", False), ("token_similarity_no_pos0", True)):
        # (L + 1, N) on the device, read once by spread
        by_seq = torch.stack([core.token_similarity_by_sequence(h, skip) for h in hidden])
        rows += _rows(
            probe,
            stage,
            torch.tensor(core.token_similarity_by_layer(hidden, skip_first=skip)),
            spread.mean_bounds(by_seq, counts),
        )
    ranks = core.effective_rank_by_sequence(hidden)  # effective_rank_by_layer's terms
    rows += _rows(
        "effective_rank",
        stage,
        torch.tensor([sum(r) / len(r) for r in ranks]),
        spread.mean_bounds(ranks, counts),
    )
    return rows


def _rms_rows(stage: str, hidden: list[torch.Tensor], counts: np.ndarray) -> list[dict]:
    """RMS(h_l) at every layer and its growth RMS(h_L) / RMS(h_0)."""
    rms = core.residual_rms(hidden)
    resampled = spread.rms(core.mean_square_by_sequence(hidden), counts)
    return _rows("residual_rms", stage, np.array(rms), spread.bounds(resampled)) + [
        _scalar("rms_growth", stage, rms[-1] / rms[0], spread.bounds(resampled[-1] / resampled[0]))
    ]


def _matrix_probe(
    rows: list[dict],
    name: str,
    stage: str,
    matrix: torch.Tensor,
    threshold: float,
    resampled: np.ndarray,
) -> None:
    """The score matrix and its share above threshold, with intervals from the resampled
    matrices (L + 1, L + 1, B)."""
    rows += _rows(f"{name}_score", stage, matrix, spread.bounds(resampled))
    rows.append(
        _scalar(
            f"{name}_share",
            stage,
            core.share_above(matrix, threshold),
            spread.bounds(spread.shares(resampled, threshold)),
        )
    )


def _late_angular_distance(stage: str, D: torch.Tensor, by_seq: torch.Tensor, counts) -> dict:
    """The mean of d(l, l+1) (last token) over the later half of the pairs, l = L//2 .. L-1."""
    L = D.shape[0] - 1
    late = range(L // 2, L)
    value = float(np.mean([float(D[l, 1]) for l in late]))
    return _scalar(
        "angular_distance_late",
        stage,
        value,
        spread.mean_bounds(by_seq[L // 2 : L, 1].mean(dim=0), counts),
    )


@torch.no_grad()
def probe_model(adapter, idx: torch.Tensor, stage: str, settings: dict, full: bool) -> list[dict]:
    """Every probe that applies to the model (`adapter.probes`) on the sample `idx` (N, T + 1),
    as tidy rows. `full=False` (an initialisation) computes only the cheap per-layer probes."""
    rows: list[dict] = []
    applies = adapter.probes
    inputs = idx[:, :-1]
    counts = resample_counts(idx.shape[0], int(settings["bootstrap_seed"]))
    hidden = core.residual_stream(adapter, inputs)
    rows += _per_layer_rows(stage, hidden, counts) + _rms_rows(stage, hidden, counts)
    if stage == "init" and "prefix_average" in applies:
        with interventions.without_prefix_average(adapter):
            rows += _per_layer_rows(
                "init_no_prefix_avg", core.residual_stream(adapter, inputs), counts
            )
    records = adapter.records(inputs) if applies & {"residual_product_rank", "depth_weight"} else {}
    if "residual_product_rank" in applies:  # at init too: the trained rank means little without it
        mixing = records["stream_mixing"]
        rows.append(
            _scalar(
                "residual_product_rank",
                stage,
                core.residual_product_rank(mixing),
                spread.mean_bounds(core.residual_product_rank_by_sequence(mixing), counts),
            )
        )
    if not full:
        return rows
    for probe, last in (("angular_distance_last", True), ("angular_distance_all", False)):
        D = core.angular_distance(hidden, last_token_only=last)
        by_seq = core.angular_distance_by_sequence(hidden, last_token_only=last)
        rows += _rows(probe, stage, D, spread.mean_bounds(by_seq, counts))
        if last:
            rows.append(_late_angular_distance(stage, D, by_seq, counts))
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
    # max_passes (operational, as threads): the first passes of each family only, None: all
    passes = {"per_sequence": True, "max_passes": settings.get("max_passes")}
    C, A, B = interventions.causal_scores(adapter, inputs, workers, **passes)
    _matrix_probe(
        rows, "causal", stage, C, settings["causal_threshold"], spread.causal(A, B, counts)
    )
    P, S, base = interventions.permutation_scores(adapter, idx, workers, **passes)
    _matrix_probe(
        rows,
        "permutation",
        stage,
        P,
        settings["permutation_threshold"],
        spread.permutation(S, base, counts),
    )
    if "usefulness_ratio" in applies:
        r, R, base = interventions.usefulness_ratios(adapter, idx, workers, **passes)
        resampled = spread.usefulness(R, base, counts)
        threshold = settings["usefulness_threshold"]
        useful = resampled[1:] > threshold  # (L, B): layers 1..L of each resample
        rows += _rows("usefulness_ratio", stage, r, spread.bounds(resampled))
        rows.append(
            _scalar(
                "useful_fraction",
                stage,
                float((r[1:] > threshold).float().mean()),
                spread.bounds(spread.fraction(useful, np.ones_like(useful))),
            )
        )
    if "depth_weight" in applies:
        for s, w in enumerate(core.to_host(records["depth_weights"]), start=1):
            rows += [
                _row("depth_weight", stage, s, i, v, math.nan, math.nan)
                for i, v in enumerate(w.tolist())
            ]
    if "dead_zone_layers" in applies:
        rows += _dead_zone_rows(adapter, inputs, stage, records, settings, counts)
    return rows


def _dead_zone_rows(adapter, inputs, stage, records, settings, counts) -> list[dict]:
    """partial_sum_weight per layer and dead_zone_layers, with intervals from the dead zone of
    each resample: the depth weights are means over the batch, so each sequence's come from a
    pass of its own (N passes, for the architectures with a dead zone only)."""
    threshold = settings["dead_zone_threshold"]
    # adapter.dead_zone reads each layer's weight: handed host copies, made in one read
    length, weights = adapter.dead_zone(core.to_host(records["depth_weights"]), threshold)
    weight_bounds = length_bounds = NO_BOUNDS
    if counts.shape[0]:
        by_seq = [adapter.records(inputs[n : n + 1])["depth_weights"] for n in range(len(inputs))]
        flat = core.to_host([w for seq in by_seq for w in seq])
        by_seq = [flat[n * len(seq) : (n + 1) * len(seq)] for n, seq in enumerate(by_seq)]
        lengths, resampled = spread.dead_zones(adapter, by_seq, threshold, counts)
        nan = np.full((1, counts.shape[0]), math.nan)
        weight_bounds = spread.bounds(np.concatenate([nan, resampled]))
        length_bounds = spread.bounds(lengths)
    return _rows(
        "partial_sum_weight", stage, torch.tensor([float("nan")] + weights), weight_bounds
    ) + [_scalar("dead_zone_layers", stage, length, length_bounds)]
