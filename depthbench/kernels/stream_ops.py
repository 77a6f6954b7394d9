"""Autograd and custom-op wrappers for the multi-stream write after a fused CPU read (hc, mhc).

`write_after_read(mixed, weights, out, shape)`: H = mixed + weights^T out after a fused read, in
place in eager mode (`_EagerWrite`), the custom op `depthbench::stream_write` under
torch.compile; its backward is one C++ pass (`stream_write_backward`, depthbench/kernels/hc.cpp).
H comes back in the streams' shape (B, T, n, d) as a tensor of its own, not a view.
"""

from __future__ import annotations

import torch

from depthbench import kernels


@torch.library.custom_op("depthbench::stream_write", mutates_args=(), device_types="cpu")
def fused_write(mixed: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """H = mixed + weights^T out on (N, n, d), (N, n), (N, d): addcmul forward, and a backward in
    one C++ pass (depthbench/kernels/hc.cpp) where autograd through addcmul makes four."""
    return torch.addcmul(mixed, weights.unsqueeze(-1), out.unsqueeze(-2))


@fused_write.register_fake
def _(mixed, weights, out):
    return torch.empty_like(mixed)


@torch.library.custom_op("depthbench::stream_write_backward", mutates_args=(), device_types="cpu")
def fused_write_backward(
    grad: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_weights, grad_out = kernels.cpu_kernels().stream_write_backward(
        grad.contiguous(), weights, out
    )
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


def write_after_read(
    mixed: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """The write H = mixed + weights^T out after a fused read: mixed (N, n, d) straight from the
    read kernel (not a view), weights (N, n), out (N, d), cast to the streams' dtype (under
    autocast the sublayer returns bf16; addcmul would promote it the same way). In place in eager
    mode, the custom op under torch.compile.

    H is returned in `shape` (B, T, n, d) by `_unsafe_view`: the same memory, no copy, but not a
    view of the (N, n, d) tensor, which nothing else holds. A block returns these streams, and
    FSDP2 puts a unit's pre-backward hook (the all-gather of its parameters for backward) on its
    output: an in-place op on a view output would drop that hook, so FSDP2 warns on views."""
    weights, out = weights.to(mixed.dtype), out.to(mixed.dtype)
    if torch.compiler.is_compiling():
        H = fused_write(mixed, weights, out)
    else:
        H = _EagerWrite.apply(mixed, weights, out)
    return torch.ops.aten._unsafe_view(H, shape)
