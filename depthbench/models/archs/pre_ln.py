"""Pre-LN (LLaMA): x <- x + F(N(x)) for each sublayer, final norm before the LM head."""

import torch

from depthbench.models.base import Block, DecoderLM, Rope
from depthbench.models.registry import register
from depthbench.models.layers import RMSNorm


class PreLNBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        x = x + self.ffn(self.ffn_norm(x))
        return x


@register("pre_ln")
class PreLN(DecoderLM):
    block_class = PreLNBlock
    has_final_norm = True
