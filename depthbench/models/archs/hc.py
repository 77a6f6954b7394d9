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

On the CPU (float32/float64, up to 16 streams) the whole read, from H to the sublayer input, the
mixed streams and the coefficients, runs in one C++ kernel per direction (`fused_read`,
depthbench/kernels/hc.cpp), also under torch.compile; elsewhere, or where the kernels cannot be
built, the PyTorch code below computes the same numbers.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from depthbench import kernels
from depthbench.models.base import GENERIC_PROBES, Block, DecoderLM, Rope, register
from depthbench.models.layers import RMSNorm, normed_linear

DYNAMIC_SCALE = 0.01
KERNEL_MAX_STREAMS = 16  # hc.cpp's limit


@torch.library.custom_op("depthbench::hc_read", mutates_args=(), device_types="cpu")
def fused_read(H: torch.Tensor, weight: torch.Tensor, static: torch.Tensor, eps: float,
               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HC's read in one C++ kernel (depthbench/kernels/hc.cpp): from the streams H (N, n, d), the
    folded dynamic weight (n + 2, d) (projection times the norm's gain) and the static weights
    (n, n + 2), the sublayer input x (N, d), the mixed streams (N, n, d) and the coefficients
    (N, n, n + 2) = static + scale * tanh(N(H_i) weight^T). Eager PyTorch runs this as about ten
    kernels forward and twenty backward, each a pass over the n-wide state. Backward recomputes
    from the inputs. A torch custom op, so that torch.compile keeps it as one call."""
    x, mixed, coeff = kernels.cpu_kernels().hc_read_forward(H, weight, static, eps, scale)
    return x, mixed, coeff


@fused_read.register_fake
def _(H, weight, static, eps, scale):
    N, n, d = H.shape
    return H.new_empty(N, d), H.new_empty(N, n, d), H.new_empty(N, n, n + 2)


@torch.library.custom_op("depthbench::hc_read_backward", mutates_args=(), device_types="cpu")
def fused_read_backward(H: torch.Tensor, weight: torch.Tensor, static: torch.Tensor, eps: float, scale: float,
                        grad_x: torch.Tensor, grad_mixed: torch.Tensor,
                        grad_coeff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_H, grad_weight, grad_static = kernels.cpu_kernels().hc_read_backward(
        H, weight, static, eps, scale, grad_x.contiguous(), grad_mixed.contiguous(), grad_coeff.contiguous())
    return grad_H, grad_weight, grad_static


@fused_read_backward.register_fake
def _(H, weight, static, eps, scale, grad_x, grad_mixed, grad_coeff):
    return torch.empty_like(H), torch.empty_like(weight), torch.empty_like(static)


def _save_for_read_backward(ctx, inputs, output):
    H, weight, static, ctx.eps, ctx.scale = inputs
    ctx.save_for_backward(H, weight, static)


def _read_backward(ctx, grad_x, grad_mixed, grad_coeff):
    H, weight, static = ctx.saved_tensors
    N, n, d = H.shape
    grad_x = H.new_zeros(N, d) if grad_x is None else grad_x
    grad_mixed = H.new_zeros(N, n, d) if grad_mixed is None else grad_mixed
    grad_coeff = H.new_zeros(N, n, n + 2) if grad_coeff is None else grad_coeff
    return (*fused_read_backward(H, weight, static, ctx.eps, ctx.scale, grad_x, grad_mixed, grad_coeff), None, None)


fused_read.register_autograd(_read_backward, setup_context=_save_for_read_backward)


class _EagerRead(torch.autograd.Function):
    """`fused_read` for eager mode: the same kernels through a plain autograd Function, whose
    per-call overhead is a fraction of a torch.library custom op's (about 0.1 ms less per
    forward and backward). torch.compile gets the custom op (see `read`)."""

    @staticmethod
    def forward(ctx, H, weight, static, eps, scale):
        ctx.eps, ctx.scale = eps, scale
        ctx.save_for_backward(H, weight, static)
        return tuple(kernels.cpu_kernels().hc_read_forward(H, weight, static, eps, scale))

    @staticmethod
    def backward(ctx, grad_x, grad_mixed, grad_coeff):
        H, weight, static = ctx.saved_tensors
        grads = kernels.cpu_kernels().hc_read_backward(H, weight, static, ctx.eps, ctx.scale, grad_x.contiguous(),
                                                       grad_mixed.contiguous(), grad_coeff.contiguous())
        return (*grads, None, None)


def read(H, weight, static, eps: float, scale: float):
    """HC's fused read: the custom op under torch.compile, the Function in eager mode."""
    if torch.compiler.is_compiling():
        return fused_read(H, weight, static, eps, scale)
    return _EagerRead.apply(H, weight, static, eps, scale)


@torch.library.custom_op("depthbench::stream_write", mutates_args=(), device_types="cpu")
def fused_write(mixed: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """H = mixed + weights^T out on (N, n, d), (N, n), (N, d): addcmul forward, and a backward in
    one C++ pass (depthbench/kernels/hc.cpp) where autograd through addcmul makes four."""
    return torch.addcmul(mixed, weights.unsqueeze(-1), out.unsqueeze(-2))


@fused_write.register_fake
def _(mixed, weights, out):
    return torch.empty_like(mixed)


@torch.library.custom_op("depthbench::stream_write_backward", mutates_args=(), device_types="cpu")
def fused_write_backward(grad: torch.Tensor, weights: torch.Tensor,
                         out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_weights, grad_out = kernels.cpu_kernels().stream_write_backward(grad.contiguous(), weights, out)
    return grad_weights, grad_out


@fused_write_backward.register_fake
def _(grad, weights, out):
    return torch.empty_like(weights), torch.empty_like(out)


def _save_for_write_backward(ctx, inputs, output):
    _, weights, out = inputs
    ctx.save_for_backward(weights, out)


def _write_backward(ctx, grad):
    weights, out = ctx.saved_tensors
    return grad, *fused_write_backward(grad, weights, out)


fused_write.register_autograd(_write_backward, setup_context=_save_for_write_backward)


class _EagerWrite(torch.autograd.Function):
    """`fused_write` for eager mode, in place: `mixed` is the fused read's fresh output, which no
    backward saves, so H takes its memory instead of a new (N, n, d) tensor per sublayer."""

    @staticmethod
    def forward(ctx, mixed, weights, out):
        ctx.save_for_backward(weights, out)
        ctx.mark_dirty(mixed)
        return mixed.addcmul_(weights.unsqueeze(-1), out.unsqueeze(-2))

    @staticmethod
    def backward(ctx, grad):
        weights, out = ctx.saved_tensors
        return grad, *kernels.cpu_kernels().stream_write_backward(grad.contiguous(), weights, out)


def write_after_read(mixed: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The write H = mixed + weights^T out after a fused read: mixed (N, n, d) straight from the
    read kernel (not a view), weights (N, n), out (N, d), cast to the streams' dtype (under
    autocast the sublayer returns bf16; addcmul would promote it the same way). In place in eager
    mode, the custom op under torch.compile."""
    weights, out = weights.to(mixed.dtype), out.to(mixed.dtype)
    if torch.compiler.is_compiling():
        return fused_write(mixed, weights, out)
    return _EagerWrite.apply(mixed, weights, out)


class _BatchedMix(torch.autograd.Function):
    """M @ H over per-token matrices, with every operand of the three batched matmuls made
    contiguous (forward and backward): on CPU a strided batch, such as a permuted view or the
    stride-0 gradient that a sum over streams sends back, runs as a per-matrix loop, 10x slower.

    Computed in the promoted dtype with autocast off, as the element-wise mixing it replaces:
    under bf16 autocast the residual streams stay in fp32 (a bf16 matmul would round them)."""

    @staticmethod
    def forward(ctx, M: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(M.dtype, H.dtype)
        M, H = M.to(dtype).contiguous(), H.to(dtype).contiguous()
        ctx.save_for_backward(M, H)
        with torch.autocast(H.device.type, enabled=False):
            return M @ H

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        M, H = ctx.saved_tensors
        grad = grad.to(M.dtype).contiguous()
        grad_M = grad @ H.mT if ctx.needs_input_grad[0] else None
        grad_H = M.mT @ grad if ctx.needs_input_grad[1] else None
        return grad_M, grad_H


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
    return _BatchedMix.apply(M, H)


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
        # row i = stream i's [a_m,i | A_r[i, :] | b_i]: static part + the bounded dynamic part
        static = torch.cat([self.static_read[:, None], self.static_mix, self.static_write[:, None]], dim=1)
        if n <= KERNEL_MAX_STREAMS and kernels.apply_to(H):
            B, T, _, d = H.shape
            weight = self.dynamic.weight * self.norm.weight  # N(H_i) W^T = (H_i (g * W)^T) / rms(H_i)
            x, mixed, coeff = read(H.reshape(B * T, n, d), weight.to(H.dtype), static.to(H.dtype),
                                   self.norm.eps, DYNAMIC_SCALE)
            out = sublayer_fn(x.view(B, T, d))
            H = write_after_read(mixed, coeff[..., n + 1], out.reshape(B * T, d))  # + b^T F(...)
            coeff = coeff.view(B, T, n, n + 2)
            return H.view(B, T, n, d), coeff[..., 1 : n + 1].mT
        proj = normed_linear(H, self.norm, self.dynamic)  # N(H_i) W per stream: (B, T, n, n + 2)
        coeff = (static + DYNAMIC_SCALE * torch.tanh(proj)).to(H.dtype)  # the streams keep their dtype
        # read (a_m^T H) and mix (A_r^T H) in one batched matmul: row 0 reads, rows 1..n mix
        x, mixed = mix_matrix(coeff[..., : n + 1].mT, H).split([1, n], dim=-2)
        out = sublayer_fn(x.squeeze(-2))
        H = write_streams(mixed, coeff[..., n + 1], out)  # + b^T F(...)
        return H, coeff[..., 1 : n + 1].mT  # the matrix acting on the streams: H <- A_r^T H + ...


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

    probes = GENERIC_PROBES | {"residual_product_rank"}
    figures = frozenset({"residual_product_rank"})

    def init_state(self, h0: torch.Tensor) -> torch.Tensor:
        n = int(self.cfg.arch_options.get("n_streams", 4))
        # materialised: every later op then reads contiguous streams, not a stride-0 view
        return h0.unsqueeze(-2).expand(*h0.shape[:-1], n, h0.shape[-1]).contiguous()

    def read_stream(self, state: torch.Tensor) -> torch.Tensor:
        return state.sum(dim=-2)

    def n_streams(self) -> int:
        return int(self.cfg.arch_options.get("n_streams", 4))

    def read_and_mix_flops(self) -> float:
        """The read and mix of the streams, one (n + 1) x n by n x d product per token per
        sublayer: 2 (n + 1) n d each, over 2L sublayers."""
        n, d = self.n_streams(), self.cfg.d_model
        return 2 * self.cfg.n_layer * 2.0 * (n + 1) * n * d

    def depth_state_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """The n streams a decode step carries through depth."""
        return self.n_streams() * self.cfg.d_model * bytes_per_value


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
        n, d = self.n_streams(), self.cfg.d_model
        return self.read_and_mix_flops() + 2 * self.cfg.n_layer * 2.0 * (n - 1) * d * (n + 2)
