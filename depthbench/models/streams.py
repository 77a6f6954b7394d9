"""Shared by the multi-stream architectures (hc, mhc): the n-stream trunk state and its mixing.

The state is n residual streams H (B, T, n, d), all initialised to copies of the embedding; h_l
for the probes, and the trunk output, is the sum of the streams. A sublayer reads a weighted sum
of the streams, mixes them with an n x n matrix M and writes its output back with per-stream
weights: H <- M H + w^T F(read). `mix_matrix` and `write_streams` are that mixing and write in
PyTorch; after a fused CPU read the write is `write_after_read` (depthbench/kernels/stream_ops.py).
"""

from __future__ import annotations

import torch

from depthbench.kernels.stream_ops import BatchedMix, write_after_read
from depthbench.models.base import GENERIC_PROBES, DecoderLM

__all__ = ["N_STREAMS", "MultiStreamLM", "mix_matrix", "n_streams", "write_after_read", "write_streams"]

N_STREAMS = 4  # default of arch_options.n_streams (hc, mhc)


def n_streams(cfg) -> int:
    """arch_options.n_streams, default `N_STREAMS`."""
    return int(cfg.arch_options.get("n_streams", N_STREAMS))


def write_streams(mixed: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """H_i = mixed_i + b_i out for every stream i: the write of a sublayer's output (the PyTorch
    code; after a fused read, `write_after_read`)."""
    return torch.addcmul(mixed, b.unsqueeze(-1), out.unsqueeze(-2))


def mix_matrix(M: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """(M H)_j = sum_i M_ji H_i: (B, T, m, n) x (B, T, n, d) -> (B, T, m, d).

    One batched matmul of per-token m x n matrices. On CPU (torch 2.13, 2 threads, 2048 tokens,
    n = 4) it beats n multiply-adds of whole streams by 3.3x forward + backward at d = 64 and by
    4.8x at d = 256 (benchmarks/stream_mix.py), and a broadcast product, which materialises an
    (m, n, d) tensor per token, by more.
    """
    return BatchedMix.apply(M, H)


class MultiStreamLM(DecoderLM):
    """Shared by hc and mhc: n copies of the embedding in, the sum of streams out."""

    probes = GENERIC_PROBES | {"residual_product_rank"}
    figures = frozenset({"residual_product_rank"})

    def init_state(self, h0: torch.Tensor) -> torch.Tensor:
        n = n_streams(self.cfg)
        # materialised: every later op then reads contiguous streams, not a stride-0 view
        return h0.unsqueeze(-2).expand(*h0.shape[:-1], n, h0.shape[-1]).contiguous()

    def read_stream(self, state: torch.Tensor) -> torch.Tensor:
        return state.sum(dim=-2)
