"""Post-LN (original Transformer): x <- N(x + F(x)); no final norm, the stream is normalized."""

import torch

from depthbench.models.base import Block, DecoderLM, Rope
from depthbench.models.registry import register
from depthbench.models.layers import RMSNorm


class PostLNBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x, rope))
        x = self.ffn_norm(x + self.ffn(x))
        return x


@register("post_ln")
class PostLN(DecoderLM):
    block_class = PostLNBlock
    has_final_norm = False
