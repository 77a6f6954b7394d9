"""Norm and gradient dynamics measured during training every `train.dynamics_every` steps.

On the step's first micro-batch, one extra forward and backward (torch.autograd.grad, so nothing
accumulates into .grad and the run's weights are unaffected) measures, per layer:
- `residual_rms`: RMS of h_l (l = 0..L);
- `grad_norm_h`: ||dLoss/dh_l|| (Frobenius over the micro-batch); NaN where h_l is not itself on
  the computation path (hc/mhc, whose h_l is the sum of streams, a read-out);
- `param_grad_norm`: norm of the gradient of all parameters of layer l (l = 1..L);
- `norm_factor`: sqrt(D)/||y|| averaged over tokens for every RMSNorm whose input y is (a function
  of) the residual stream, named by module path: the scale by which RMSNorm's backward multiplies
  the gradient (its Jacobian is sqrt(D)/||y|| times a projection, times the gain).
"""

from __future__ import annotations

import math

import torch

from depthbench.models.layers import RMSNorm


def measure(
    model, x: torch.Tensor, y: torch.Tensor, autocast
) -> dict[str, list[float] | dict[str, float]]:
    factors: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):

            def hook(mod, args, out, name=name):
                inp = args[0].detach().float()
                factors[name] = float(
                    (math.sqrt(inp.shape[-1]) / inp.norm(dim=-1).clamp_min(1e-12)).mean()
                )

            hooks.append(module.register_forward_hook(hook))
    try:
        with autocast:
            out = model(x, y, return_hidden=True)
    finally:
        for h in hooks:
            h.remove()
    hidden = out.hidden
    params = [list(block.parameters()) for block in model.blocks]
    flat = [p for group in params for p in group]
    loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
    grads = torch.autograd.grad(loss, [*hidden, *flat], allow_unused=True)
    h_grads, p_grads = grads[: len(hidden)], grads[len(hidden) :]
    per_layer, i = [], 0
    for group in params:
        gs = [g for g in p_grads[i : i + len(group)] if g is not None]
        per_layer.append(
            float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in gs])))
            if gs
            else float("nan")
        )
        i += len(group)
    return {
        "residual_rms": [float(h.detach().float().pow(2).mean().sqrt()) for h in hidden],
        "grad_norm_h": [
            float(g.float().norm()) if g is not None else float("nan") for g in h_grads
        ],
        "param_grad_norm": per_layer,
        "norm_factor": factors,
    }
