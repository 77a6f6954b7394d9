"""Probe computations on a model and a fixed batch of token sequences.

Conventions: `idx` is a (N, T) LongTensor of validation sequences; h_l is what layer l + 1 reads
(`DecoderLM.forward(return_hidden=True)`); layers are numbered 1..L.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from depthbench.models.base import DecoderLM


@torch.no_grad()
def residual_stream(model: DecoderLM, idx: torch.Tensor) -> list[torch.Tensor]:
    """h_0..h_L, each (N, T, d), in fp32."""
    model.eval()
    return [h.float() for h in model(idx, return_hidden=True).hidden]


@torch.no_grad()
def lm_loss(model: DecoderLM, idx: torch.Tensor) -> float:
    """Mean next-token cross-entropy of the sample (targets are the inputs shifted by one)."""
    model.eval()
    return float(model(idx[:, :-1], idx[:, 1:]).loss)


# -- angular distance (Gromov et al. 2024) ---------------------------------------------------------
def angular_distance(hidden: list[torch.Tensor], last_token_only: bool = True) -> torch.Tensor:
    """D[l, k] = arccos(cos(h_l, h_{l+k})) / pi averaged over sequences (last token) or over all
    tokens; NaN where l + k > L. Shape (L + 1, L + 1), k = 0..L."""
    H = torch.stack(hidden)  # (L+1, N, T, d)
    if last_token_only:
        H = H[:, :, -1:]
    H = torch.nn.functional.normalize(H, dim=-1)
    L1 = H.shape[0]
    out = torch.full((L1, L1), float("nan"))
    for l in range(L1):
        cos = (H[l : l + 1] * H[l:]).sum(-1).clamp(-1.0, 1.0)  # (L1 - l, N, T)
        out[l, : L1 - l] = (torch.arccos(cos) / math.pi).mean(dim=(1, 2))
    return out


# -- skipping a layer: its sublayers add nothing ---------------------------------------------------
@contextmanager
def skip_layers(model: DecoderLM, layers: list[int]):
    """Within the context, the attention and FFN sublayers of the given 1-based layers output
    zeros, whatever residual rule surrounds them (for pre_ln the layer becomes the identity)."""
    handles = []
    for l in layers:
        block = model.blocks[l - 1]
        for sub in (block.attn, block.ffn):
            handles.append(sub.register_forward_hook(lambda module, args, out: torch.zeros_like(out)))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def _delta_norms(hidden: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(hidden[l] - hidden[l - 1]) for l in range(1, len(hidden))])  # (L, N, T, d)


@torch.no_grad()
def causal_scores(model: DecoderLM, idx: torch.Tensor) -> torch.Tensor:
    """C[s, l] = E||(h'_l - h'_{l-1}) - (h_l - h_{l-1})|| / E||h_l - h_{l-1}||, h' with layer s
    skipped, for l > s (NaN elsewhere); 1-based (L + 1, L + 1) with row/column 0 unused.
    L + 1 forward passes: one baseline and one per skipped layer."""
    base = _delta_norms(residual_stream(model, idx))
    L = base.shape[0]
    denom = base.norm(dim=-1).mean(dim=(1, 2))  # (L,)
    C = torch.full((L + 1, L + 1), float("nan"))
    for s in range(1, L + 1):
        with skip_layers(model, [s]):
            skipped = _delta_norms(residual_stream(model, idx))
        diff = (skipped - base).norm(dim=-1).mean(dim=(1, 2))
        C[s, s + 1 :] = diff[s:] / denom[s:]
    return C


@torch.no_grad()
def causal_scores_naive(model: DecoderLM, idx: torch.Tensor) -> torch.Tensor:
    """The same matrix with a fresh pair of passes for every (s, l): the reference for tests."""
    L = model.cfg.n_layer
    C = torch.full((L + 1, L + 1), float("nan"))
    for s in range(1, L + 1):
        for l in range(s + 1, L + 1):
            h = residual_stream(model, idx)
            with skip_layers(model, [s]):
                hs = residual_stream(model, idx)
            d, ds = h[l] - h[l - 1], hs[l] - hs[l - 1]
            C[s, l] = (ds - d).norm(dim=-1).mean() / d.norm(dim=-1).mean()
    return C


# -- permutation score ------------------------------------------------------------------------------
@contextmanager
def swapped_layers(model: DecoderLM, a: int, b: int):
    """Exchange every parameter of layers a and b (1-based); restored on exit. Constants bound to
    the position (LNS's 1/sqrt(l), DeepNorm's alpha) are attributes, not parameters: they stay."""
    pa = dict(model.blocks[a - 1].named_parameters())
    pb = dict(model.blocks[b - 1].named_parameters())
    with torch.no_grad():
        for name in pa:
            tmp = pa[name].detach().clone()
            pa[name].copy_(pb[name])
            pb[name].copy_(tmp)
    try:
        yield model
    finally:
        with torch.no_grad():
            for name in pa:
                tmp = pa[name].detach().clone()
                pa[name].copy_(pb[name])
                pb[name].copy_(tmp)


@torch.no_grad()
def permutation_scores(model: DecoderLM, idx: torch.Tensor) -> torch.Tensor:
    """P[a, b] = |loss_swapped - loss| / loss for a < b (1-based, NaN elsewhere): one loss
    routine, weights swapped in place and restored."""
    L = model.cfg.n_layer
    base = lm_loss(model, idx)
    P = torch.full((L + 1, L + 1), float("nan"))
    for a in range(1, L + 1):
        for b in range(a + 1, L + 1):
            with swapped_layers(model, a, b):
                P[a, b] = abs(lm_loss(model, idx) - base) / base
    return P


# -- token similarity and effective rank ------------------------------------------------------------
def token_similarity(h: torch.Tensor, skip_first: bool = False) -> float:
    """Mean over token pairs i < j of cos(h[i], h[j]) within a sequence, averaged over sequences."""
    if skip_first:
        h = h[:, 1:]
    x = torch.nn.functional.normalize(h.float(), dim=-1)
    T = x.shape[1]
    gram = x @ x.transpose(1, 2)  # (N, T, T)
    upper = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    return float(gram[:, upper].mean())


def effective_rank(matrix: torch.Tensor) -> float:
    """Roy and Vetterli: p_i = sigma_i / sum sigma, erank = exp(-sum p_i log p_i)."""
    s = torch.linalg.svdvals(matrix.double())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def residual_product_rank(stream_mixing: list[torch.Tensor]) -> float:
    """erank of the product M_2L ... M_1 of the per-sublayer stream-mixing matrices (each acting
    as H <- M H: A_r^T for hc, H_res for mhc), per token, averaged over tokens; in [1, n]."""
    product = None
    for M in stream_mixing:  # (N, T, n, n), applied in order
        product = M if product is None else M @ product
    flat = product.reshape(-1, *product.shape[-2:]).double()
    s = torch.linalg.svdvals(flat)
    p = s / s.sum(-1, keepdim=True)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    return float(ent.exp().mean())

