"""The probes that change the model: skip a layer (causal score), exchange two layers
(permutation score), replace a layer by its affine fit (usefulness ratio), and remove the
prefix-average part of attention (the rank-collapse diagnostic).

Every probe talks to the model through the adapter (depthbench.models.adapter), so skip, swap and
replace mean the same thing for every architecture, and pretrained models go through the same
code. Each changed pass resumes at the first changed layer from the state entering it, saved by
one baseline pass: layers 1 .. l-1 are unchanged by a change at l, so the causal matrix takes one
baseline pass and L resumed ones (about half of L + 1 full passes in layer evaluations), the
L(L-1)/2 permutation passes resume at layer a, and usefulness fits each layer's map once. The
passes are shared among `workers` (depthbench.probes.workers). `max_passes` bounds each family
to its first passes (the longest: they resume earliest), the rest of its result left NaN.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from depthbench.models.adapter import (
    ModelAdapter,
    final_state,
    run_from,
    trunk_states,
)
from depthbench.models.layers import at_least_fp32
from depthbench.probes.core import sequence_losses, to_host
from depthbench.probes.workers import map_over_model_copies


def _deltas(hidden: list[torch.Tensor]) -> torch.Tensor:
    """h_l - h_(l-1) for l = 1 .. len(hidden) - 1, stacked, in at least fp32."""
    return at_least_fp32(torch.stack([hidden[l] - hidden[l - 1] for l in range(1, len(hidden))]))


def _first(items: list, max_passes: int | None) -> list:
    """The passes a family evaluates: every item, or its first `max_passes` (the longest)."""
    if max_passes is None:
        return items
    if isinstance(max_passes, bool) or not isinstance(max_passes, int) or max_passes < 1:
        raise ValueError(f"max_passes must be a positive integer or None (all), got {max_passes!r}")
    return items[:max_passes]


def _mean_norm(t: torch.Tensor) -> torch.Tensor:
    """E||.|| over tokens of (K, N, T, d) -> (K,): the expectation is over tokens."""
    return t.norm(dim=-1).mean(dim=(1, 2))


@torch.no_grad()
def causal_scores(
    adapter: ModelAdapter,
    idx: torch.Tensor,
    workers: int = 1,
    per_sequence: bool = False,
    max_passes: int | None = None,
):
    """C[s, l] = E||(h'_l - h'_(l-1)) - (h_l - h_(l-1))|| / E||h_l - h_(l-1)|| for l > s (a ratio
    of means over tokens), h' the pass with layer s skipped (adapter.skip: nothing of layer s
    reaches later layers); NaN elsewhere; 1-based (L + 1, L + 1) with row and column 0 unused.
    per_sequence: (C, A, B), the two means over each sequence's tokens, A[s, l, n] of the
    numerator's norm and B[l, n] of the denominator's (C = mean_n A / mean_n B)."""
    states = trunk_states(adapter, idx)
    base = _deltas([adapter.residual(s) for s in states])  # (L, N, T, d): layer l at index l - 1
    L = adapter.n_layer
    denom = _mean_norm(base)

    def skipped(m: ModelAdapter, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        state = m.skip(states[s - 1], s)  # h'_s = h_(s-1): nothing of layer s
        resumed = [m.residual(state)] + [m.residual(st) for st in run_from(m, state, s + 1)]
        norms = (_deltas(resumed) - base[s:]).norm(dim=-1)  # layers s+1 .. L
        return norms.mean(dim=(1, 2)) / denom[s:], norms.mean(dim=2).double()

    # skipping layer L changes no later layer: L - 1 resumed passes, read in one copy
    passes = map_over_model_copies(adapter, _first(list(range(1, L)), max_passes), skipped, workers)
    by_sequence = base.norm(dim=-1).mean(dim=2).double()
    read = to_host([t for pass_ in passes for t in pass_] + [by_sequence])
    C = torch.full((L + 1, L + 1), float("nan"))
    A = torch.full((L + 1, L + 1, idx.shape[0]), float("nan"), dtype=torch.float64)
    for s in range(1, len(passes) + 1):
        C[s, s + 1 :], A[s, s + 1 :] = read[2 * s - 2], read[2 * s - 1]
    if not per_sequence:
        return C
    B = torch.full((L + 1, idx.shape[0]), float("nan"), dtype=torch.float64)
    B[1:] = read[-1]
    return C, A, B


@torch.no_grad()
def permutation_scores(
    adapter: ModelAdapter,
    idx: torch.Tensor,
    workers: int = 1,
    per_sequence: bool = False,
    max_passes: int | None = None,
):
    """P[a, b] = |loss_swapped - loss| / loss for a < b (1-based, NaN elsewhere), with every
    parameter of layers a and b exchanged (adapter.swapped; position-bound constants stay).
    per_sequence: (P, S, b), each sequence's mean loss swapped, S[a, b, n], and unchanged, b[n]
    (P = |mean_n S - mean_n b| / mean_n b)."""
    inputs, targets = idx[:, :-1], idx[:, 1:]
    states = trunk_states(adapter, inputs)
    base, base_by_seq = sequence_losses(adapter, states[-1], targets)
    L = adapter.n_layer
    pairs = [(a, b) for a in range(1, L + 1) for b in range(a + 1, L + 1)]  # longest passes first

    def swapped_loss(m: ModelAdapter, pair: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = pair
        with m.swapped(a, b):  # layers 1 .. a-1 are unchanged: resume at layer a
            return sequence_losses(m, final_state(m, states[a - 1], a), targets)

    passes = map_over_model_copies(adapter, _first(pairs, max_passes), swapped_loss, workers)
    base, base_by_seq, *read = to_host([base, base_by_seq, *(t for p in passes for t in p)])
    base = float(base)
    P = torch.full((L + 1, L + 1), float("nan"))
    S = torch.full((L + 1, L + 1, idx.shape[0]), float("nan"), dtype=torch.float64)
    for k, (a, b) in enumerate(pairs[: len(passes)]):
        P[a, b] = abs(float(read[2 * k]) - base) / base
        S[a, b] = read[2 * k + 1]
    return (P, S, base_by_seq) if per_sequence else P


def affine_fit(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The least-squares affine map [x, 1] @ W ~ y over rows (tokens), (k + 1, m): the
    minimum-norm solution (SVD driver), so that it is unique when the inputs are rank-deficient,
    as HC's and mHC's streams are at initialisation (n identical copies). The default QR driver
    returns one of many solutions there, a different one from call to call, and the probe's loss
    moved with it (0.3% on a 3-layer hc model). In float64 on the features' device: on the CPU
    by LAPACK's gelsd; elsewhere, which has no gelsd, as the pseudo-inverse (an SVD) times y,
    the same minimum-norm solution with the same rank cut-off (singular values below
    eps * max(rows, columns) * the largest, gelsd's default rcond), so that no layer's features
    travel to the host."""
    x, y = x.reshape(-1, x.shape[-1]).double(), y.reshape(-1, y.shape[-1]).double()
    design = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    if design.device.type == "cpu":
        return torch.linalg.lstsq(design, y, driver="gelsd").solution
    return torch.linalg.pinv(design) @ y


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
def usefulness_ratios(
    adapter: ModelAdapter,
    idx: torch.Tensor,
    workers: int = 1,
    per_sequence: bool = False,
    max_passes: int | None = None,
):
    """r_l = loss with layer l replaced by its least-squares affine fit / loss (1-based, index 0
    unused). The replacement maps the layer's input features to all it contributes (see
    adapter.layer_io: for moda its depth keys too, for attnres its two sources).
    per_sequence: (r, R, b), each sequence's mean loss replaced, R[l, n], and unchanged, b[n]
    (r_l = mean_n R / mean_n b, with the fits of the whole sample)."""
    inputs, targets = idx[:, :-1], idx[:, 1:]
    states, fits = layer_fits(adapter, inputs)
    base, base_by_seq = sequence_losses(adapter, states[-1], targets)

    def replaced_loss(m: ModelAdapter, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = fits[layer - 1]
        state = m.replace(states[layer - 1], layer, apply_affine(x, weight))
        return sequence_losses(m, final_state(m, state, layer + 1), targets)

    layers = list(range(1, adapter.n_layer + 1))
    passes = map_over_model_copies(adapter, _first(layers, max_passes), replaced_loss, workers)
    base, base_by_seq, *read = to_host([base, base_by_seq, *(t for p in passes for t in p)])
    base = float(base)
    ratios = torch.full((adapter.n_layer + 1,), float("nan"))
    R = torch.full((adapter.n_layer + 1, idx.shape[0]), float("nan"), dtype=torch.float64)
    for k, layer in enumerate(layers[: len(passes)]):
        ratios[layer], R[layer] = float(read[2 * k]) / base, read[2 * k + 1]
    return (ratios, R, base_by_seq) if per_sequence else ratios


@contextmanager
def without_prefix_average(model):
    """Every causal attention matrix P is split into its prefix-average part U (row t uniform over
    positions <= t) and the rest; within the context attention outputs (P - U) V only. For models
    whose attention sublayers are the standard `CausalSelfAttention` (those that declare the
    'prefix_average' probe; not moda, whose attention is joint over depth)."""
    if "prefix_average" not in model.probes:
        raise ValueError(
            f"{model.arch_name}: the prefix-average intervention needs the standard attention "
            "sublayer"
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
