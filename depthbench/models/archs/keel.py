"""KEEL ("Post-LayerNorm Is Back: Stable, ExpressivE, and Deep", arXiv 2601.19895).

x <- N_out(alpha * x + F(N_in(x))) for each sublayer, no final norm. Documented choice: alpha is
the number of *sublayers*, 2L (summaries of the paper disagree between layers and sublayers).
"""

import torch

from depthbench.models.base import Block, DecoderLM, Rope
from depthbench.models.registry import register
from depthbench.models.layers import RMSNorm


class KeelBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn_norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)
        # a tensor, not a Python float, so that a compiled block does not bake the depth in
        # (LNS's scale)
        self.register_buffer("alpha", torch.tensor(float(2 * cfg.n_layer)), persistent=False)

    def forward(self, x: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        x = self.attn_norm_out(self.alpha * x + self.attn(self.attn_norm_in(x), rope))
        x = self.ffn_norm_out(self.alpha * x + self.ffn(self.ffn_norm_in(x)))
        return x


@register("keel")
class Keel(DecoderLM):
    block_class = KeelBlock
    has_final_norm = False
    position_bound_constants = True  # alpha = 2L depends on the depth L
