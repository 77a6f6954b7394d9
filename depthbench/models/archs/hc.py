"""Hyper-Connections, dynamic variant (Zhu et al., ICLR 2025, arXiv 2409.19606).

The residual stream is widened to n streams H (n x d), all initialised to copies of the
embedding. For sublayer s (0-based over the 2L sublayers), with Hn = N(H) per stream:

    a_m = onehot(s mod n) + 0.01 tanh(Hn w_m)        read weights       (n)
    A_r = I_n             + 0.01 tanh(Hn W_r)        stream mixing      (n x n)
    b   = 1_n             + 0.01 tanh(Hn w_b)        write weights      (n)
    H  <- A_r^T H + b^T F(N(a_m^T H))

The static parts (one-hot, identity, ones) are learnable parameters initialised to those
values; the dynamic projections w_m, W_r, w_b are zero-initialised, and the 0.01 scale is a
fixed constant (documented choice). The model output is the sum of streams, then the final norm
and LM head; h_l for probes is the sum of streams. With n = 1 and zero dynamic weights this is
exactly Pre-LN. `internals["stream_mixing"]` records, for every sublayer, the matrix acting on the
streams, A_r^T (B, T, n, n), as mhc records H_res: both read H <- M H + ...
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from depthbench.models.base import Block, DecoderLM, Rope, register
from depthbench.models.layers import RMSNorm, at_least_fp32

DYNAMIC_SCALE = 0.01


def mix_streams(weights: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """sum_i w_i H_i: (B, T, n) x (B, T, n, d) -> (B, T, d)."""
    return (weights.unsqueeze(-1) * H).sum(dim=-2)


def mix_matrix(M: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """(M H)_j = sum_i M_ji H_i: (B, T, m, n) x (B, T, n, d) -> (B, T, m, d).

    Written as n multiply-adds of whole streams: on CPU, a batched matmul of 4 x 4 matrices
    loops over the B*T batch (about 4x slower, forward and backward), and one broadcast
    multiply materialises an (n, n, d) tensor per token (about 1.7x slower at d = 256).
    """
    # stream i's coefficients as one contiguous (B, T, m, 1) block: element-wise kernels are
    # slower on strided broadcast operands (about 5% of an inference forward at d = 32)
    columns = M.movedim(-1, 0).contiguous().unsqueeze(-1)  # (n, B, T, m, 1)
    out = columns[0] * H[..., 0, None, :]
    for i in range(1, H.shape[-2]):
        out = torch.addcmul(out, columns[i], H[..., i, None, :])
    return out


class HyperConnection(nn.Module):
    """The read / mix / write weights of one sublayer."""

    def __init__(self, d_model: int, n_streams: int, sublayer: int, eps: float):
        super().__init__()
        n = n_streams
        self.norm = RMSNorm(d_model, eps)
        self.static_read = nn.Parameter(torch.zeros(n))  # values set by reset_static()
        self.static_mix = nn.Parameter(torch.eye(n))
        self.static_write = nn.Parameter(torch.ones(n))
        # one projection for [w_m | W_r | w_b]: d -> 1 + n + 1 per stream
        self.dynamic = nn.Linear(d_model, n + 2, bias=False)
        self.n = n

    def reset_static(self, sublayer: int) -> None:
        with torch.no_grad():
            self.static_read.zero_()
            self.static_read[sublayer % self.n] = 1.0
            self.static_mix.copy_(torch.eye(self.n))
            self.static_write.fill_(1.0)
            self.dynamic.weight.zero_()

    def forward(self, H: torch.Tensor, sublayer_fn: Callable[[torch.Tensor], torch.Tensor]):
        n = self.n
        # N(H_i) W = (H_i (g * W)) / rms(H_i): the normalised streams are never materialised.
        inv_rms = torch.rsqrt(at_least_fp32(H).pow(2).mean(-1, keepdim=True) + self.norm.eps).to(H.dtype)
        proj = H @ (self.norm.weight.unsqueeze(1) * self.dynamic.weight.t())  # (B, T, n, n + 2)
        dyn = DYNAMIC_SCALE * torch.tanh(proj * inv_rms)
        read = self.static_read + dyn[..., 0]  # (B, T, n)
        mix = self.static_mix + dyn[..., 1 : n + 1]  # (B, T, n, n): row i = from stream i
        write = self.static_write + dyn[..., n + 1]  # (B, T, n)
        # read (a_m^T H) and mix (A_r^T H) in one pass over the streams: row 0 reads, rows 1..n mix
        both = mix_matrix(torch.cat([read.unsqueeze(-2), mix.transpose(-1, -2)], dim=-2), H)
        out = sublayer_fn(both[..., 0, :])
        H = both[..., 1:, :] + write.unsqueeze(-1) * out.unsqueeze(-2)
        return H, mix.transpose(-1, -2)  # the matrix acting on the streams: H <- A_r^T H + ...


class HCBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        n = int(cfg.arch_options.get("n_streams", 4))
        first = 2 * (layer_index - 1)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn_hc = HyperConnection(cfg.d_model, n, first, cfg.norm_eps)
        self.ffn_hc = HyperConnection(cfg.d_model, n, first + 1, cfg.norm_eps)

    def forward(self, H: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        H, mix_attn = self.attn_hc(H, lambda x: self.attn(self.attn_norm(x), rope))
        H, mix_ffn = self.ffn_hc(H, lambda x: self.ffn(self.ffn_norm(x)))
        if internals is not None:
            internals.setdefault("stream_mixing", []).extend([mix_attn, mix_ffn])
        return H


class MultiStreamLM(DecoderLM):
    """Shared by hc and mhc: n copies of the embedding in, the sum of streams out."""

    def init_state(self, h0: torch.Tensor) -> torch.Tensor:
        n = int(self.cfg.arch_options.get("n_streams", 4))
        # materialised: a stride-0 expanded view sends the first sublayer's matmuls down a
        # per-slice path (about 7% of a 32-layer forward on CPU)
        return h0.unsqueeze(-2).expand(*h0.shape[:-1], n, h0.shape[-1]).contiguous()

    def read_stream(self, state: torch.Tensor) -> torch.Tensor:
        return state.sum(dim=-2)


@register("hc")
class HyperConnections(MultiStreamLM):
    block_class = HCBlock
    has_final_norm = True

    def init_architecture(self) -> None:
        for block in self.blocks:
            first = 2 * (block.layer_index - 1)
            block.attn_hc.reset_static(first)
            block.ffn_hc.reset_static(first + 1)
