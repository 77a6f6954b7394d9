"""LayerNorm Scaling (LNS; "The Curse of Depth in Large Language Models").

x <- x + F(N(x) / sqrt(l)) for both sublayers of layer l (1-based). The scale multiplies the
norm *output* only, not the residual and not the sublayer output. Default init: the LNS authors
found that depth-scaled init cancels the benefit. (Their reference code's LNS switch compares a
lowercased string with "LNS" and never fires; this implementation applies the scale always.)
The scale is bound to the position l, not to the layer's weights: a permutation probe that
swaps layers keeps each position's 1/sqrt(l). It is a (non-persistent) buffer, not a Python float:
under per-block compile (depthbench.train.parallelize) a float attribute is a constant of the
graph and would force one recompile per layer; a tensor is an input, so one graph serves all.
The buffer is 1/sqrt(l) rounded once into the model's dtype (`ConstantBuffers`): float64 in a
float64 model.
"""

import math

import torch

from depthbench.models.base import Block, DecoderLM, Rope
from depthbench.models.registry import register
from depthbench.models.layers import ConstantBuffers, RMSNorm


class LNSBlock(ConstantBuffers, Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.register_constant("scale", 1.0 / math.sqrt(layer_index))  # a buffer (module docstring)

    def forward(self, x: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x) * self.scale, rope)
        x = x + self.ffn(self.ffn_norm(x) * self.scale)
        return x


@register("lns")
class LNS(DecoderLM):
    block_class = LNSBlock
    has_final_norm = True
    position_bound_constants = True  # layer l's 1/sqrt(l)
