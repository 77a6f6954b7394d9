"""Checks of the bf16 autocast path against fp32, shared by the CPU tests (test_residual_archs.py)
and the GPU tests (test_gpu.py).

They run on briefly trained weights: a freshly initialised model predicts nearly uniform logits
(its loss is within 1% of log V), so any output close to constant, e.g. constant logits, would
agree with it. After a few AdamW steps on one fixed batch the fp32 loss is well below log V,
the logits are far from uniform, and a bf16 path that loses the signal stands out.
"""

from __future__ import annotations

import math

import torch

# Measured on the CPU test models (d_model 32, 3 layers, vocab 61, every architecture and pre_ln
# with MoE, after 10 steps; fp32 loss 0.35-0.67 log V): bf16 autocast moves the loss by at most
# 8e-4 nats, the centred logits by 0.3% (MoE 0.55%), the whole gradient by 0.7% (MoE 1.0%) and a
# single tensor's by 2.6% (the MoE router's by 8.6%: top-k choices that flip). The tolerances
# leave 3-12x of margin; constant logits miss the loss by more than 1 nat and the logits by 100%.
LOSS_ATOL = 0.01
LOGITS_RTOL = 0.02
GRAD_RTOL = 0.05
TENSOR_GRAD_RTOL = 0.25
# tensors carrying less than this share of the gradient's norm are not compared one by one (mHC's
# b_res of a saturated Sinkhorn has a gradient of 1e-13: its relative error is noise)
SIGNIFICANT_SHARE = 1e-3
# the trained fp32 loss must be below this fraction of log V for the comparison to mean anything
TRAINED_LOSS_FRACTION = 0.8


def train_briefly(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 10, lr: float = 1e-2
) -> float:
    """`steps` fp32 AdamW steps on the one batch (x, y), in place; returns the fp32 loss after."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(x, y)
        (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        return model(x, y).loss.item()


def _loss_and_grads(model, x, y, autocast: bool, device_type: str):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        out = model(x, y, return_hidden=True)
    objective = out.loss if out.aux_loss is None else out.loss + out.aux_loss
    objective.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def centred(logits: torch.Tensor) -> torch.Tensor:
    """Logits less their mean over the vocabulary (softmax does not see a constant shift)."""
    logits = logits.float()
    return logits - logits.mean(-1, keepdim=True)


def assert_bf16_matches_fp32(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device_type: str = "cpu"
) -> dict:
    """bf16 autocast vs fp32 on the same (trained) weights: loss within LOSS_ATOL, centred logits
    within LOGITS_RTOL (relative norm), the gradient within GRAD_RTOL and each significant
    tensor's within TENSOR_GRAD_RTOL, gradients fp32 and finite, and the residual stream
    h_0..h_L kept in fp32 under autocast (every architecture adds its bf16 sublayer outputs into
    an fp32 stream). Returns the measured errors."""
    vocab = model.cfg.vocab_size
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # a true fp32 reference: no TF32 products on CUDA
    try:
        ref, ref_grads = _loss_and_grads(model, x, y, autocast=False, device_type=device_type)
    finally:
        torch.set_float32_matmul_precision(precision)
    ref_loss = ref.loss.item()
    assert ref_loss < TRAINED_LOSS_FRACTION * math.log(vocab), (
        f"fp32 loss {ref_loss:.3f} is not well below log V = {math.log(vocab):.3f}: "
        "the weights are not trained enough"
    )
    out, grads = _loss_and_grads(model, x, y, autocast=True, device_type=device_type)
    assert out.logits.dtype == torch.bfloat16, "the LM head did not run under autocast"
    assert all(h.dtype == torch.float32 for h in out.hidden), [h.dtype for h in out.hidden]
    loss_err = abs(out.loss.item() - ref_loss)
    c_ref = centred(ref.logits)
    logits_err = ((centred(out.logits) - c_ref).norm() / c_ref.norm()).item()
    assert set(grads) == set(ref_grads)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())

    def flat(gs):
        return torch.cat([gs[n].flatten().double() for n in sorted(ref_grads)])

    g_ref = flat(ref_grads)
    grad_err = ((flat(grads) - g_ref).norm() / g_ref.norm()).item()
    tensor_errs = {
        n: ((grads[n] - g).norm() / g.norm()).item()
        for n, g in ref_grads.items()
        if g.norm() > SIGNIFICANT_SHARE * g_ref.norm()
    }
    measured = {
        "loss": loss_err,
        "logits": logits_err,
        "grad": grad_err,
        "worst_tensor": max(tensor_errs.items(), key=lambda kv: kv[1]),
    }
    assert loss_err < LOSS_ATOL, measured
    assert logits_err < LOGITS_RTOL, measured
    assert grad_err < GRAD_RTOL, measured
    assert all(e < TENSOR_GRAD_RTOL for e in tensor_errs.values()), measured
    return measured
