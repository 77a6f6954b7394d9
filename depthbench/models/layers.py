"""Backbone building blocks shared by every architecture (LLaMA style, no biases).

Attention and FFN here are the *sublayers* F of docs/design/architectures.md: they contain no norm
and no residual. Each architecture module decides where the norms and the residual go.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from depthbench.models.precision import autocast_off
from depthbench.models.config import ModelConfig


# Listeners of `held_for_backward` (depthbench.train.activation_trace adds one while it runs).
HELD_LISTENERS: list = []


def held_for_backward(t: torch.Tensor, gradient_copies: float = 1.0) -> torch.Tensor:
    """Mark `t` as kept until backward outside autograd's saved tensors: a buffer that later
    layers write into in place, which an autograd.Function holds on its ctx because saving it
    would fail the version check (MoDA's depth K/V, AttnRes's sources). Memory tracing sees
    saved tensors through autograd's hooks only; this is how it sees these. `gradient_copies`:
    how many buffer-sized gradients the backward of the buffer's reads can hold at once, beside
    what the blocks' own backward holds (the memory estimate's held working set). Returns `t`."""
    if HELD_LISTENERS and torch.is_grad_enabled():
        for listener in HELD_LISTENERS:
            listener(t, gradient_copies)
    return t


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast bf16/fp16 for reductions and softmaxes; leave fp32 and fp64 as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2, -1) + eps), (..., 1), in at least fp32.

    From the dot product x . x = sum(x^2): one reduction kernel forward and two multiplies
    backward. On CPU (2 threads, forward + backward) about 1.8x faster than through the 2-norm
    (whose backward divides by the norm and masks zeros: HC's (2048, 4, 64) streams, 1.48 -> 0.80
    ms) and 2.5x faster than pow and mean. With autocast off: vecdot is on CPU autocast's
    lower-precision list, which would run the reduction in bf16 (a relative error of about 3e-3)."""
    x = at_least_fp32(x)
    with autocast_off(x.device.type):
        return torch.rsqrt(torch.linalg.vecdot(x, x).unsqueeze(-1) / x.shape[-1] + eps)


class ConstantBuffers(nn.Module):
    """A module whose position-bound constants (LNS's 1/sqrt(l), DeepNorm's alpha) are
    non-persistent 0-dim buffers, each the Python float it was registered with, rounded once
    into the buffer's current dtype: after every cast or move (`.double()`, `.to(bf16)`,
    `to_empty`) the buffer is filled again from the float, so a float64 model holds the float64
    value, never a float32 one cast up. Tensors, not floats, so that a compiled block takes them
    as inputs and one graph serves every layer."""

    def register_constant(self, name: str, value: float) -> None:
        self.__dict__.setdefault("_constant_values", {})[name] = float(value)
        self.register_buffer(name, torch.tensor(float(value)), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)
        with torch.no_grad():
            for name, value in self.__dict__.get("_constant_values", {}).items():
                buffer = self._buffers.get(name)
                if buffer is not None and buffer.device.type != "meta":
                    buffer.fill_(value)
        return module


class RMSNorm(nn.Module):
    """N(x) = g * x / sqrt(mean(x^2) + eps), learnable gain g, eps = 1e-6 by default."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is the fused kernel; computed in the input dtype like LLaMA's reference
        # except that we upcast to fp32 for the reduction under reduced precision.
        if x.dtype in (torch.float16, torch.bfloat16):
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def normed_linear(x: torch.Tensor, norm: RMSNorm, linear: nn.Linear) -> torch.Tensor:
    """linear(norm(x)) for a bias-free linear, in at least fp32, without materialising norm(x):
    N(x) W^T = (x (g * W)^T) / rms(x), the gain folded into the weight. For projections that only
    feed coefficients (HC's dynamic weights, mHC's Phi), where the normalised input is not
    needed."""
    return at_least_fp32(F.linear(x, linear.weight * norm.weight)) * inverse_rms(x, norm.eps)


class RotaryEmbedding(nn.Module):
    """RoPE tables. Rotation uses the half-split (GPT-NeoX) pairing of dimensions i and i + hd/2."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        if torch.empty(0).is_meta:
            # a model built for its shapes (parameters_on_meta, torch.device("meta")): tables of
            # the right shape, no values. Computing them is most of a count's build at
            # max_seq_len 4096, and solving a preset's shapes builds hundreds of models
            shape = (max_seq_len, head_dim // 2)
            for name in ("cos", "sin"):
                self.register_buffer(name, torch.empty(shape), persistent=False)
            return
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, seq_len: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for positions offset .. offset + seq_len - 1 (offset > 0 when decoding)."""
        if offset + seq_len > self.cos.shape[0]:
            raise ValueError(
                f"sequence length {offset + seq_len} exceeds max_seq_len {self.cos.shape[0]}"
            )
        return self.cos[offset : offset + seq_len], self.sin[offset : offset + seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) by the position angle: (x1 cos - x2 sin, x2 cos + x1 sin).

    x: (B, H, T, hd); cos/sin: (T, hd/2).
    """
    x1, x2 = at_least_fp32(x).chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


class KVCache:
    """The keys and values one attention layer keeps across decoding steps (after RoPE)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' k, v (B, H_kv, T_new, hd); return all cached so far."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


def causal_mask(n_query: int, n_key: int, device) -> torch.Tensor | None:
    """Boolean mask for queries that are the last n_query of n_key positions (None: plain causal
    square, which SDPA handles with is_causal)."""
    if n_query == n_key:
        return None
    return torch.ones(n_query, n_key, dtype=torch.bool, device=device).tril(
        diagonal=n_key - n_query
    )


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention with RoPE; GQA when n_kv_head < n_head.

    Q, K and V come from one fused projection (one matmul instead of three), which is what
    makes the small shapes fast; the weight rows are [q | k | v].
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.head_dim
        self.q_dim = cfg.n_head * cfg.head_dim
        self.kv_dim = cfg.n_kv_head * cfg.head_dim
        self.wqkv = nn.Linear(cfg.d_model, self.q_dim + 2 * self.kv_dim, bias=False)
        self.wo = nn.Linear(self.q_dim, cfg.d_model, bias=False)
        self.cache: KVCache | None = None  # set while decoding (depthbench.models.decoding)

    def project_qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return q (B, H, T, hd) and k, v (B, H_kv, T, hd), with RoPE applied to q and k."""
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, rope)
        if self.cache is not None:  # decoding: attend to every cached position too
            k, v = self.cache.extend(k, v)
        mask = causal_mask(T, k.shape[2], x.device)
        # softmax(q k^T / sqrt(hd) + causal mask) v; SDPA picks the flash / memory-efficient
        # kernel on GPU. enable_gqa lets each group of query heads share one K/V head.
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, self.q_dim))


class SwiGLU(nn.Module):
    """FFN(x) = W2 (silu(W1 x) * W3 x); W1 and W3 are fused into one matmul (rows [W1 | W3])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_ff = cfg.d_ff
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
