"""Shared by the multi-stream architectures (hc, mhc): the n-stream trunk state and its mixing.

The state is n residual streams H (B, T, n, d), all initialised to copies of the embedding; h_l
for the probes, and the trunk output, is the sum of the streams. A sublayer reads a weighted sum
of the streams, mixes them with an n x n matrix M and writes its output back with per-stream
weights: H <- M H + w^T F(read). `mix_matrix` and `write_streams` are that mixing and write in
PyTorch: the reference that depthbench.kernels' fast implementations are held to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthbench.models.base import GENERIC_PROBES, ArchOptions, DecoderLM
from depthbench.models.precision import autocast_off
from depthbench.util.errors import ConfigError


@dataclass(frozen=True)
class MultiStreamOptions(ArchOptions):
    n_streams: int = 4  # n residual streams (hc, mhc)

    def __post_init__(self) -> None:
        if not isinstance(self.n_streams, int) or self.n_streams < 1:
            raise ConfigError(
                "model.arch_options.n_streams",
                f"must be a positive integer, got {self.n_streams!r}",
            )


def write_streams(mixed: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """H_i = mixed_i + b_i out for every stream i: the write of a sublayer's output."""
    return torch.addcmul(mixed, b.unsqueeze(-1), out.unsqueeze(-2))


def mix_matrix(M: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """(M H)_j = sum_i M_ji H_i: (B, T, m, n) x (B, T, n, d) -> (B, T, m, d).

    One batched matmul of per-token m x n matrices: faster than n multiply-adds of whole streams
    or a broadcast product, which materialises an (m, n, d) tensor per token
    (benchmarks/stream_mix.py; docs/benchmarks.md, "Stream mixing").
    """
    return BatchedMix.apply(M, H)


class BatchedMix(torch.autograd.Function):
    """M @ H over per-token matrices, with every operand of the three batched matmuls made
    contiguous (forward and backward): on CPU a strided batch, such as a permuted view or the
    stride-0 gradient that a sum over streams sends back, runs as a per-matrix loop.

    Computed in the promoted dtype with autocast off, as the element-wise mixing it stands for:
    under bf16 autocast the residual streams stay in fp32 (a bf16 matmul would round them)."""

    @staticmethod
    def forward(ctx, M: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(M.dtype, H.dtype)
        M, H = M.to(dtype).contiguous(), H.to(dtype).contiguous()
        ctx.save_for_backward(M, H)
        with autocast_off(H.device.type):  # on meta: the memory trace's replay pauses
            return M @ H

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        M, H = ctx.saved_tensors
        grad = grad.to(M.dtype).contiguous()
        grad_M = grad @ H.mT if ctx.needs_input_grad[0] else None
        grad_H = M.mT @ grad if ctx.needs_input_grad[1] else None
        return grad_M, grad_H


class MultiStreamLM(DecoderLM):
    """Shared by hc and mhc: n copies of the embedding in, the sum of streams out."""

    probes = GENERIC_PROBES | {"residual_product_rank"}
    figures = frozenset({"residual_product_rank"})
    Options = MultiStreamOptions

    def init_state(self, h0: torch.Tensor) -> torch.Tensor:
        n = self.options.n_streams
        # materialised: every later op then reads contiguous streams, not a stride-0 view
        return h0.unsqueeze(-2).expand(*h0.shape[:-1], n, h0.shape[-1]).contiguous()

    def read_stream(self, state: torch.Tensor) -> torch.Tensor:
        return state.sum(dim=-2)

    def read_and_mix_flops(self) -> float:
        """The read and mix of the streams, one (n + 1) x n by n x d product per token per
        sublayer: 2 (n + 1) n d each, over 2L sublayers."""
        n, d = self.options.n_streams, self.cfg.d_model
        return 2 * self.cfg.n_layer * 2.0 * (n + 1) * n * d

    def depth_state_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """The n streams a decode step carries through depth."""
        return self.options.n_streams * self.cfg.d_model * bytes_per_value
