"""The LM head and cross-entropy in chunks of tokens, never holding the micro-batch's logits.

The plain loss, F.cross_entropy(lm_head(x).float()), keeps the (N, V) logits of N tokens in the
compute dtype for backward and makes an fp32 copy: at micro-batch 16 x 2048 and V = 50280 that
is 6.6 GB of fp32 logits plus 3.3 GB of bf16 ones. `chunked_cross_entropy` computes head and loss
`chunk` tokens at a time and, in the same pass, their gradients (Liger-kernel style; the loss is
the graph's end, so d loss / d logits is known in the forward):

    logits_c = x_c W^T,  lse_c = logsumexp(logits_c),  loss = sum_t (lse_t - logits_t[y_t]) / n
    d loss / d logits_c = (softmax(logits_c) - onehot(y_c)) / n          (n: non-ignored targets)
    d x_c = (d logits_c) W,   d W = sum_c (d logits_c)^T x_c

Saved for backward: d x (N, d) and d W (V, d, fp32), scaled by the incoming gradient in backward;
at most one chunk's (chunk, V) logits exist at a time. No logits are recomputed (the head's
FLOPs are those of the plain path: 2 N V d forward, 4 N V d backward, all in the forward).
Without autograd (evaluation) only the loss is computed.

Precision follows autocast as the plain path does: the products run in autocast's dtype (bf16
on GPU) with the logits, softmax and loss in fp32; d W is accumulated over chunks in fp32.
Targets equal to `ignore_index` (-100, F.cross_entropy's default) count neither in the sum nor in n.
"""

from __future__ import annotations

import torch

from depthbench.models.precision import autocast_dtype, autocast_off

IGNORE_INDEX = -100


class _ChunkedLMHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        dtype: torch.dtype,
    ):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        valid = targets != IGNORE_INDEX
        n = valid.sum().clamp(min=1).to(torch.float32)  # a device tensor: no host read
        w = weight.to(dtype)
        # chunk sums added in float64 (float32 on MPS): as accurate for 1-token chunks as one
        # reduction
        loss = torch.zeros(
            (), dtype=torch.float32 if x.device.type == "mps" else torch.float64, device=x.device
        )
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_grad else None
        )
        for start in range(0, x.shape[0], chunk):
            xc, yc = x[start : start + chunk].to(dtype), targets[start : start + chunk]
            logits = (xc @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            keep = valid[start : start + chunk]
            picked = logits.gather(1, yc.clamp(min=0)[:, None]).squeeze(1)
            loss = loss + torch.where(keep, lse - picked, 0.0).sum().to(loss.dtype)
            if need_grad:
                g = logits.sub_(lse[:, None]).exp_()  # softmax, in place: one (chunk, V) buffer
                g.scatter_add_(1, yc.clamp(min=0)[:, None], torch.full_like(lse[:, None], -1.0))
                g = (g * (keep[:, None] / n)).to(dtype)
                grad_x[start : start + chunk] = g @ w
                grad_w += (g.t() @ xc).float()
        if need_grad:
            ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return (loss / n).to(torch.float32)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        return (
            grad_x * grad_loss.to(grad_x.dtype),
            (grad_w * grad_loss).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Mean cross-entropy (fp32) of the logits x W^T against `targets`, `chunk` tokens at a time.
    x: (..., d) final hidden states; weight: (V, d), the LM head; targets: x's leading shape."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 tokens, got {chunk}")
    flat = x.reshape(-1, x.shape[-1])
    dtype = autocast_dtype(flat)  # the products' dtype, as x @ W^T would run (meta: the replay's)
    with autocast_off(flat.device.type):  # casts made explicitly (see module docstring)
        return _ChunkedLMHeadCE.apply(flat, weight, targets.reshape(-1), chunk, dtype)
