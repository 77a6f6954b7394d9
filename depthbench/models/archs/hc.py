"""Hyper-Connections, dynamic variant (Zhu et al., ICLR 2025, arXiv 2409.19606).

The residual stream is widened to n streams H (n x d), all initialised to copies of the
embedding. For sublayer s (0-based over the 2L sublayers), with Hn = N(H) per stream:

    a_m = onehot(s mod n) + s_alpha tanh(Hn w_m)     read weights       (n)
    A_r = I_n             + s_alpha tanh(Hn W_r)     stream mixing      (n x n)
    b   = 1_n             + s_beta  tanh(Hn w_b)     write weights      (n)
    H  <- A_r^T H + b^T F(N(a_m^T H))

The static parts (one-hot, identity, ones) are learnable parameters initialised to those
values; the dynamic projections w_m, W_r, w_b are zero-initialised; s_alpha (read and mixing)
and s_beta (write) are learnable scalars per sublayer initialised at `DYNAMIC_SCALE_INIT` = 0.01,
as in the HC paper and lucidrains/hyper-connections (not weight-decayed: only Linear weights
are). The model output is the sum of streams, then the final norm and LM head; h_l for probes
is the sum of streams. With n = 1 and zero dynamic weights this is exactly Pre-LN.
`internals["stream_mixing"]` records, for every sublayer, the matrix acting on the streams,
A_r^T (B, T, n, n), as mhc records H_res: both read H <- M H + ...

This module is the definition, in PyTorch. Faster implementations of `HyperConnection` (a C++
read on the CPU, Triton kernels on CUDA) are swapped in from outside by depthbench.kernels.swap
and held to it by the tests.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from depthbench.models.base import Block, Rope
from depthbench.models.layers import RMSNorm, normed_linear
from depthbench.models.registry import register
from depthbench.models.streams import MultiStreamLM, MultiStreamOptions, mix_matrix, write_streams

DYNAMIC_SCALE_INIT = 0.01  # s_alpha and s_beta at init (HC paper; lucidrains/hyper-connections)


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
        # shape (1,), not a 0-dim scalar: FSDP2 shards every parameter along dim 0
        self.s_alpha = nn.Parameter(
            torch.full((1,), DYNAMIC_SCALE_INIT)
        )  # scales tanh(.) of w_m and W_r
        self.s_beta = nn.Parameter(torch.full((1,), DYNAMIC_SCALE_INIT))  # scales tanh(.) of w_b
        self.n = n

    def reset_static(self, sublayer: int) -> None:
        with torch.no_grad():
            self.static_read.zero_()
            self.static_read[sublayer % self.n] = 1.0
            self.static_mix.copy_(torch.eye(self.n))
            self.static_write.fill_(1.0)
            self.dynamic.weight.zero_()
            self.s_alpha.fill_(DYNAMIC_SCALE_INIT)
            self.s_beta.fill_(DYNAMIC_SCALE_INIT)

    def scales(self) -> torch.Tensor:
        """The dynamic scale of each coefficient column [a_m | A_r | b], (n + 2,): s_alpha n + 1
        times, then s_beta (autograd sums the columns' gradients back into the two scalars)."""
        return torch.cat([self.s_alpha.expand(self.n + 1), self.s_beta])

    def static(self) -> torch.Tensor:
        """Row i = stream i's static [a_m,i | A_r[i, :] | b_i], (n, n + 2)."""
        return torch.cat(
            [self.static_read[:, None], self.static_mix, self.static_write[:, None]], dim=1
        )

    def coefficients(self, H: torch.Tensor) -> torch.Tensor:
        """Row i = stream i's [a_m,i | A_r[i, :] | b_i] (B, T, n, n + 2): the static part plus
        the bounded dynamic part, in the streams' dtype."""
        proj = normed_linear(H, self.norm, self.dynamic)  # N(H_i) W per stream: (B, T, n, n + 2)
        return (self.static() + self.scales() * torch.tanh(proj)).to(H.dtype)

    def forward(self, H: torch.Tensor, sublayer_fn: Callable[[torch.Tensor], torch.Tensor]):
        n = self.n
        coeff = self.coefficients(H)
        # read (a_m^T H) and mix (A_r^T H) in one batched matmul: row 0 reads, rows 1..n mix
        x, mixed = mix_matrix(coeff[..., : n + 1].mT, H).split([1, n], dim=-2)
        out = sublayer_fn(x.squeeze(-2))
        H = write_streams(mixed, coeff[..., n + 1], out)  # + b^T F(...)
        return H, coeff[..., 1 : n + 1].mT  # the matrix acting on the streams: H <- A_r^T H + ...


class HCBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        n = MultiStreamOptions.of(cfg).n_streams
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


@register("hc")
class HyperConnections(MultiStreamLM):
    block_class = HCBlock
    has_final_norm = True

    def init_architecture(self) -> None:
        for block in self.blocks:
            first = 2 * (block.layer_index - 1)
            block.attn_hc.reset_static(first)
            block.ffn_hc.reset_static(first + 1)

    def extra_flops_per_token(self, seq_len: int) -> float:
        """The read and mix, and the dynamic projection, which multiplies all n streams, not one:
        2 (n - 1) d (n + 2) per sublayer beyond the n x (n + 2) block counted once in N_mm."""
        n, d = self.options.n_streams, self.cfg.d_model
        return self.read_and_mix_flops() + 2 * self.cfg.n_layer * 2.0 * (n - 1) * d * (n + 2)
