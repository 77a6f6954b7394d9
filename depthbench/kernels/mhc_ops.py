"""Autograd and custom-op wrappers for mHC's C++ kernels (depthbench/kernels/mhc.cpp).

- `read(H, weight, scale, bias, eps, iterations)`: mHC's whole read from the streams, the custom
  op `depthbench::mhc_read` under torch.compile, a plain autograd Function in eager mode.
- `fused_coefficients(u, n, iterations)`: the coefficients alone from their pre-activations
  (bf16 streams on the CPU), the custom op `depthbench::mhc_coefficients`.
"""

from __future__ import annotations

import torch

from depthbench import kernels


@torch.library.custom_op("depthbench::mhc_coefficients", mutates_args=(), device_types="cpu")
def fused_coefficients(
    u: torch.Tensor, n: int, iterations: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """u (N, 2n + n^2) -> coeff (N, n + 1, n) = [H_pre; H_res], post (N, n) = H_post in one C++
    kernel (depthbench/kernels/mhc.cpp): the sigmoids, the stabilised exp, the Sinkhorn
    iterations and the layout, which eager PyTorch runs as some 25 small kernels forward and more
    backward per sublayer. Backward recomputes from u. A torch custom op, so that
    `torch.compile` keeps it as one call (inductor would otherwise unroll the 20 iterations)."""
    coeff, post = kernels.cpu_kernels().mhc_coefficients_forward(u, n, iterations)
    return coeff, post


@fused_coefficients.register_fake
def _(u, n, iterations):
    return u.new_empty(u.shape[0], n + 1, n), u.new_empty(u.shape[0], n)


@torch.library.custom_op(
    "depthbench::mhc_coefficients_backward", mutates_args=(), device_types="cpu"
)
def fused_coefficients_backward(
    u: torch.Tensor, grad_coeff: torch.Tensor, grad_post: torch.Tensor, n: int, iterations: int
) -> torch.Tensor:
    return kernels.cpu_kernels().mhc_coefficients_backward(
        u, grad_coeff.contiguous(), grad_post.contiguous(), n, iterations
    )


@fused_coefficients_backward.register_fake
def _(u, grad_coeff, grad_post, n, iterations):
    return torch.empty_like(u)


def _save_for_coefficients_backward(ctx, inputs, output):
    u, ctx.n, ctx.iterations = inputs
    ctx.save_for_backward(u)


def _coefficients_backward(ctx, grad_coeff, grad_post):
    (u,) = ctx.saved_tensors
    N, n = u.shape[0], ctx.n
    grad_coeff = u.new_zeros(N, n + 1, n) if grad_coeff is None else grad_coeff
    grad_post = u.new_zeros(N, n) if grad_post is None else grad_post
    return fused_coefficients_backward(u, grad_coeff, grad_post, n, ctx.iterations), None, None


fused_coefficients.register_autograd(
    _coefficients_backward, setup_context=_save_for_coefficients_backward
)


@torch.library.custom_op("depthbench::mhc_read", mutates_args=(), device_types="cpu")
def fused_read(
    H: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    iterations: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC's read in one C++ kernel (depthbench/kernels/mhc.cpp): from the streams H (N, n, d),
    the folded projection weight (2n + n^2, n d) (Phi^T times the norm's gain) and the per-column
    gain and bias of u = gain * (N(flatten(H)) Phi) + bias (2n + n^2 each), the sublayer input x
    (N, d), the mixed streams (N, n, d), [H_pre; H_res] (N, n + 1, n) and H_post (N, n); and
    the projections h weight^T (N, 2n + n^2), returned for the backward only (no gradient flows
    back through them). Backward recomputes the rest from the inputs. A torch custom op, so that
    torch.compile keeps it as one call."""
    x, mixed, coeff, post, proj = kernels.cpu_kernels().mhc_read_forward(
        H, weight, scale, bias, eps, iterations
    )
    return x, mixed, coeff, post, proj


@fused_read.register_fake
def _(H, weight, scale, bias, eps, iterations):
    N, n, d = H.shape
    return (
        H.new_empty(N, d),
        H.new_empty(N, n, d),
        H.new_empty(N, n + 1, n),
        H.new_empty(N, n),
        H.new_empty(N, 2 * n + n * n),
    )


@torch.library.custom_op("depthbench::mhc_read_backward", mutates_args=(), device_types="cpu")
def fused_read_backward(
    H: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    iterations: int,
    coeff: torch.Tensor,
    proj: torch.Tensor,
    grad_x: torch.Tensor,
    grad_mixed: torch.Tensor,
    grad_coeff: torch.Tensor,
    grad_post: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = kernels.cpu_kernels().mhc_read_backward(
        H,
        weight,
        scale,
        bias,
        eps,
        iterations,
        coeff,
        proj,
        grad_x.contiguous(),
        grad_mixed.contiguous(),
        grad_coeff.contiguous(),
        grad_post.contiguous(),
    )
    return tuple(grads)


@fused_read_backward.register_fake
def _(
    H, weight, scale, bias, eps, iterations, coeff, proj, grad_x, grad_mixed, grad_coeff, grad_post
):
    return (
        torch.empty_like(H),
        torch.empty_like(weight),
        torch.empty_like(scale),
        torch.empty_like(bias),
    )


def _save_for_read_backward(ctx, inputs, output):
    H, weight, scale, bias, ctx.eps, ctx.iterations = inputs
    ctx.save_for_backward(H, weight, scale, bias, output[2], output[4])


def _read_backward(ctx, grad_x, grad_mixed, grad_coeff, grad_post, grad_proj):
    H, weight, scale, bias, coeff, proj = ctx.saved_tensors
    N, n, d = H.shape
    grad_x = H.new_zeros(N, d) if grad_x is None else grad_x
    grad_mixed = H.new_zeros(N, n, d) if grad_mixed is None else grad_mixed
    grad_coeff = H.new_zeros(N, n + 1, n) if grad_coeff is None else grad_coeff
    grad_post = H.new_zeros(N, n) if grad_post is None else grad_post
    grads = fused_read_backward(
        H,
        weight,
        scale,
        bias,
        ctx.eps,
        ctx.iterations,
        coeff,
        proj,
        grad_x,
        grad_mixed,
        grad_coeff,
        grad_post,
    )
    return (*grads, None, None)


fused_read.register_autograd(_read_backward, setup_context=_save_for_read_backward)


class _EagerRead(torch.autograd.Function):
    """`fused_read` for eager mode: the same kernels through a plain autograd Function, whose
    per-call overhead is a fraction of a torch.library custom op's. torch.compile gets the custom
    op (see `read`)."""

    @staticmethod
    def forward(ctx, H, weight, scale, bias, eps, iterations):
        x, mixed, coeff, post, proj = kernels.cpu_kernels().mhc_read_forward(
            H, weight, scale, bias, eps, iterations
        )
        ctx.eps, ctx.iterations = eps, iterations
        ctx.save_for_backward(H, weight, scale, bias, coeff, proj)
        ctx.mark_non_differentiable(proj)
        return x, mixed, coeff, post, proj

    @staticmethod
    def backward(ctx, grad_x, grad_mixed, grad_coeff, grad_post, grad_proj):
        H, weight, scale, bias, coeff, proj = ctx.saved_tensors
        grads = kernels.cpu_kernels().mhc_read_backward(
            H,
            weight,
            scale,
            bias,
            ctx.eps,
            ctx.iterations,
            coeff,
            proj,
            grad_x.contiguous(),
            grad_mixed.contiguous(),
            grad_coeff.contiguous(),
            grad_post.contiguous(),
        )
        return (*grads, None, None)


def read(H, weight, scale, bias, eps: float, iterations: int):
    """mHC's fused read: the custom op under torch.compile and on the meta device (its fake
    implementation, for the memory estimate's trace: it saves what the Function saves), the
    Function in eager mode."""
    if torch.compiler.is_compiling() or H.is_meta:
        return fused_read(H, weight, scale, bias, eps, iterations)
    return _EagerRead.apply(H, weight, scale, bias, eps, iterations)
