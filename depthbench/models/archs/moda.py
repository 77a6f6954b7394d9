"""Mixture-of-Depths Attention (arXiv 2603.15619; reference code hustvl/MoDA).

Not the token-routing "Mixture-of-Depths" of Raposo et al. Each attention head at layer l,
position t, takes ONE softmax over
  (a) the usual causal keys of layer l at positions <= t, and
  (b) depth keys of the same position t from every earlier layer: the K, V that the attention
      sublayers of layers 1..l-1 produced at t, and in the `ffn_kv` variant also K, V from an
      extra projection of each earlier layer's FFN-sublayer input N(x),
and mixes the corresponding values under that softmax:

    y_t = sum_{j<=t} p_tj v_j + sum_{m<l} p_tm v^depth_{m,t},
    p = softmax([q_t k_j / sqrt(hd) ; q_t k^depth_{m,t} / sqrt(hd)])

The residual placement is Pre-LN with a final norm. `reuse_kv` (default) adds no parameters;
`ffn_kv` adds a d -> 2 * kv_dim projection per layer (2 d^2 / G parameters, G = query heads per
KV head), charged to the budget. Depth keys carry the RoPE rotation of their own position t,
the same as the query they meet, so the rotation cancels in q . k as it does for j = t.
The joint softmax is written out here with explicit (T, S + D) score matrices and the depth
keys stacked per layer (`joint_depth_attention`): the definition. A fused implementation (one
online softmax over the causal keys and a depth K/V buffer, no score matrix held;
depthbench.kernels.moda_fused) is swapped in from outside for `MoDABlock` and held to this one.
Layer 1, which has no depth keys, uses SDPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from depthbench.models.archs.moda_depth_keys import DepthKeys
from depthbench.models.base import GENERIC_PROBES, ArchOptions, Block, DecoderLM, Rope
from depthbench.models.registry import register
from depthbench.models.layers import RMSNorm, apply_rotary, at_least_fp32, causal_mask


@dataclass(frozen=True)
class MoDAOptions(ArchOptions):
    # reuse_kv: the attention K/V as depth keys; ffn_kv: also a projection of each FFN input
    variant: str = "reuse_kv"

    def __post_init__(self) -> None:
        self.require("variant", ("reuse_kv", "ffn_kv"))


def joint_depth_attention(q, k, v, depth_k, depth_v):
    """q: (B, H, T, hd); k, v: (B, H, S, hd), S >= T (the queries are the last T of S positions);
    depth_k, depth_v: (B, H, T, D, hd). -> (B, H, T, hd)."""
    B, H, T, hd = q.shape
    S = k.shape[2]  # S > T while decoding: the queries are the last T positions
    scale = 1.0 / math.sqrt(hd)
    # q k^T / sqrt(hd) + causal mask (0, or -inf above the diagonal) as ONE batched GEMM whose
    # input term is the mask: no separate passes to scale and mask the (T, S) scores
    future = torch.full((T, S), float("-inf"), dtype=q.dtype, device=q.device).triu(
        diagonal=S - T + 1
    )
    seq = torch.baddbmm(
        future, q.reshape(B * H, T, hd), k.reshape(B * H, S, hd).transpose(1, 2), alpha=scale
    )
    seq = seq.view(B, H, T, S)
    depth = torch.einsum("bhtd,bhtmd->bhtm", q, depth_k) * scale
    p = torch.softmax(at_least_fp32(torch.cat([seq, depth], dim=-1)), dim=-1).to(q.dtype)
    # the depth values as a batched (1, D) x (D, hd) product per query, also for D = 1 (einsum
    # would run that one as an element-wise product, which torch.utils.flop_counter does not count)
    return p[..., :S] @ v + (p[..., S:].unsqueeze(-2) @ depth_v).squeeze(-2)


def depth_layout(t: torch.Tensor) -> torch.Tensor:
    """A (B, H_kv, T, hd) depth key or value as the explicit path stacks it: contiguous."""
    return t.contiguous()


def _per_position(t: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, T, hd) -> (B, T, H_kv hd)."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


class MoDABlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        variant = MoDAOptions.of(cfg).variant
        self.ffn_kv = (
            nn.Linear(cfg.d_model, 2 * self.attn.kv_dim, bias=False)
            if variant == "ffn_kv"
            else None
        )
        self.n_layer = cfg.n_layer
        if self.ffn_kv is not None and layer_index == cfg.n_layer:
            # never run (no later layer reads it, see forward) yet in the budget: frozen, so that
            # DDP does not wait for its gradient (its unused-parameter check) and AdamW leaves it
            self.ffn_kv.weight.requires_grad_(False)

    def joint_attention(self, q, k, v, depth: DepthKeys) -> torch.Tensor:
        """The joint softmax of q (B, H, T, hd) over the sequence keys k, v (B, H_kv, S, hd) and
        the depth keys of the earlier layers: the score matrices written out."""
        dk = torch.stack([pair[0] for pair in depth], dim=3)
        dv = torch.stack([pair[1] for pair in depth], dim=3)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # GQA: each group of query heads reads one K/V head (a copy)
            dk, dv, k, v = (t.repeat_interleave(groups, dim=1) for t in (dk, dv, k, v))
        return joint_depth_attention(q, k, v, dk, dv)

    def depth_pair(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (k, v) this layer leaves for later layers: contiguous, as `joint_attention`
        stacks them."""
        return depth_layout(k), depth_layout(v)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        internals: dict | None = None,
        depth: DepthKeys | None = None,
    ) -> torch.Tensor:
        """`depth` holds the (k, v) pairs of earlier layers; this layer appends its own."""
        attn = self.attn
        B, T, _ = x.shape
        q, k, v = attn.project_qkv(self.attn_norm(x), rope)
        # the sequence keys: with a decoding cache, every position so far (depth keys stay per
        # position)
        k_seq, v_seq = attn.cache.extend(k, v) if attn.cache is not None else (k, v)
        groups = attn.n_head // attn.n_kv_head
        if depth:
            y = self.joint_attention(q, k_seq, v_seq, depth)
        else:
            mask = causal_mask(T, k_seq.shape[2], x.device)
            y = F.scaled_dot_product_attention(
                q, k_seq, v_seq, attn_mask=mask, is_causal=mask is None, enable_gqa=groups > 1
            )
        x = x + attn.wo(y.transpose(1, 2).reshape(B, T, attn.q_dim))
        depth.append(self.depth_pair(k, v))
        h = self.ffn_norm(x)
        # The last layer's FFN-side depth keys have no later layer to read them: not computed
        # (its projection still counts in the budget, as the design's 2 d^2 / G per layer says).
        if self.ffn_kv is not None and self.layer_index < self.n_layer:
            fk, fv = self.ffn_kv(h).split(attn.kv_dim, dim=-1)
            fk = apply_rotary(fk.view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2), *rope)
            fv = fv.view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
            depth.append(self.depth_pair(fk, fv))
        return x + self.ffn(h)


@register("moda")
class MixtureOfDepthsAttention(DecoderLM):
    block_class = MoDABlock
    has_final_norm = True
    Options = MoDAOptions
    # the prefix-average intervention needs the standard attention sublayer; moda's is joint over
    # depth
    probes = GENERIC_PROBES - {"prefix_average"}
    buffered_depth = False  # the depth keys copied into one buffer as they come (DepthKeys)

    # The trunk state is (x, the depth keys and values so far); see DecoderLM.layer_step.
    def init_state(self, h0: torch.Tensor) -> tuple[torch.Tensor, DepthKeys]:
        per_layer = 2 if self.options.variant == "ffn_kv" else 1
        return h0, DepthKeys(capacity=per_layer * self.cfg.n_layer, buffered=self.buffered_depth)

    def read_stream(self, state: tuple[torch.Tensor, DepthKeys]) -> torch.Tensor:
        return state[0]

    def layer_step(self, state, block: MoDABlock, rope: Rope):
        x, depth = state
        return block(x, rope, None, depth), depth

    def fork_state(self, state):
        return state[0], state[1].fork()

    # Skip and replace (depthbench.models.adapter). A skipped layer leaves no depth keys: later
    # layers attend over the depth keys of the layers that ran. A replaced layer's features are
    # its stream output and the depth keys and values it leaves (keys before RoPE, which is
    # re-applied at the position: an affine fit of a rotated key would have to learn the
    # rotation), so an affine replacement replaces what later layers read from it too.
    def layer_features(self, state, layer: int, rope: Rope):
        x, depth = state
        before = len(depth)
        after = self.layer_step(self.fork_state(state), self.blocks[layer - 1], rope)
        left = after[1].pairs[before:]
        cos, sin = rope
        parts = [after[0]]
        for k, v in left:
            parts += [
                _per_position(apply_rotary(k, cos, -sin)),
                _per_position(v),
            ]  # R(-t) undoes R(t)
        return x, torch.cat(parts, dim=-1), after

    def from_layer_features(self, state, layer: int, outputs: torch.Tensor, rope: Rope):
        x, depth = state
        d, attn = self.cfg.d_model, self.blocks[layer - 1].attn
        B, T = outputs.shape[:2]
        pieces = outputs[..., d:].to(x.dtype).split(attn.kv_dim, dim=-1)
        for k, v in zip(pieces[0::2], pieces[1::2]):
            k, v = (t.reshape(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2) for t in (k, v))
            depth.append((depth_layout(apply_rotary(k, *rope)), depth_layout(v)))
        return outputs[..., :d].to(x.dtype), depth

    def extra_flops_per_token(self, seq_len: int) -> float:
        """The joint softmax's depth half: 4 D_l d_q at layer l with D_l depth keys (l - 1 for
        reuse_kv, 2 (l - 1) for ffn_kv), less the last layer's ffn_kv projection, which has no
        reader and is not run."""
        cfg = self.cfg
        per_layer = 2 if self.options.variant == "ffn_kv" else 1
        d_q = cfg.n_head * cfg.head_dim
        unused = 2.0 * cfg.d_model * 2 * cfg.n_kv_head * cfg.head_dim if per_layer == 2 else 0.0
        return sum(4.0 * per_layer * (l - 1) * d_q for l in range(1, cfg.n_layer + 1)) - unused

    def depth_state_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """reuse_kv's depth keys are the sequence cache itself; ffn_kv's FFN-side K/V are extra
        per-token state."""
        cfg = self.cfg
        return (
            cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * bytes_per_value
            if self.options.variant == "ffn_kv"
            else 0
        )

    def trunk(
        self, h0: torch.Tensor, rope: Rope, hidden: list | None, internals: dict | None
    ) -> torch.Tensor:
        x, depth = self.init_state(h0)
        if hidden is not None:
            hidden.append(x)
        for block in self.blocks:
            x = block(x, rope, internals, depth)
            if hidden is not None:
                hidden.append(x)
        return x
