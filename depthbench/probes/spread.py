"""95% intervals of the probe rows: a seeded bootstrap over the sequences of the probe sample.

Every probe row is a number of the whole sample, and every sequence has the same T tokens, so
each is a function of per-sequence means (depthbench.probes.core's `*_by_sequence`, the
`per_sequence` parts of depthbench.probes.interventions):
- a mean over sequences: angular distance, token similarity, effective rank, residual-product
  rank, the mean late-layer angular distance;
- a ratio of two such means: the causal score C[s, l] = mean A / mean B, the permutation score
  |mean S - mean b| / mean b, the usefulness ratio mean R / mean b, RMS(h_l) = sqrt(mean of the
  mean squares) and RMS growth RMS(h_L) / RMS(h_0);
- a function of those: the shares above threshold (core.share_above), the useful fraction, the
  dead-zone length (the architecture's own dead_zone on the resampled depth weights).
A resample of the sequences (depthbench.util.resample) recomputes each of them exactly from the
per-sequence means, without another forward pass; the row's interval is the percentile interval
of the resampled values. All rows of a model share the same resamples, drawn from the seed the
probe stage derives from the run's seed, so a probe table is the same bit for bit on a rerun.

What the resampling holds fixed: the model, and usefulness's affine fits, which are fitted once
on the whole sample (refitting them per resample would take B times the probe's passes), so the
usefulness interval is conditional on the fits. Rows without an interval (NaN bounds): the
logit lens, block influence and the depth-weight matrix, none of which a figure or claim
compares between models.
"""

from __future__ import annotations

import numpy as np
import torch

from depthbench.probes.core import last_quarters
from depthbench.util.resample import percentile_interval, resampled_sums

Bounds = tuple[np.ndarray, np.ndarray]


def _array(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def means(per_sequence, counts: np.ndarray) -> np.ndarray:
    """(..., B): the mean over the sequences of each resample, of values (..., N)."""
    return resampled_sums(_array(per_sequence), counts) / counts.shape[1]


def bounds(resampled) -> Bounds:
    """The percentile interval of resampled values (..., B) -> two arrays (...)."""
    return percentile_interval(resampled, axis=-1)


def mean_bounds(per_sequence, counts: np.ndarray) -> Bounds:
    return bounds(means(per_sequence, counts))


def causal(A, B, counts: np.ndarray) -> np.ndarray:
    """Resampled causal scores (L + 1, L + 1, B): mean A[s, l] / mean B[l] on each resample."""
    return means(A, counts) / means(B, counts)[None]


def permutation(S, base, counts: np.ndarray) -> np.ndarray:
    """Resampled permutation scores (L + 1, L + 1, B): |mean S - mean b| / mean b."""
    b = means(base, counts)
    return np.abs(means(S, counts) - b) / b


def usefulness(R, base, counts: np.ndarray) -> np.ndarray:
    """Resampled usefulness ratios (L + 1, B): mean R[l] / mean b."""
    return means(R, counts) / means(base, counts)


def rms(mean_squares, counts: np.ndarray) -> np.ndarray:
    """Resampled RMS(h_l) (L + 1, B) from each sequence's mean square of h_l (L + 1, N)."""
    return np.sqrt(means(mean_squares, counts))


def shares(resampled: np.ndarray, threshold: float) -> np.ndarray:
    """core.share_above of each resampled matrix (L + 1, L + 1, B) -> (B,): the fraction of
    the defined pairs with both layers in the last 3/4 of depth (core.last_quarters) whose
    score exceeds `threshold`; NaN for a resample with no defined pair."""
    layers = list(last_quarters(resampled.shape[0] - 1))
    values = resampled[np.ix_(layers, layers)].reshape(len(layers) ** 2, -1)
    defined = ~np.isnan(values)
    return fraction(defined & (values > threshold), defined)


def fraction(hits: np.ndarray, defined: np.ndarray) -> np.ndarray:
    """hits / defined counted over axis 0, in float32 as the probes' own fractions are (a mean
    of a float32 mask), so that a fraction and its resampled values are the same numbers."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = hits.sum(axis=0).astype(np.float32) / defined.sum(axis=0).astype(np.float32)
    return ratio.astype(np.float64)


def dead_zones(adapter, by_sequence: list[list[torch.Tensor]], threshold: float, counts):
    """adapter.dead_zone on the depth weights of each resample: (lengths (B,), weights (L, B)).
    `by_sequence[n]` is the depth_weights record of sequence n alone (one tensor per
    sublayer); a resample's record is their mean over the resampled sequences, which is the
    record of the resampled batch (every sequence has the same T tokens)."""
    stacked = [
        torch.stack([seq[s] for seq in by_sequence], dim=-1) for s in range(len(by_sequence[0]))
    ]
    resampled = [means(w, counts) for w in stacked]  # per sublayer: (sources, B)
    lengths, weights = [], []
    for b in range(counts.shape[0]):
        length, w = adapter.dead_zone([torch.from_numpy(r[:, b]) for r in resampled], threshold)
        lengths.append(length)
        weights.append(w)
    return np.array(lengths, dtype=np.float64), np.array(weights, dtype=np.float64).T
