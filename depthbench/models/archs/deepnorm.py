"""DeepNorm (Wang et al. 2022, "DeepNet"), following microsoft/torchscale's decoder.

x <- N(alpha * x + F(x)) with alpha = (2L)^(1/4) for a decoder-only model of L layers, no final
norm. Two published inits, as `arch_options.init` (`DeepNormOptions`; default deepnet):

- `deepnet` (the DeepNet paper's pseudo-code): q and k Xavier-normal with gain 1; v, o and every
  FFN projection (W1, W3, W2) Xavier-normal with gain beta = (8L)^(-1/4).
- `torchscale` (microsoft/torchscale: component/multihead_attention.py, then
  architecture/decoder.py): q, k, v Xavier-uniform with gain 2^(-1/2), o Xavier-uniform with gain
  1, the FFN at PyTorch's default Linear init (kaiming-uniform with a = sqrt(5), i.e.
  U(-1/sqrt(fan_in), 1/sqrt(fan_in))); then v, o, fc1 and fc2 are divided by (8L)^(1/4). Here
  fc1 is SwiGLU's two input projections W1 and W3 (both divided), fc2 is W2.

Xavier fans are those of each separate projection (d x d for q/k/v/o with MHA), even though q, k,
v (and W1, W3) are stored as one fused matrix here. With a mixture of experts each expert's
matrices are initialised as the FFN's; the router keeps DepthBench's default init.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

from depthbench.models.base import ArchOptions, Block, DecoderLM, Rope
from depthbench.models.registry import register
from depthbench.models.layers import ConstantBuffers, RMSNorm

INITS = ("deepnet", "torchscale")  # arch_options.init


def xavier_normal_rows_(weight: torch.Tensor, start: int, stop: int, gain: float) -> None:
    """Xavier-normal init of rows [start, stop) as if they were their own Linear layer."""
    fan_out, fan_in = stop - start, weight.shape[1]
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    with torch.no_grad():
        weight[start:stop].normal_(0.0, std)


def xavier_uniform_rows_(weight: torch.Tensor, start: int, stop: int, gain: float) -> None:
    """Xavier-uniform init of rows [start, stop): U(-a, a),
    a = gain sqrt(6 / (fan_in + fan_out))."""
    fan_out, fan_in = stop - start, weight.shape[1]
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        weight[start:stop].uniform_(-bound, bound)


def default_linear_(weight: torch.Tensor, fan_in: int) -> None:
    """PyTorch's default nn.Linear weight init, kaiming_uniform_(a=sqrt(5)): U(-b, b) with
    b = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + 5)), i.e. b = 1 / sqrt(fan_in)."""
    with torch.no_grad():
        weight.uniform_(-1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))


@dataclass(frozen=True)
class DeepNormOptions(ArchOptions):
    init: str = (
        "deepnet"  # deepnet (the DeepNet paper's pseudo-code) or torchscale (microsoft/torchscale)
    )

    def __post_init__(self) -> None:
        self.require("init", INITS)


class DeepNormBlock(ConstantBuffers, Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # a tensor, not a Python float, so that a compiled block does not bake the depth in;
        # (2L)^(1/4) rounded once into the model's dtype (ConstantBuffers)
        self.register_constant("alpha", (2 * cfg.n_layer) ** 0.25)

    def forward(self, x: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        x = self.attn_norm(self.alpha * x + self.attn(x, rope))
        x = self.ffn_norm(self.alpha * x + self.ffn(x))
        return x


def deepnet_init_(block: DeepNormBlock, beta: float) -> None:
    """The DeepNet paper's init of one layer (module docstring)."""
    attn, ffn = block.attn, block.ffn
    q, kv = attn.q_dim, attn.kv_dim
    xavier_normal_rows_(attn.wqkv.weight, 0, q, 1.0)
    xavier_normal_rows_(attn.wqkv.weight, q, q + kv, 1.0)
    xavier_normal_rows_(attn.wqkv.weight, q + kv, q + 2 * kv, beta)
    nn.init.xavier_normal_(attn.wo.weight, gain=beta)
    if hasattr(ffn, "init_weights_xavier"):  # mixture of experts
        ffn.init_weights_xavier(beta)
        return
    xavier_normal_rows_(ffn.w13.weight, 0, ffn.d_ff, beta)
    xavier_normal_rows_(ffn.w13.weight, ffn.d_ff, 2 * ffn.d_ff, beta)
    nn.init.xavier_normal_(ffn.w2.weight, gain=beta)


def torchscale_init_(block: DeepNormBlock, scale: float) -> None:
    """torchscale's init of one layer (module docstring); `scale` = (8L)^(1/4)."""
    attn, ffn = block.attn, block.ffn
    q, kv = attn.q_dim, attn.kv_dim
    for start, stop in ((0, q), (q, q + kv), (q + kv, q + 2 * kv)):
        xavier_uniform_rows_(attn.wqkv.weight, start, stop, 2**-0.5)
    nn.init.xavier_uniform_(attn.wo.weight, gain=1.0)
    # mixture of experts: x @ w13[e], (d, 2 d_ff); w2[e] (d_ff, d)
    if hasattr(ffn, "init_weights_xavier"):
        default_linear_(ffn.w13, ffn.w13.shape[1])
        default_linear_(ffn.w2, ffn.d_ff)
        scaled = (ffn.w13, ffn.w2)
    else:  # nn.Linear weights (out, in)
        default_linear_(ffn.w13.weight, ffn.w13.weight.shape[1])
        default_linear_(ffn.w2.weight, ffn.w2.weight.shape[1])
        scaled = (ffn.w13.weight, ffn.w2.weight)
    with torch.no_grad():  # v, out_proj, fc1, fc2 divided by (8L)^(1/4)
        attn.wqkv.weight[q + kv : q + 2 * kv].div_(scale)
        attn.wo.weight.div_(scale)
        for weight in scaled:
            weight.div_(scale)


@register("deepnorm")
class DeepNorm(DecoderLM):
    block_class = DeepNormBlock
    has_final_norm = False
    position_bound_constants = True  # alpha = (2L)^(1/4) depends on the depth L
    Options = DeepNormOptions

    def init_architecture(self) -> None:
        if self.options.init == "deepnet":
            beta = (8 * self.cfg.n_layer) ** -0.25
            for block in self.blocks:
                deepnet_init_(block, beta)
        else:
            scale = (8 * self.cfg.n_layer) ** 0.25
            for block in self.blocks:
                torchscale_init_(block, scale)
