"""Manifold-constrained Hyper-Connections (DeepSeek, arXiv 2512.24880).

Same n-stream state as `hc`. For each sublayer, from x = N(flatten(H)) (one RMSNorm over all
n*d values):

    H_pre  = sigmoid(g_pre * (x Phi_pre) + b_pre)                     (n, non-negative)
    H_post = 2 sigmoid(g_post * (x Phi_post) + b_post)                (n, in (0, 2))
    H_res  = SinkhornKnopp(exp(g_res * mat(x Phi_res) + b_res))       (n x n, doubly stochastic)
    H     <- H_res H + H_post^T F(N(H_pre H))

g_* are learnable scalars initialised to 0.01 and Phi_* zero-initialised, so at init the
coefficients are those of the biases. b_pre is one-hot at s mod n and b_post ones in both
starts; `arch_options.res_init` picks b_res:

- `identity` (default): logit 0 on the diagonal, `IDENTITY_OFF_DIAGONAL_LOGIT` = -8 off it, so
  H_res starts within 1.1e-3 of I (n = 4: diagonal 0.99899, off-diagonal 3.4e-4) and the
  residual product over depth has effective rank n at init (3.99996 at 2L = 8 sublayers, 3.992
  at 104).
- `hc_static`: b_res = I as logits (HC's static values): H_res starts at 0.475 on the diagonal
  and 0.175 off it (n = 4), and the residual product over depth is near rank 1 before training.

Why `identity` is the default: the paper does not state the bias init (as far as we found);
its argument is that mHC restores the identity mapping of the residual stream, which the
identity start gives from step 0 (tokenbender/mHC-manifold-constrained-hyper-connections also
starts there: diagonal logits 0, off-diagonal -8 before its temperature), while the `hc_static`
start (lucidrains/hyper-connections' identity logits) mixes the streams to rank 1 before any
training, so the paper's rank finding could not be told from the init. -8 rather than lower:
the gradient reaching H_res's logits scales with the off-diagonal mass e^-8 = 3.4e-4 (50x more
than at -12, where it measured below Adam's epsilon on a tiny model at init). The cost: near the
identity, 20 Sinkhorn iterations leave row-sum errors of the order of the off-diagonal mass
times the logit noise (7e-4 at noise 0.1, 6e-3 at 0.45; exact at init;
docs/design/architectures.md).

Sinkhorn-Knopp runs 20 alternating row and column normalisations (stabilised, see
`sinkhorn_knopp`), so the result's columns sum to 1 exactly and its rows to within a tolerance
that shrinks with the iterations.
`internals["stream_mixing"]` records H_res of every sublayer, (B, T, n, n).

This module is the definition, in PyTorch (the Sinkhorn iterations are one custom op,
depthbench/models/sinkhorn.py). Faster implementations of `ManifoldHyperConnection` (a C++ read
on the CPU, Liger-Kernel's Triton kernels on CUDA) are swapped in from outside by
depthbench.kernels.swap and held to it by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from depthbench.models.base import Block, Rope
from depthbench.models.layers import RMSNorm, at_least_fp32, normed_linear
from depthbench.models.registry import register
from depthbench.models.sinkhorn import sinkhorn_knopp
from depthbench.models.streams import MultiStreamLM, MultiStreamOptions, mix_matrix, write_streams
from depthbench.util.errors import ConfigError

RES_INITS = ("identity", "hc_static")  # arch_options.res_init
IDENTITY_OFF_DIAGONAL_LOGIT = -8.0  # b_res off the diagonal under res_init = identity
GAIN_INIT = 0.01  # g_pre, g_post, g_res


@dataclass(frozen=True)
class MHCOptions(MultiStreamOptions):
    sinkhorn_iterations: int = 20  # alternating row and column normalisations of H_res
    res_init: str = (
        "identity"  # the start of b_res: identity (H_res ~ I) or hc_static (HC's static weights)
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("res_init", RES_INITS)
        if not isinstance(self.sinkhorn_iterations, int) or self.sinkhorn_iterations < 1:
            raise ConfigError(
                "model.arch_options.sinkhorn_iterations",
                f"must be a positive integer, got {self.sinkhorn_iterations!r}",
            )


class ManifoldHyperConnection(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_streams: int,
        sublayer: int,
        eps: float,
        iterations: int,
        start: str = MHCOptions.res_init,
    ):
        super().__init__()
        n = n_streams
        self.n, self.sublayer, self.iterations, self.start = n, sublayer, iterations, start
        self.norm = RMSNorm(n * d_model, eps)
        self.phi = nn.Linear(
            n * d_model, 2 * n + n * n, bias=False
        )  # [Phi_pre | Phi_post | Phi_res]
        self.gains = nn.Parameter(torch.full((3,), GAIN_INIT))  # g_pre, g_post, g_res
        self.b_pre = nn.Parameter(torch.zeros(n))
        self.b_post = nn.Parameter(torch.zeros(n))
        self.b_res = nn.Parameter(torch.zeros(n, n))  # set by reset(), from init_architecture

    def reset(self) -> None:
        n = self.n
        with torch.no_grad():
            self.phi.weight.zero_()
            self.gains.fill_(GAIN_INIT)
            self.b_pre.zero_()
            self.b_pre[self.sublayer % n] = 1.0
            self.b_post.fill_(1.0)
            if self.start == "identity":  # exp(b_res) = I + e^-8 (1 - I): Sinkhorn keeps it ~ I
                self.b_res.fill_(IDENTITY_OFF_DIAGONAL_LOGIT).fill_diagonal_(0.0)
            else:  # hc_static
                self.b_res.copy_(torch.eye(n))

    def gains_and_biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-column gain and bias of u = g * (x Phi) + b, each (2n + n^2,) in the layout
        [pre | post | res]: g_pre, g_post or g_res repeated over its columns (at least fp32)."""
        n = self.n
        gains = at_least_fp32(self.gains).repeat_interleave(
            torch.tensor([n, n, n * n]), output_size=2 * n + n * n
        )
        return gains, torch.cat([self.b_pre, self.b_post, self.b_res.reshape(-1)])

    def coefficients(
        self, H: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """H_pre (B, T, n), H_post (B, T, n) and H_res (B, T, n, n) from the streams (B, T, n, d),
        at least fp32."""
        B, T, n, d = H.shape
        # N(flatten(H)) Phi without materialising the normalised state
        z = normed_linear(H.reshape(B, T, n * d), self.norm, self.phi)
        g_pre, g_post, g_res = at_least_fp32(self.gains)
        pre = torch.sigmoid(g_pre * z[..., :n] + self.b_pre)
        post = 2.0 * torch.sigmoid(g_post * z[..., n : 2 * n] + self.b_post)
        res = sinkhorn_knopp(g_res * z[..., 2 * n :].view(B, T, n, n) + self.b_res, self.iterations)
        return pre, post, res

    def forward(self, H: torch.Tensor, sublayer_fn: Callable[[torch.Tensor], torch.Tensor]):
        n = self.n
        pre, post, res = self.coefficients(H)
        # read (H_pre H) and mix (H_res H) in one batched matmul: row 0 reads, rows 1..n mix
        coeff = torch.cat([pre.unsqueeze(-2), res], dim=-2).to(H.dtype)  # the streams' dtype
        x, mixed = mix_matrix(coeff, H).split([1, n], dim=-2)
        out = sublayer_fn(x.squeeze(-2))
        H = write_streams(mixed, post.to(H.dtype), out)  # + H_post^T F(...)
        return H, res


class MHCBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        options = MHCOptions.of(cfg)
        n, iters, start = options.n_streams, options.sinkhorn_iterations, options.res_init
        first = 2 * (layer_index - 1)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn_mhc = ManifoldHyperConnection(cfg.d_model, n, first, cfg.norm_eps, iters, start)
        self.ffn_mhc = ManifoldHyperConnection(
            cfg.d_model, n, first + 1, cfg.norm_eps, iters, start
        )

    def forward(self, H: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        H, res_attn = self.attn_mhc(H, lambda x: self.attn(self.attn_norm(x), rope))
        H, res_ffn = self.ffn_mhc(H, lambda x: self.ffn(self.ffn_norm(x)))
        if internals is not None:
            internals.setdefault("stream_mixing", []).extend([res_attn, res_ffn])
        return H


@register("mhc")
class ManifoldHyperConnections(MultiStreamLM):
    block_class = MHCBlock
    has_final_norm = True
    Options = MHCOptions

    def init_architecture(self) -> None:
        for block in self.blocks:
            block.attn_mhc.reset()
            block.ffn_mhc.reset()

    def extra_flops_per_token(self, seq_len: int) -> float:
        """The read and mix of the streams (the projection Phi is an nn.Linear, in N_mm)."""
        return self.read_and_mix_flops()
