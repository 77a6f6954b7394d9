"""The probes that change the model: skip a layer (causal score), exchange two layers
(permutation score), replace a layer by its affine fit (usefulness ratio), and remove the
prefix-average part of attention (the rank-collapse diagnostic).

Every probe talks to the model through the adapter (depthbench.models.adapter), so skip, swap and
replace mean the same thing for every architecture, and pretrained models go through the same
code. Each changed pass resumes at the first changed layer from the state entering it, saved by
one baseline pass: layers 1 .. l-1 are unchanged by a change at l, so the causal matrix takes one
baseline pass and L resumed ones (about half of L + 1 full passes in layer evaluations), the
L(L-1)/2 permutation passes resume at layer a, and usefulness fits each layer's map once. The
passes are shared among `workers` (depthbench.probes.workers).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from depthbench.models.adapter import (
    ModelAdapter,
    final_state,
    next_token_loss,
    run_from,
    trunk_states,
)
from depthbench.models.layers import at_least_fp32
from depthbench.probes.workers import map_over_model_copies


def _deltas(hidden: list[torch.Tensor]) -> torch.Tensor:
    """h_l - h_(l-1) for l = 1 .. len(hidden) - 1, stacked, in at least fp32."""
    return at_least_fp32(torch.stack([hidden[l] - hidden[l - 1] for l in range(1, len(hidden))]))


def _mean_norm(t: torch.Tensor) -> torch.Tensor:
    """E||.|| over tokens of (K, N, T, d) -> (K,): the expectation is over tokens."""
    return t.norm(dim=-1).mean(dim=(1, 2))


@torch.no_grad()
def causal_scores(adapter: ModelAdapter, idx: torch.Tensor, workers: int = 1) -> torch.Tensor:
    """C[s, l] = E||(h'_l - h'_(l-1)) - (h_l - h_(l-1))|| / E||h_l - h_(l-1)|| for l > s (a ratio
    of means over tokens), h' the pass with layer s skipped (adapter.skip: nothing of layer s
    reaches later layers); NaN elsewhere; 1-based (L + 1, L + 1) with row and column 0 unused."""
    states = trunk_states(adapter, idx)
    base = _deltas([adapter.residual(s) for s in states])  # (L, N, T, d): layer l at index l - 1
    L = adapter.n_layer
    denom = _mean_norm(base)

    def skipped(m: ModelAdapter, s: int) -> torch.Tensor:
        state = m.skip(states[s - 1], s)  # h'_s = h_(s-1): nothing of layer s
        resumed = [m.residual(state)] + [m.residual(st) for st in run_from(m, state, s + 1)]
        return _mean_norm(_deltas(resumed) - base[s:])  # layers s+1 .. L

    C = torch.full((L + 1, L + 1), float("nan"))
    # skipping layer L changes no later layer: L - 1 resumed passes
    for s, diff in enumerate(
        map_over_model_copies(adapter, list(range(1, L)), skipped, workers), start=1
    ):
        C[s, s + 1 :] = diff / denom[s:]
    return C


@torch.no_grad()
def permutation_scores(adapter: ModelAdapter, idx: torch.Tensor, workers: int = 1) -> torch.Tensor:
    """P[a, b] = |loss_swapped - loss| / loss for a < b (1-based, NaN elsewhere), with every
    parameter of layers a and b exchanged (adapter.swapped; position-bound constants stay)."""
    inputs, targets = idx[:, :-1], idx[:, 1:]
    states = trunk_states(adapter, inputs)
    base = next_token_loss(adapter, states[-1], targets)
    L = adapter.n_layer
    pairs = [(a, b) for a in range(1, L + 1) for b in range(a + 1, L + 1)]  # longest passes first

    def swapped_loss(m: ModelAdapter, pair: tuple[int, int]) -> float:
        a, b = pair
        with m.swapped(a, b):  # layers 1 .. a-1 are unchanged: resume at layer a
            return next_token_loss(m, final_state(m, states[a - 1], a), targets)

    P = torch.full((L + 1, L + 1), float("nan"))
    for (a, b), loss in zip(pairs, map_over_model_copies(adapter, pairs, swapped_loss, workers)):
        P[a, b] = abs(loss - base) / base
    return P


def affine_fit(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The least-squares affine map [x, 1] @ W ~ y over rows (tokens), (k + 1, m): the
    minimum-norm solution (SVD driver), so that it is unique when the inputs are rank-deficient,
    as HC's and mHC's streams are at initialisation (n identical copies). The default QR driver
    returns one of many solutions there, a different one from call to call, and the probe's loss
    moved with it (0.3% on a 3-layer hc model). Solved on the CPU, the only device with that
    driver, in float64."""
    x, y = x.reshape(-1, x.shape[-1]).double(), y.reshape(-1, y.shape[-1]).double()
    design = torch.cat([x, torch.ones_like(x[:, :1])], dim=1).cpu()
    return torch.linalg.lstsq(design, y.cpu(), driver="gelsd").solution.to(x.device)


def apply_affine(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[x, 1] @ weight per token, (N, T, k) -> (N, T, m), in float64."""
    x = x.double()
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1) @ weight


@torch.no_grad()
def layer_fits(
    adapter: ModelAdapter, idx: torch.Tensor
) -> tuple[list, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One baseline pass: the states entering each layer and, per layer, its input features and
    the affine map fitted from them to its output features (adapter.layer_io)."""
    states, fits = [adapter.begin(idx)], []
    for layer in range(1, adapter.n_layer + 1):
        x, y, after = adapter.layer_io(states[-1], layer)
        fits.append((x, affine_fit(x, y)))
        states.append(after)
    return states, fits


@torch.no_grad()
def usefulness_ratios(adapter: ModelAdapter, idx: torch.Tensor, workers: int = 1) -> torch.Tensor:
    """r_l = loss with layer l replaced by its least-squares affine fit / loss (1-based, index 0
    unused). The replacement maps the layer's input features to all it contributes (see
    adapter.layer_io: for moda its depth keys too, for attnres its two sources)."""
    inputs, targets = idx[:, :-1], idx[:, 1:]
    states, fits = layer_fits(adapter, inputs)
    base = next_token_loss(adapter, states[-1], targets)

    def replaced_ratio(m: ModelAdapter, layer: int) -> float:
        x, weight = fits[layer - 1]
        state = m.replace(states[layer - 1], layer, apply_affine(x, weight))
        return next_token_loss(m, final_state(m, state, layer + 1), targets) / base

    layers = list(range(1, adapter.n_layer + 1))
    ratios = torch.full((adapter.n_layer + 1,), float("nan"))
    for layer, ratio in zip(
        layers, map_over_model_copies(adapter, layers, replaced_ratio, workers)
    ):
        ratios[layer] = ratio
    return ratios


@contextmanager
def without_prefix_average(model):
    """Every causal attention matrix P is split into its prefix-average part U (row t uniform over
    positions <= t) and the rest; within the context attention outputs (P - U) V only. For models
    whose attention sublayers are the standard `CausalSelfAttention` (those that declare the
    'prefix_average' probe; not moda, whose attention is joint over depth)."""
    if "prefix_average" not in model.probes:
        raise ValueError(
            f"{model.arch_name}: the prefix-average intervention needs the standard attention sublayer"
        )

    def make_forward(attn):
        def forward(x, rope):
            B, T, _ = x.shape
            q, k, v = attn.project_qkv(x, rope)
            groups = attn.n_head // attn.n_kv_head
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(attn.head_dim)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            P = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            U = causal.to(P.dtype) / torch.arange(
                1, T + 1, device=x.device, dtype=P.dtype
            ).unsqueeze(1)
            y = (P - U) @ v
            return attn.wo(y.transpose(1, 2).reshape(B, T, attn.q_dim))

        return forward

    patched = [block.attn for block in model.blocks]
    for attn in patched:
        attn.forward = make_forward(attn)
    try:
        yield model
    finally:
        for attn in patched:
            del attn.forward
