"""Manifold-constrained Hyper-Connections (DeepSeek, arXiv 2512.24880).

Same n-stream state as `hc`. For each sublayer, from x = N(flatten(H)) (one RMSNorm over all
n*d values):

    H_pre  = sigmoid(g_pre * (x Phi_pre) + b_pre)                     (n, non-negative)
    H_post = 2 sigmoid(g_post * (x Phi_post) + b_post)                (n, in (0, 2))
    H_res  = SinkhornKnopp(exp(g_res * mat(x Phi_res) + b_res))       (n x n, doubly stochastic)
    H     <- H_res H + H_post^T F(N(H_pre H))

g_* are learnable scalars initialised to 0.01, Phi_* zero-initialised, and the biases start at
HC's static values (b_pre one-hot at s mod n, b_res identity, b_post ones): a documented choice,
the paper's exact init was not found. Sinkhorn-Knopp runs 20 alternating row and column
normalisations (stabilised, see `sinkhorn_knopp`), so the result's columns sum to 1 exactly and
its rows to within a tolerance that shrinks with the iterations.
`internals["stream_mixing"]` records H_res of every sublayer, (B, T, n, n).

On the CPU (float32/float64) the whole read, from H to the sublayer input, the mixed streams and
the coefficients (the norm, the projection, the Sinkhorn iterations, the read and the mix), runs
in one C++ kernel per direction (`fused_read`, depthbench/kernels/mhc.cpp), also under
torch.compile; elsewhere, or where the kernels cannot be built, the PyTorch code below computes
the same numbers. (`fused_coefficients`, the coefficients alone from their pre-activations,
is the kernels' tested building block.)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from depthbench import kernels
from depthbench.models.archs.hc import MultiStreamLM, mix_matrix, write_after_read, write_streams
from depthbench.models.base import Block, Rope, register
from depthbench.models.layers import RMSNorm, at_least_fp32, normed_linear


class _AlternatingNormalization(torch.autograd.Function):
    """Sinkhorn-Knopp iterations on m laid out as (n, n, ...): rows are dim 0, columns dim 1.

    Forward keeps each half-step's sums and result; backward applies, in reverse, the exact
    vector-Jacobian product of y = x / sum(x): dx = (dy - sum(dy * y)) / sum(x), over the same
    dim. The same numbers as autograd through the loop, without its per-op bookkeeping.
    """

    @staticmethod
    def forward(ctx, m: torch.Tensor, iterations: int) -> torch.Tensor:
        saved = []
        for _ in range(iterations):
            for dim in (1, 0):  # rows sum to 1, then columns sum to 1
                s = m.sum(dim, keepdim=True)
                m = m / s
                saved += [s, m]
        ctx.save_for_backward(*saved)
        return m

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        grad = grad.contiguous()  # it arrives in the caller's (..., n, n) layout: strided here
        for k in range(len(saved) // 2 - 1, -1, -1):
            s, y = saved[2 * k], saved[2 * k + 1]
            dim = 1 if k % 2 == 0 else 0
            grad = (grad - (grad * y).sum(dim, keepdim=True)) / s
        return grad, None


@torch.library.custom_op("depthbench::mhc_coefficients", mutates_args=(), device_types="cpu")
def fused_coefficients(u: torch.Tensor, n: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
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


@torch.library.custom_op("depthbench::mhc_coefficients_backward", mutates_args=(), device_types="cpu")
def fused_coefficients_backward(u: torch.Tensor, grad_coeff: torch.Tensor, grad_post: torch.Tensor, n: int,
                                iterations: int) -> torch.Tensor:
    return kernels.cpu_kernels().mhc_coefficients_backward(
        u, grad_coeff.contiguous(), grad_post.contiguous(), n, iterations)


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


fused_coefficients.register_autograd(_coefficients_backward, setup_context=_save_for_coefficients_backward)


@torch.library.custom_op("depthbench::mhc_read", mutates_args=(), device_types="cpu")
def fused_read(H: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float,
               iterations: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC's read in one C++ kernel (depthbench/kernels/mhc.cpp): from the streams H (N, n, d),
    the folded projection weight (2n + n^2, n d) (Phi^T times the norm's gain) and the per-column
    gain and bias of u = gain * (N(flatten(H)) Phi) + bias (2n + n^2 each), the sublayer input x
    (N, d), the mixed streams (N, n, d), [H_pre; H_res] (N, n + 1, n) and H_post (N, n); and
    the projections h weight^T (N, 2n + n^2), returned for the backward only (no gradient flows
    back through them). Backward recomputes the rest from the inputs. A torch custom op, so that
    torch.compile keeps it as one call."""
    x, mixed, coeff, post, proj = kernels.cpu_kernels().mhc_read_forward(H, weight, scale, bias, eps, iterations)
    return x, mixed, coeff, post, proj


@fused_read.register_fake
def _(H, weight, scale, bias, eps, iterations):
    N, n, d = H.shape
    return (H.new_empty(N, d), H.new_empty(N, n, d), H.new_empty(N, n + 1, n), H.new_empty(N, n),
            H.new_empty(N, 2 * n + n * n))


@torch.library.custom_op("depthbench::mhc_read_backward", mutates_args=(), device_types="cpu")
def fused_read_backward(H: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float,
                        iterations: int, coeff: torch.Tensor, proj: torch.Tensor, grad_x: torch.Tensor,
                        grad_mixed: torch.Tensor,
                        grad_coeff: torch.Tensor,
                        grad_post: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = kernels.cpu_kernels().mhc_read_backward(
        H, weight, scale, bias, eps, iterations, coeff, proj, grad_x.contiguous(), grad_mixed.contiguous(),
        grad_coeff.contiguous(), grad_post.contiguous())
    return tuple(grads)


@fused_read_backward.register_fake
def _(H, weight, scale, bias, eps, iterations, coeff, proj, grad_x, grad_mixed, grad_coeff, grad_post):
    return torch.empty_like(H), torch.empty_like(weight), torch.empty_like(scale), torch.empty_like(bias)


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
    grads = fused_read_backward(H, weight, scale, bias, ctx.eps, ctx.iterations, coeff, proj, grad_x, grad_mixed,
                                grad_coeff, grad_post)
    return (*grads, None, None)


fused_read.register_autograd(_read_backward, setup_context=_save_for_read_backward)


class _EagerRead(torch.autograd.Function):
    """`fused_read` for eager mode: the same kernels through a plain autograd Function, whose
    per-call overhead is a fraction of a torch.library custom op's. torch.compile gets the custom
    op (see `read`)."""

    @staticmethod
    def forward(ctx, H, weight, scale, bias, eps, iterations):
        x, mixed, coeff, post, proj = kernels.cpu_kernels().mhc_read_forward(H, weight, scale, bias, eps, iterations)
        ctx.eps, ctx.iterations = eps, iterations
        ctx.save_for_backward(H, weight, scale, bias, coeff, proj)
        ctx.mark_non_differentiable(proj)
        return x, mixed, coeff, post, proj

    @staticmethod
    def backward(ctx, grad_x, grad_mixed, grad_coeff, grad_post, grad_proj):
        H, weight, scale, bias, coeff, proj = ctx.saved_tensors
        grads = kernels.cpu_kernels().mhc_read_backward(
            H, weight, scale, bias, ctx.eps, ctx.iterations, coeff, proj, grad_x.contiguous(), grad_mixed.contiguous(),
            grad_coeff.contiguous(), grad_post.contiguous())
        return (*grads, None, None)


def read(H, weight, scale, bias, eps: float, iterations: int):
    """mHC's fused read: the custom op under torch.compile, the Function in eager mode."""
    if torch.compiler.is_compiling():
        return fused_read(H, weight, scale, bias, eps, iterations)
    return _EagerRead.apply(H, weight, scale, bias, eps, iterations)


def sinkhorn_knopp(log_m: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """exp(log_m) scaled to a doubly stochastic matrix over the last two dims.

    Alternating row and column normalisation in the linear domain (about 3x faster than
    log-domain logsumexp on CPU). Stability: each row's maximum is subtracted first (the row
    scaling cancels in the first row normalisation) and the logits are clamped 60 below it, so
    every entry is at least exp(-60) and no sum can vanish. Speed: the n x n dims are moved in
    front, so that every sum adds n contiguous slices instead of reducing a size-n inner dim
    (about 6x faster on CPU), and the iterations have a hand-written backward (1.5x more).
    Without autograd (probes, decoding) they normalise in place: a 32-layer forward pass at probe
    shapes is about 20% faster than through the Function, with the same numbers. (On the CPU,
    mHC's sublayers do not call this: `fused_coefficients` runs the iterations in C++.)
    """
    shifted = log_m - log_m.amax(dim=-1, keepdim=True).detach()
    m = shifted.clamp_min(-60.0).exp()
    m = m.movedim(-2, 0).movedim(-1, 1).contiguous()  # (n, n, ...)
    if not (torch.is_grad_enabled() and m.requires_grad):
        # inference (probes, decoding): nothing is saved for a backward, so normalise in place
        for _ in range(iterations):
            m.div_(m.sum(1, keepdim=True))
            m.div_(m.sum(0, keepdim=True))
    elif torch.compiler.is_compiling():
        # under torch.compile the plain loop lets inductor fuse the iterations (and autograd
        # derive their backward); the hand-written Function is for eager mode
        for _ in range(iterations):
            m = m / m.sum(1, keepdim=True)
            m = m / m.sum(0, keepdim=True)
    else:
        m = _AlternatingNormalization.apply(m, iterations)
    return m.movedim(0, -1).movedim(0, -1)


class ManifoldHyperConnection(nn.Module):
    def __init__(self, d_model: int, n_streams: int, sublayer: int, eps: float, iterations: int):
        super().__init__()
        n = n_streams
        self.n, self.sublayer, self.iterations = n, sublayer, iterations
        self.norm = RMSNorm(n * d_model, eps)
        self.phi = nn.Linear(n * d_model, 2 * n + n * n, bias=False)  # [Phi_pre | Phi_post | Phi_res]
        self.gains = nn.Parameter(torch.full((3,), 0.01))  # g_pre, g_post, g_res
        self.b_pre = nn.Parameter(torch.zeros(n))
        self.b_post = nn.Parameter(torch.zeros(n))
        self.b_res = nn.Parameter(torch.zeros(n, n))  # set by reset(), from init_architecture

    def reset(self) -> None:
        n = self.n
        with torch.no_grad():
            self.phi.weight.zero_()
            self.gains.fill_(0.01)
            self.b_pre.zero_()
            self.b_pre[self.sublayer % n] = 1.0
            self.b_post.fill_(1.0)
            self.b_res.copy_(torch.eye(n))

    def gains_and_biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-column gain and bias of u = g * (x Phi) + b, each (2n + n^2,) in the layout
        [pre | post | res]: g_pre, g_post or g_res repeated over its columns (at least fp32)."""
        n = self.n
        gains = at_least_fp32(self.gains).repeat_interleave(torch.tensor([n, n, n * n]), output_size=2 * n + n * n)
        return gains, torch.cat([self.b_pre, self.b_post, self.b_res.reshape(-1)])

    def kernel_coefficients(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[H_pre; H_res] (B, T, n + 1, n) and H_post (B, T, n) from z = N(flatten(H)) Phi through
        the C++ kernel: u = g * z + b here (autograd gives the gains' and biases' gradients), the
        rest in `fused_coefficients`."""
        B, T, width = z.shape
        gains, biases = self.gains_and_biases()
        u = torch.addcmul(biases.to(z.dtype), z, gains.to(z.dtype))
        coeff, post = fused_coefficients(u.reshape(B * T, width), self.n, self.iterations)
        return coeff.view(B, T, self.n + 1, self.n), post.view(B, T, self.n)

    def forward(self, H: torch.Tensor, sublayer_fn: Callable[[torch.Tensor], torch.Tensor]):
        B, T, n, d = H.shape
        if kernels.apply_to(H):
            weight = (self.phi.weight * self.norm.weight).to(H.dtype)  # N(h) Phi = (h (g * Phi)) / rms(h)
            gains, biases = self.gains_and_biases()
            x, mixed, coeff, post, _ = read(H.reshape(B * T, n, d), weight, gains.to(H.dtype), biases.to(H.dtype),
                                            self.norm.eps, self.iterations)
            out = sublayer_fn(x.view(B, T, d))
            H = write_after_read(mixed, post, out.reshape(B * T, d))  # + H_post^T F(...)
            return H.view(B, T, n, d), coeff.view(B, T, n + 1, n)[..., 1:, :]
        # N(flatten(H)) Phi without materialising the normalised state (an RMSNorm over n*d
        # values per token has a slow backward on CPU at this size)
        z = normed_linear(H.reshape(B, T, n * d), self.norm, self.phi)
        if kernels.apply_to(z):  # bf16 streams on the CPU: the coefficients in C++
            coeff, post = self.kernel_coefficients(z)
            res = coeff[..., 1:, :]
        else:
            g_pre, g_post, g_res = at_least_fp32(self.gains)
            pre = torch.sigmoid(g_pre * z[..., :n] + self.b_pre)
            post = 2.0 * torch.sigmoid(g_post * z[..., n : 2 * n] + self.b_post)
            res = sinkhorn_knopp(g_res * z[..., 2 * n :].view(B, T, n, n) + self.b_res, self.iterations)
            coeff = torch.cat([pre.unsqueeze(-2), res], dim=-2)
        # read (H_pre H) and mix (H_res H) in one batched matmul: row 0 reads, rows 1..n mix
        coeff = coeff.to(H.dtype)  # the streams keep their dtype
        x, mixed = mix_matrix(coeff, H).split([1, n], dim=-2)
        out = sublayer_fn(x.squeeze(-2))
        H = write_streams(mixed, post.to(H.dtype), out)  # + H_post^T F(...)
        return H, res


class MHCBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        n = int(cfg.arch_options.get("n_streams", 4))
        iters = int(cfg.arch_options.get("sinkhorn_iterations", 20))
        first = 2 * (layer_index - 1)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn_mhc = ManifoldHyperConnection(cfg.d_model, n, first, cfg.norm_eps, iters)
        self.ffn_mhc = ManifoldHyperConnection(cfg.d_model, n, first + 1, cfg.norm_eps, iters)

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

    def init_architecture(self) -> None:
        for block in self.blocks:
            block.attn_mhc.reset()
            block.ffn_mhc.reset()

    def extra_flops_per_token(self, seq_len: int) -> float:
        """The read and mix of the streams (the projection Phi is an nn.Linear, in N_mm)."""
        return self.read_and_mix_flops()
