"""DeepNorm (Wang et al. 2022, "DeepNet"), following microsoft/torchscale's decoder.

x <- N(alpha * x + F(x)) with alpha = (2L)^(1/4) for a decoder-only model of L layers, no final
norm. Init: q and k projections Xavier-normal with gain 1; v, o and every FFN projection
Xavier-normal with gain beta = (8L)^(-1/4). Xavier fans are those of each separate projection
(d x d for q/k/v/o), even though q, k, v (and W1, W3) are stored as one fused matrix here.
"""

import math

import torch
from torch import nn

from depthbench.models.base import Block, DecoderLM, Rope, register
from depthbench.models.layers import RMSNorm


def xavier_normal_rows_(weight: torch.Tensor, start: int, stop: int, gain: float) -> None:
    """Xavier-normal init of rows [start, stop) as if they were their own Linear layer."""
    fan_out, fan_in = stop - start, weight.shape[1]
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    with torch.no_grad():
        weight[start:stop].normal_(0.0, std)


class DeepNormBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.alpha = (2 * cfg.n_layer) ** 0.25

    def forward(self, x: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        x = self.attn_norm(self.alpha * x + self.attn(x, rope))
        x = self.ffn_norm(self.alpha * x + self.ffn(x))
        return x


@register("deepnorm")
class DeepNorm(DecoderLM):
    block_class = DeepNormBlock
    has_final_norm = False

    def init_architecture(self) -> None:
        beta = (8 * self.cfg.n_layer) ** -0.25
        for block in self.blocks:
            attn, ffn = block.attn, block.ffn
            q, kv = attn.q_dim, attn.kv_dim
            xavier_normal_rows_(attn.wqkv.weight, 0, q, 1.0)
            xavier_normal_rows_(attn.wqkv.weight, q, q + kv, 1.0)
            xavier_normal_rows_(attn.wqkv.weight, q + kv, q + 2 * kv, beta)
            nn.init.xavier_normal_(attn.wo.weight, gain=beta)
            if hasattr(ffn, "init_weights_xavier"):  # mixture of experts
                ffn.init_weights_xavier(beta)
                continue
            xavier_normal_rows_(ffn.w13.weight, 0, ffn.d_ff, beta)
            xavier_normal_rows_(ffn.w13.weight, ffn.d_ff, 2 * ffn.d_ff, beta)
            nn.init.xavier_normal_(ffn.w2.weight, gain=beta)
