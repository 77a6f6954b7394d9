"""Probe measurements on the residual stream h_0..h_L of a fixed batch of token sequences.

Conventions: `idx` is a (N, T) LongTensor of validation sequences; h_l is what layer l + 1 reads
before its own norm and h_L the input of the final norm (depthbench.models.adapter); layers are
numbered 1..L. The probes that change the model (skip, swap, replace) are in
depthbench.probes.interventions.

Every measurement is computed on the device of the hidden states and reaches the host once per
probe family, never once per layer, sequence or pass: on a GPU each read of a device value
waits for every kernel queued before it, so a read inside a loop over layers would stall the
device L times per probe (tests/unit/test_probe_host_reads.py counts them). `to_host` is that
one read for a list of tensors.
"""

from __future__ import annotations

import math

import torch

from depthbench.models.adapter import ModelAdapter, hidden_states, next_token_loss, trunk_states
from depthbench.models.layers import at_least_fp32


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of `tensors` (each detached, its dtype and shape kept) in one device-to-host
    copy: flattened and concatenated on their device (per dtype), moved once, split again."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for members in by_dtype.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in members]).cpu()
        for i, part in zip(members, flat.split([tensors[i].numel() for i in members])):
            out[i] = part.reshape(tensors[i].shape)
    return out  # type: ignore[return-value]


@torch.no_grad()
def residual_stream(adapter: ModelAdapter, idx: torch.Tensor) -> list[torch.Tensor]:
    """h_0..h_L, each (N, T, d), in at least fp32."""
    return [at_least_fp32(h) for h in hidden_states(adapter, idx)]


@torch.no_grad()
def lm_loss(adapter: ModelAdapter, idx: torch.Tensor) -> float:
    """Mean next-token cross-entropy of the sample (targets are the inputs shifted by one)."""
    return next_token_loss(adapter, trunk_states(adapter, idx[:, :-1])[-1], idx[:, 1:])


# -- angular distance (Gromov et al. 2024) ---------------------------------------------------------
def angular_distance(hidden: list[torch.Tensor], last_token_only: bool = True) -> torch.Tensor:
    """D[l, k] = arccos(cos(h_l, h_{l+k})) / pi averaged over sequences (last token) or over all
    tokens; NaN where l + k > L. Shape (L + 1, L + 1), k = 0..L."""
    H = torch.stack(hidden)  # (L+1, N, T, d)
    if last_token_only:
        H = H[:, :, -1:]
    H = torch.nn.functional.normalize(H, dim=-1)
    L1 = H.shape[0]
    out = torch.full((L1, L1), float("nan"), device=H.device, dtype=H.dtype)
    for l in range(L1):
        cos = (H[l : l + 1] * H[l:]).sum(-1).clamp(-1.0, 1.0)  # (L1 - l, N, T)
        out[l, : L1 - l] = (torch.arccos(cos) / math.pi).mean(dim=(1, 2))
    return out.float().cpu()


# -- token similarity and effective rank -----------------------------------------------------------
def _token_similarity(h: torch.Tensor, skip_first: bool) -> torch.Tensor:
    """token_similarity on the device: a 0-dim tensor."""
    if skip_first:
        h = h[:, 1:]
    x = torch.nn.functional.normalize(at_least_fp32(h), dim=-1)
    T = x.shape[1]
    gram = x @ x.transpose(1, 2)  # (N, T, T)
    upper = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
    return gram[:, upper].mean()


def token_similarity(h: torch.Tensor, skip_first: bool = False) -> float:
    """Mean over token pairs i < j of cos(h[i], h[j]) within a sequence, averaged over sequences."""
    return float(_token_similarity(h, skip_first))


def token_similarity_by_layer(hidden: list[torch.Tensor], skip_first: bool = False) -> list[float]:
    return torch.stack([_token_similarity(h, skip_first) for h in hidden]).cpu().tolist()


def _effective_ranks(matrices: torch.Tensor) -> torch.Tensor:
    """effective_rank of each matrix of a batch (..., m, n), in float64 on their device."""
    s = torch.linalg.svdvals(matrices.double())
    p = s / s.sum(-1, keepdim=True)
    return torch.exp(-(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1))


def effective_rank(matrix: torch.Tensor) -> float:
    """Roy and Vetterli: p_i = sigma_i / sum sigma, erank = exp(-sum p_i log p_i)."""
    return float(_effective_ranks(matrix))


def effective_rank_by_layer(hidden: list[torch.Tensor]) -> list[float]:
    """erank of each sequence's (T, d) token matrix at every layer, averaged over sequences."""
    return [sum(r) / len(r) for r in effective_rank_by_sequence(hidden)]


def residual_product_rank(stream_mixing: list[torch.Tensor]) -> float:
    """erank of the product M_2L ... M_1 of the per-sublayer stream-mixing matrices (each acting
    as H <- M H: A_r^T for hc, H_res for mhc), per token, averaged over tokens; in [1, n]."""
    product = None
    for M in stream_mixing:  # (N, T, n, n), applied in order
        M = M.detach()
        product = M if product is None else M @ product
    flat = product.reshape(-1, *product.shape[-2:]).double()
    s = torch.linalg.svdvals(flat)
    p = s / s.sum(-1, keepdim=True)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    return float(ent.exp().mean())


# -- summaries -------------------------------------------------------------------------------------
def last_quarters(L: int) -> range:
    """Layers in the last three quarters of depth: l > L/4 (1-based)."""
    return range(L // 4 + 1, L + 1)


def share_above(matrix: torch.Tensor, threshold: float) -> float:
    """Fraction of defined pairs with both layers in the last 3/4 of depth whose score exceeds
    `threshold` (the summaries of the causal and permutation probes)."""
    L = matrix.shape[0] - 1
    layers = list(last_quarters(L))
    values = matrix[layers][:, layers]
    values = values[~torch.isnan(values)]
    return float((values > threshold).float().mean()) if values.numel() else float("nan")


# -- per-sequence values: the units of the bootstrap intervals (depthbench.probes.spread) ----------
# Every sequence of the sample has the same T tokens, so a mean over the sample's tokens is the
# mean over sequences of each sequence's own token mean: these return the per-sequence means
# whose mean over sequences is the probe above (up to the order of float summation).
def angular_distance_by_sequence(
    hidden: list[torch.Tensor], last_token_only: bool = True
) -> torch.Tensor:
    """angular_distance of each sequence n alone: (L + 1, L + 1, N), NaN where l + k > L."""
    H = torch.stack(hidden)  # (L+1, N, T, d)
    if last_token_only:
        H = H[:, :, -1:]
    H = torch.nn.functional.normalize(H, dim=-1)
    L1, N = H.shape[0], H.shape[1]
    out = torch.full((L1, L1, N), float("nan"), device=H.device, dtype=H.dtype)
    for l in range(L1):
        cos = (H[l : l + 1] * H[l:]).sum(-1).clamp(-1.0, 1.0)  # (L1 - l, N, T)
        out[l, : L1 - l] = (torch.arccos(cos) / math.pi).mean(dim=2)
    return out.float().cpu()


def token_similarity_by_sequence(h: torch.Tensor, skip_first: bool = False) -> torch.Tensor:
    """token_similarity of each sequence alone: its mean over token pairs i < j, (N,)."""
    if skip_first:
        h = h[:, 1:]
    x = torch.nn.functional.normalize(at_least_fp32(h), dim=-1)
    T = x.shape[1]
    upper = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
    return (x @ x.transpose(1, 2))[:, upper].mean(dim=1)  # on the device: callers stack layers


def effective_rank_by_sequence(hidden: list[torch.Tensor]) -> list[list[float]]:
    """erank of each sequence's token matrix at every layer, [layer][sequence]: the terms that
    effective_rank_by_layer sums, in its order (so sum(v) / len(v) is its value exactly). One
    batched SVD per layer, one read of all layers' ranks."""
    return torch.stack([_effective_ranks(h) for h in hidden]).cpu().tolist()


def residual_product_rank_by_sequence(stream_mixing: list[torch.Tensor]) -> torch.Tensor:
    """residual_product_rank per sequence: the erank of the product averaged over the tokens of
    each sequence, (N,)."""
    product = None
    for M in stream_mixing:  # (N, T, n, n), applied in order
        M = M.detach()
        product = M if product is None else M @ product
    s = torch.linalg.svdvals(product.double())  # (N, T, n)
    p = s / s.sum(-1, keepdim=True)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    return ent.exp().mean(dim=1).cpu()


def residual_rms(hidden: list[torch.Tensor]) -> list[float]:
    """RMS of h_l over every token and coordinate of the sample, l = 0..L (the dynamics' own
    definition, depthbench.train.dynamics, on the probe sample)."""
    return torch.stack([h.pow(2).mean().sqrt() for h in hidden]).cpu().tolist()


def mean_square_by_sequence(hidden: list[torch.Tensor]) -> torch.Tensor:
    """Mean square of h_l over each sequence's tokens and coordinates, (L + 1, N): RMS(h_l) of
    the sample is the square root of its mean over sequences."""
    return torch.stack([h.pow(2).mean(dim=(1, 2)).double() for h in hidden]).cpu()


def sequence_losses(
    adapter: ModelAdapter, state, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """next_token_loss of a final state (the same computation, so the same float once read) and
    each sequence's mean next-token cross-entropy, (N,) in float64, from one evaluation of the
    logits; both left on the device (a 0-dim and a 1-dim tensor) for the caller to read once."""
    logits = adapter.logits(state).float()
    flat, target = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    per_token = torch.nn.functional.cross_entropy(flat, target, reduction="none")
    pooled = torch.nn.functional.cross_entropy(flat, target)
    return pooled, per_token.reshape(targets.shape).mean(dim=1).double()
