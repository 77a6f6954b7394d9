"""The logit lens: each layer's prediction read off the residual stream.

For h_l (the state after layer l, what layer l + 1 reads; h_L the input of the final norm) the
lens applies the model's own final norm and LM head, z_l = head(norm(h_l)) (`adapter.lens_logits`;
no norm where the architecture has none, Gemma's soft cap where the family applies it). Per layer
l = 0..L, on the probe sample (positions t of every sequence, targets the next tokens):

    lens_cross_entropy_l   = mean_t -log softmax(z_l)[target_t]
    lens_kl_to_final_l     = mean_t KL(p_L || p_l),  p_l = softmax(z_l), p_L the model's output
    lens_top1_agreement_l  = mean_t [argmax z_l == argmax z_L]

At l = L the lens must give the model's own logits. It is checked on every call
(`check_lens_at_last_layer`): a lens that read the post-norm state (the trap of transformers'
`hidden_states[-1]`, which some models return after the final norm) or an adapter whose h_L is
not the input of the final norm would fail it, rather than print curves that mean something else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from depthbench.models.adapter import ModelAdapter, trunk_states

# |lens(h_L) - logits(state_L)| <= atol + rtol |logits| in float32 (the same operations in the
# same order give 0; different but equivalent kernels stay far below this)
LENS_RTOL, LENS_ATOL = 1e-5, 1e-5


def check_lens_at_last_layer(adapter: ModelAdapter, state_last, lens_last: torch.Tensor) -> None:
    """Raise if the lens at l = L differs from the model's own logits (module docstring)."""
    own = adapter.logits(state_last).float()
    if not torch.allclose(lens_last, own, rtol=LENS_RTOL, atol=LENS_ATOL):
        worst = float((lens_last - own).abs().max())
        raise RuntimeError(
            f"{adapter.arch_name}: the logit lens at the last layer differs from the model's "
            "logits "
            f"by up to {worst:.3g} (tolerance {LENS_ATOL} + {LENS_RTOL} |z|): "
            "the adapter's residual "
            "h_L is not the input of its final norm, or lens_logits is not its final norm and head"
        )


@torch.no_grad()
def logit_lens(adapter: ModelAdapter, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer lens cross-entropy, KL divergence to the final distribution and top-1 agreement
    (each (L + 1,), index l = 0..L) on the sample `idx` (N, T + 1): inputs idx[:, :-1], targets
    idx[:, 1:]. One layer's logits are held at a time, in fp32."""
    inputs, targets = idx[:, :-1], idx[:, 1:].reshape(-1)
    states = trunk_states(adapter, inputs)
    lens_last = adapter.lens_logits(adapter.residual(states[-1])).float()
    check_lens_at_last_layer(adapter, states[-1], lens_last)
    final_logp = F.log_softmax(lens_last.reshape(-1, lens_last.shape[-1]), dim=-1)
    final_top1 = final_logp.argmax(-1)
    final_p = final_logp.exp()
    ce, kl, top1 = [], [], []
    for layer, state in enumerate(states):
        z = (
            lens_last
            if layer == len(states) - 1
            else adapter.lens_logits(adapter.residual(state)).float()
        )
        logp = F.log_softmax(z.reshape(-1, z.shape[-1]), dim=-1)
        ce.append(F.nll_loss(logp, targets))
        kl.append((final_p * (final_logp - logp)).sum(-1).mean())
        top1.append((logp.argmax(-1) == final_top1).float().mean())
    return {
        "lens_cross_entropy": torch.stack(ce),
        "lens_kl_to_final": torch.stack(kl),
        "lens_top1_agreement": torch.stack(top1),
    }
