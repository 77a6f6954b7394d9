"""Top-k mixture of SwiGLU experts (the sparsity knob of "When Does Sparsity Mitigate the Curse
of Depth", arXiv 2603.15389), usable as the FFN sublayer of every architecture.

Routing: p = softmax(W_r x) over E experts (fp32); the k largest p are renormalised to sum to 1
(documented choice, as in Mixtral) and weight the chosen experts' outputs. Load balancing: the
Switch-Transformer loss E * sum_e f_e * P_e, where f_e is the fraction of the N*k routing slots
sent to expert e and P_e the mean router probability of e; it equals 1 when routing is uniform.
The layer stores `aux_loss` = aux_loss_coef * that loss after each forward.

Parameter accounting: the budget fixes *total* parameters as built (every expert counted), as
for every other architecture; `inactive_parameters` (the E - k experts a token does not use) lets
`num_active_parameters` report the per-token active count, which the FLOP estimates use.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from depthbench.models.config import ModelConfig


class MoESwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.n_experts = int(moe["n_experts"])
        self.top_k = int(moe.get("top_k", 2))
        self.aux_loss_coef = float(moe.get("aux_loss_coef", 0.01))
        self.d_ff = int(moe.get("d_ff_expert") or cfg.d_ff)
        d, E = cfg.d_model, self.n_experts
        self.router = nn.Linear(d, E, bias=False)
        self.w13 = nn.Parameter(torch.empty(E, d, 2 * self.d_ff))  # per expert [W1 | W3], x @ w13
        self.w2 = nn.Parameter(torch.empty(E, self.d_ff, d))
        self.aux_loss: torch.Tensor | None = None
        self.inactive_parameters = (E - self.top_k) * 3 * d * self.d_ff

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.w13, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=std)

    def init_weights_xavier(self, gain: float) -> None:
        """Xavier-normal per expert projection (for DeepNorm): fans of each W1, W3, W2."""
        d = self.w13.shape[1]
        nn.init.normal_(self.w13, std=gain * math.sqrt(2.0 / (d + self.d_ff)))
        nn.init.normal_(self.w2, std=gain * math.sqrt(2.0 / (d + self.d_ff)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)  # (N, E)
        top_p, top_e = probs.topk(self.top_k, dim=-1)  # (N, k)
        top_p = (top_p / top_p.sum(-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        for e in range(self.n_experts):
            token, slot = (top_e == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate, up = (flat[token] @ self.w13[e]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w2[e]
            out.index_add_(0, token, y * top_p[token, slot, None])
        fraction = torch.bincount(top_e.reshape(-1), minlength=self.n_experts).float() / top_e.numel()
        self.aux_loss = self.aux_loss_coef * self.n_experts * (fraction * probs.mean(0)).sum()
        return out.view(shape)
