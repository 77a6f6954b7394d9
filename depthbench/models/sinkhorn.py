"""Sinkhorn-Knopp: exp(log_m) scaled to a doubly stochastic matrix (mHC's H_res).

    m_0 = exp(log_m - rowmax(log_m)), each entry at least exp(-60) (clamped 60 below its row's
    maximum, so that no sum can vanish; the row scaling cancels in the first row normalisation)
    then `iterations` times: every row divided by its sum, then every column by its sum.

The result's columns sum to 1 exactly and its rows to within a tolerance that shrinks with the
iterations (docs/design/architectures.md). The alternating normalisation is one torch custom op,
`depthbench::sinkhorn_normalize`, so that torch.compile keeps it as one call (a Python loop would
be unrolled into 2 x iterations graph nodes forward and more backward) and its backward is the
exact vector-Jacobian product written out: for y = x / sum(x) over a dim,
dx = (dy - sum(dy * y)) / sum(x), applied to the half-steps in reverse. The op returns each
half-step's sums and results beside the matrix, for that backward (what autograd through the loop
would keep). The matrices are laid out (n, n, ...) inside, rows dim 0 and columns dim 1, so that
every sum adds n contiguous slices instead of reducing a size-n inner dim.
"""

from __future__ import annotations

import torch

CLAMP_BELOW_ROW_MAX = 60.0  # log-domain floor: exp(-60) keeps every sum positive


@torch.library.custom_op("depthbench::sinkhorn_normalize", mutates_args=())
def sinkhorn_normalize(
    m: torch.Tensor, iterations: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m (n, n, ...) positive -> (the result, the half-steps' results (2 it, n, n, ...), their
    sums (2 it, n, ...)): rows normalised, then columns, `iterations` times."""
    results, sums = [], []
    for _ in range(iterations):
        for dim in (1, 0):  # rows sum to 1, then columns
            s = m.sum(dim, keepdim=True)
            m = m / s
            results.append(m)
            sums.append(s.squeeze(dim))
    return m.clone(), torch.stack(results), torch.stack(sums)


@sinkhorn_normalize.register_fake
def _(m, iterations):
    steps = 2 * iterations
    return (
        torch.empty_like(m),
        m.new_empty(steps, *m.shape),
        m.new_empty(steps, *m.shape[1:]),
    )


@torch.library.custom_op("depthbench::sinkhorn_normalize_backward", mutates_args=())
def sinkhorn_normalize_backward(
    grad: torch.Tensor, results: torch.Tensor, sums: torch.Tensor
) -> torch.Tensor:
    """The gradient of `sinkhorn_normalize`'s result with respect to its input m."""
    grad = grad.contiguous()
    for k in range(results.shape[0] - 1, -1, -1):
        dim = 1 if k % 2 == 0 else 0
        y, s = results[k], sums[k].unsqueeze(dim)
        grad = (grad - (grad * y).sum(dim, keepdim=True)) / s
    return grad


@sinkhorn_normalize_backward.register_fake
def _(grad, results, sums):
    return torch.empty_like(grad)


def _save(ctx, inputs, output):
    _, results, sums = output
    ctx.save_for_backward(results, sums)


def _backward(ctx, grad, grad_results, grad_sums):
    results, sums = ctx.saved_tensors
    return sinkhorn_normalize_backward(grad, results, sums), None


sinkhorn_normalize.register_autograd(_backward, setup_context=_save)


def sinkhorn_knopp(log_m: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """exp(log_m) made doubly stochastic over the last two dims (module docstring). Without
    autograd (probes, decoding) the iterations run in place: nothing is kept for a backward."""
    shifted = log_m - log_m.amax(dim=-1, keepdim=True).detach()
    m = shifted.clamp_min(-CLAMP_BELOW_ROW_MAX).exp()
    m = m.movedim(-2, 0).movedim(-1, 1).contiguous()  # (n, n, ...)
    if torch.is_grad_enabled() and m.requires_grad:
        m = sinkhorn_normalize(m, iterations)[0]
    else:
        for _ in range(iterations):
            m.div_(m.sum(1, keepdim=True))
            m.div_(m.sum(0, keepdim=True))
    return m.movedim(0, -1).movedim(0, -1)
