"""HC's and mHC's sublayer connections on CUDA, through Liger-Kernel's mHC Triton kernels.

Swapped in by depthbench.kernels.swap for `HyperConnection` and `ManifoldHyperConnection` on the
CUDA backend. Liger-Kernel (liger_kernel.ops.mhc, pinned in constraints.txt) fuses what the
PyTorch definition runs as many passes over the n-wide state:

- `normed_projection`: (x / rms(x)) phi, the RMS and the matmul in one kernel (Liger's
  `mhc_mm_norm_fwd` / `_bwd`). mHC projects the flattened streams (N, n d); HC projects each
  stream (N n, d), its RMSNorm being per stream. The norms' gains are folded into phi.
- `mhc_coefficients`: H_pre, H_post and H_res from the projection (`mhc_split_sinkhorn_fwd`:
  the sigmoids and the Sinkhorn iterations per token), with a backward that recomputes the
  iterations (`mhc_sinkhorn_bwd` without their history: no (N, iterations, n, n) tensor kept).
  HC's tanh coefficients stay in PyTorch: n (n + 2) values per token.
- `stream_read`: x = sum_i w_i H_i (`mhc_pre_fwd` / `_bwd`).
- `stream_write`: H_j <- sum_i M_ji H_i + p_j out (`mhc_post_res_fwd` / `_bwd`), HC's
  A_r^T and b or mHC's H_res and H_post.

Each is a torch custom op (forward and backward), so that torch.compile keeps it as one call,
`torch.library.opcheck` checks it, and the models' code never sees Triton. Liger's forms are
configured to match the definitions exactly: Sinkhorn with `sinkhorn_eps = 0` and `pre_eps = 0`,
`post_mult = 2`, the iteration count from `arch_options.sinkhorn_iterations`; its first
iteration is a row softmax, which equals the definition's shifted exp and row normalisation.
One difference stays: the definition clamps every logit at 60 below its row's maximum
(depthbench.models.sinkhorn) and Liger does not; the two agree unless a whole column of H_res's
logits lies more than 60 below the rows' maxima (far outside what mHC's gains of 0.01 produce).

The streams keep their dtype (fp32 under bf16 autocast, as the definition's; the kernels
accumulate in fp32 whatever they read). Liger's kernels index the n streams with tl.arange, so
n must be a power of two; otherwise the forward is the architecture's own.

On a CPU these kernels run under Triton's interpreter (TRITON_INTERPRET=1 set before triton is
imported), within `on_cpu()`: that is how the tests hold them to the definition in float32 and
float16. Elsewhere CPU tensors take the definition.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from typing import Callable

import torch

from depthbench.models.archs.hc import HyperConnection
from depthbench.models.archs.mhc import ManifoldHyperConnection
from depthbench.models.layers import at_least_fp32


_ON_CPU = False  # within on_cpu(): CPU tensors take the kernels, through the interpreter


@contextmanager
def on_cpu():
    """A region in which the kernels run on CPU tensors, in Triton's interpreter (which needs
    TRITON_INTERPRET=1 in the environment before triton is first imported)."""
    global _ON_CPU
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    _ON_CPU = True
    try:
        yield
    finally:
        _ON_CPU = False


def takes(t: torch.Tensor, n_streams: int) -> bool:
    """Whether the Triton kernels run on t: a CUDA tensor (a CPU one within `on_cpu()`), with a
    power-of-two number of streams. Not a meta tensor: the memory estimate traces the
    definitions, which keep more for backward than these ops (an upper bound) and are what the
    estimate is held to on a GPU (tests/data/h200_training_step_memory.json)."""
    return on_triton_device(t) and n_streams & (n_streams - 1) == 0


def on_triton_device(t: torch.Tensor) -> bool:
    """Whether Triton kernels run on t: a CUDA tensor, or a CPU one within `on_cpu()` (the
    interpreter)."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and _ON_CPU)


def _liger():
    from liger_kernel.ops import mhc

    return mhc


# --- (x / rms(x)) phi -------------------------------------------------------------------------


@torch.library.custom_op("depthbench::triton_normed_projection", mutates_args=())
def normed_projection(
    x: torch.Tensor, phi: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x)) phi for x (N, K), phi (K, M) -> (N, M) fp32, and 1 / rms(x) (N,) fp32, which
    the backward reuses (not differentiated)."""
    return _liger().mhc_mm_norm_fwd(x.contiguous(), phi.contiguous(), eps)


@normed_projection.register_fake
def _(x, phi, eps):
    return (
        x.new_empty(x.shape[0], phi.shape[1], dtype=torch.float32),
        x.new_empty(x.shape[0], dtype=torch.float32),
    )


@torch.library.custom_op("depthbench::triton_normed_projection_backward", mutates_args=())
def normed_projection_backward(
    x: torch.Tensor, phi: torch.Tensor, mix: torch.Tensor, inv_rms: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x, phi = x.contiguous(), phi.contiguous()
    grad_x, grad_phi = _liger().mhc_mm_norm_bwd(x, phi, mix, inv_rms, grad.float().contiguous())
    return grad_x.to(x.dtype), grad_phi.to(phi.dtype)


@normed_projection_backward.register_fake
def _(x, phi, mix, inv_rms, grad):
    return torch.empty_like(x), torch.empty_like(phi)


def _save_projection(ctx, inputs, output):
    x, phi, _ = inputs
    ctx.save_for_backward(x, phi, *output)


def _projection_backward(ctx, grad, _grad_inv_rms):
    x, phi, mix, inv_rms = ctx.saved_tensors
    grad_x, grad_phi = normed_projection_backward(x, phi, mix, inv_rms, grad)
    return grad_x, grad_phi, None


normed_projection.register_autograd(_projection_backward, setup_context=_save_projection)


# --- mHC's coefficients -----------------------------------------------------------------------


@torch.library.custom_op("depthbench::triton_mhc_coefficients", mutates_args=())
def mhc_coefficients(
    mix: torch.Tensor, bias: torch.Tensor, gains: torch.Tensor, iterations: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix (N, 2n + n^2) fp32, bias (2n + n^2,), gains (3,) = g_pre, g_post, g_res ->
    H_pre (N, n), H_post (N, n), H_res (N, n, n), fp32."""
    mix, bias, gains = mix.contiguous(), bias.float().contiguous(), gains.float().contiguous()
    pre, post, res = _liger().mhc_split_sinkhorn_fwd(
        mix,
        bias,
        gains[0:1],
        gains[1:2],
        gains[2:3],
        tmax=iterations,
        pre_eps=0.0,
        sinkhorn_eps=0.0,
        post_mult=2.0,
    )
    return pre, post, res


@mhc_coefficients.register_fake
def _(mix, bias, gains, iterations):
    N, M = mix.shape
    n = int(round((M + 1) ** 0.5)) - 1  # M = n^2 + 2n
    return (
        mix.new_empty(N, n, dtype=torch.float32),
        mix.new_empty(N, n, dtype=torch.float32),
        mix.new_empty(N, n, n, dtype=torch.float32),
    )


@torch.library.custom_op("depthbench::triton_sinkhorn_backward", mutates_args=())
def sinkhorn_backward(
    mix: torch.Tensor, bias: torch.Tensor, gain: torch.Tensor, grad: torch.Tensor, iterations: int
) -> torch.Tensor:
    """The gradient of H_res with respect to its logits g_res mix_res + b_res, (N, n, n): the
    iterations recomputed from the logits."""
    return _liger().mhc_sinkhorn_bwd(
        mix.contiguous(),
        bias.float().contiguous(),
        gain.float().contiguous(),
        grad.float().contiguous(),
        tmax=iterations,
        sinkhorn_eps=0.0,
    )


@sinkhorn_backward.register_fake
def _(mix, bias, gain, grad, iterations):
    return torch.empty_like(grad, dtype=torch.float32)


def _save_coefficients(ctx, inputs, output):
    mix, bias, gains, ctx.iterations = inputs
    pre, post, _ = output
    ctx.save_for_backward(mix, bias, gains, pre, post)


def _coefficients_backward(ctx, grad_pre, grad_post, grad_res):
    """Through H_pre = sigmoid(u_pre), H_post = 2 sigmoid(u_post) and H_res = Sinkhorn(u_res),
    u = g * mix + b per block of columns."""
    mix, bias, gains, pre, post = ctx.saved_tensors
    N = mix.shape[0]
    n = pre.shape[1]
    d_pre = grad_pre * pre * (1 - pre) if grad_pre is not None else mix.new_zeros(N, n)
    d_post = grad_post * post * (1 - post / 2) if grad_post is not None else mix.new_zeros(N, n)
    if grad_res is not None:
        d_res = sinkhorn_backward(mix, bias, gains[2:3], grad_res, ctx.iterations).view(N, n * n)
    else:
        d_res = mix.new_zeros(N, n * n)
    d_u = torch.cat([d_pre, d_post, d_res], dim=1)  # (N, 2n + n^2): the logits' gradient
    g = gains.float()
    scale = torch.cat([g[0].expand(n), g[1].expand(n), g[2].expand(n * n)])
    grad_gains = torch.stack(
        [(d * m).sum() for d, m in zip(d_u.split([n, n, n * n], 1), mix.split([n, n, n * n], 1))]
    )
    grad_bias = d_u.sum(0)
    return d_u * scale, grad_bias.to(bias.dtype), grad_gains.to(gains.dtype), None


mhc_coefficients.register_autograd(_coefficients_backward, setup_context=_save_coefficients)


# --- the read and the write of the streams ----------------------------------------------------


@torch.library.custom_op("depthbench::triton_stream_read", mutates_args=())
def stream_read(H: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x = sum_i w_i H_i: H (N, n, d), weights (N, n) -> (N, d) in H's dtype."""
    x = _liger().mhc_pre_fwd(H.contiguous(), weights.float().contiguous())
    return x.to(H.dtype)


@stream_read.register_fake
def _(H, weights):
    return H.new_empty(H.shape[0], H.shape[2])


@torch.library.custom_op("depthbench::triton_stream_read_backward", mutates_args=())
def stream_read_backward(
    H: torch.Tensor, weights: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_H, grad_w = _liger().mhc_pre_bwd(
        H.contiguous(), weights.float().contiguous(), grad.float().contiguous()
    )
    return grad_H.to(H.dtype), grad_w.to(weights.dtype)


@stream_read_backward.register_fake
def _(H, weights, grad):
    return torch.empty_like(H), torch.empty_like(weights)


def _save_read(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _read_backward(ctx, grad):
    H, weights = ctx.saved_tensors
    return stream_read_backward(H, weights, grad)


stream_read.register_autograd(_read_backward, setup_context=_save_read)


@torch.library.custom_op("depthbench::triton_stream_write", mutates_args=())
def stream_write(
    H: torch.Tensor, out: torch.Tensor, post: torch.Tensor, mix: torch.Tensor
) -> torch.Tensor:
    """H_j <- sum_i mix_ji H_i + post_j out: H (N, n, d), out (N, d), post (N, n), mix (N, n, n)
    -> (N, n, d) in H's dtype."""
    new = _liger().mhc_post_res_fwd(
        H.contiguous(), out.contiguous(), post.float().contiguous(), mix.float().contiguous()
    )
    return new.to(H.dtype)


@stream_write.register_fake
def _(H, out, post, mix):
    return torch.empty_like(H)


@torch.library.custom_op("depthbench::triton_stream_write_backward", mutates_args=())
def stream_write_backward(
    H: torch.Tensor, out: torch.Tensor, post: torch.Tensor, mix: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _liger().mhc_post_res_bwd(
        H.contiguous(),
        out.contiguous(),
        post.float().contiguous(),
        mix.float().contiguous(),
        grad.float().contiguous(),
    )
    return tuple(g.to(t.dtype) for g, t in zip(grads, (H, out, post, mix)))


@stream_write_backward.register_fake
def _(H, out, post, mix, grad):
    return tuple(torch.empty_like(t) for t in (H, out, post, mix))


def _save_write(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _write_backward(ctx, grad):
    return stream_write_backward(*ctx.saved_tensors, grad)


stream_write.register_autograd(_write_backward, setup_context=_save_write)


# --- the swapped modules ----------------------------------------------------------------------


class TritonHyperConnection(HyperConnection):
    def forward(self, H: torch.Tensor, sublayer_fn: Callable[[torch.Tensor], torch.Tensor]):
        n = self.n
        if not takes(H, n):
            return super().forward(H, sublayer_fn)
        B, T, _, d = H.shape
        N = B * T
        phi = (self.dynamic.weight * self.norm.weight).t().to(H.dtype)  # per stream (d, n + 2)
        proj = normed_projection(H.reshape(N * n, d), phi, self.norm.eps)[0].view(B, T, n, n + 2)
        coeff = self.static() + self.scales() * torch.tanh(proj)  # (B, T, n, n + 2), fp32
        x = stream_read(H.reshape(N, n, d), coeff[..., 0].reshape(N, n))
        out = sublayer_fn(x.view(B, T, d))
        mix = coeff[..., 1 : n + 1].mT  # A_r^T
        H = stream_write(
            H.reshape(N, n, d),
            out.reshape(N, d),
            coeff[..., n + 1].reshape(N, n),
            mix.reshape(N, n, n),
        )
        return H.view(B, T, n, d), mix.to(H.dtype)


class TritonManifoldHyperConnection(ManifoldHyperConnection):
    def forward(self, H: torch.Tensor, sublayer_fn: Callable[[torch.Tensor], torch.Tensor]):
        B, T, n, d = H.shape
        if not takes(H, n):
            return super().forward(H, sublayer_fn)
        N = B * T
        phi = (self.phi.weight * self.norm.weight).t().to(H.dtype)  # (n d, 2n + n^2)
        z = normed_projection(H.reshape(N, n * d), phi, self.norm.eps)[0]
        bias = torch.cat([self.b_pre, self.b_post, self.b_res.reshape(-1)])
        pre, post, res = mhc_coefficients(z, bias, at_least_fp32(self.gains), self.iterations)
        x = stream_read(H.reshape(N, n, d), pre)
        out = sublayer_fn(x.view(B, T, d))
        H = stream_write(H.reshape(N, n, d), out.reshape(N, d), post, res)
        return H.view(B, T, n, d), res.view(B, T, n, n)


SWAPS = {
    ("cuda", HyperConnection): TritonHyperConnection,
    ("cuda", ManifoldHyperConnection): TritonManifoldHyperConnection,
}


def unavailable_reason() -> str | None:
    """Why these kernels cannot run here, or None. Looks for the packages without importing
    them: triton reads TRITON_INTERPRET when it is first imported."""
    for package, install in (("triton", "triton"), ("liger_kernel", "liger-kernel")):
        if importlib.util.find_spec(package) is None:
            return f"{install} is not installed (pip install {install})"
    return None
