"""Autograd and custom-op wrappers for HC's fused read (depthbench/kernels/hc.cpp).

`read(H, weight, static, scale, eps)` is what `depthbench.models.archs.hc` calls: the custom op
`depthbench::hc_read` under torch.compile (so that it stays one call), a plain autograd Function
in eager mode (less per-call overhead). Both run the same C++ kernels, forward and backward, and
both give gradients for every tensor input, the learnable dynamic scales included.
"""

from __future__ import annotations

import torch

from depthbench import kernels


@torch.library.custom_op("depthbench::hc_read", mutates_args=(), device_types="cpu")
def fused_read(
    H: torch.Tensor, weight: torch.Tensor, static: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HC's read in one C++ kernel (depthbench/kernels/hc.cpp): from the streams H (N, n, d), the
    folded dynamic weight (n + 2, d) (projection times the norm's gain), the static weights
    (n, n + 2) and the per-column dynamic scales (n + 2), the sublayer input x (N, d), the mixed
    streams (N, n, d) and the coefficients (N, n, n + 2) = static + scale * tanh(N(H_i) weight^T).
    Eager PyTorch runs this as about ten kernels forward and twenty backward, each a pass over
    the n-wide state. Backward recomputes from the inputs. A torch custom op, so that
    torch.compile keeps it as one call."""
    x, mixed, coeff = kernels.cpu_kernels().hc_read_forward(H, weight, static, scale, eps)
    return x, mixed, coeff


@fused_read.register_fake
def _(H, weight, static, scale, eps):
    N, n, d = H.shape
    return H.new_empty(N, d), H.new_empty(N, n, d), H.new_empty(N, n, n + 2)


@torch.library.custom_op("depthbench::hc_read_backward", mutates_args=(), device_types="cpu")
def fused_read_backward(
    H: torch.Tensor,
    weight: torch.Tensor,
    static: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    grad_x: torch.Tensor,
    grad_mixed: torch.Tensor,
    grad_coeff: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_H, grad_weight, grad_static, grad_scale = kernels.cpu_kernels().hc_read_backward(
        H,
        weight,
        static,
        scale,
        eps,
        grad_x.contiguous(),
        grad_mixed.contiguous(),
        grad_coeff.contiguous(),
    )
    return grad_H, grad_weight, grad_static, grad_scale


@fused_read_backward.register_fake
def _(H, weight, static, scale, eps, grad_x, grad_mixed, grad_coeff):
    return (
        torch.empty_like(H),
        torch.empty_like(weight),
        torch.empty_like(static),
        torch.empty_like(scale),
    )


def _save_for_read_backward(ctx, inputs, output):
    H, weight, static, scale, ctx.eps = inputs
    ctx.save_for_backward(H, weight, static, scale)


def _read_backward(ctx, grad_x, grad_mixed, grad_coeff):
    H, weight, static, scale = ctx.saved_tensors
    N, n, d = H.shape
    grad_x = H.new_zeros(N, d) if grad_x is None else grad_x
    grad_mixed = H.new_zeros(N, n, d) if grad_mixed is None else grad_mixed
    grad_coeff = H.new_zeros(N, n, n + 2) if grad_coeff is None else grad_coeff
    return (
        *fused_read_backward(H, weight, static, scale, ctx.eps, grad_x, grad_mixed, grad_coeff),
        None,
    )


fused_read.register_autograd(_read_backward, setup_context=_save_for_read_backward)


class _EagerRead(torch.autograd.Function):
    """`fused_read` for eager mode: the same kernels through a plain autograd Function, whose
    per-call overhead is a fraction of a torch.library custom op's (about 0.1 ms less per
    forward and backward). torch.compile gets the custom op (see `read`)."""

    @staticmethod
    def forward(ctx, H, weight, static, scale, eps):
        ctx.eps = eps
        ctx.save_for_backward(H, weight, static, scale)
        return tuple(kernels.cpu_kernels().hc_read_forward(H, weight, static, scale, eps))

    @staticmethod
    def backward(ctx, grad_x, grad_mixed, grad_coeff):
        H, weight, static, scale = ctx.saved_tensors
        grads = kernels.cpu_kernels().hc_read_backward(
            H,
            weight,
            static,
            scale,
            ctx.eps,
            grad_x.contiguous(),
            grad_mixed.contiguous(),
            grad_coeff.contiguous(),
        )
        return (*grads, None)


def read(H, weight, static, scale, eps: float):
    """HC's fused read: the custom op under torch.compile and on the meta device (its fake
    implementation, for the memory estimate's trace: it saves what the Function saves), the
    Function in eager mode."""
    if torch.compiler.is_compiling() or H.is_meta:
        return fused_read(H, weight, static, scale, eps)
    return _EagerRead.apply(H, weight, static, scale, eps)
