"""Full Attention Residuals (Kimi team, arXiv 2603.15031).

The residual sum is replaced by attention over depth. Sources: v_0 = embedding output, v_i =
output of sublayer i (i = 1..2L). Sublayer s reads

    h_s = sum_i softmax_i(w_s . N_s(v_i)) v_i       over i = 0 .. s-1

with w_s (d) a learned pseudo-query of that sublayer (zero init: uniform weights at start) and
N_s an RMSNorm with its own gain applied to the keys only; no 1/sqrt(d) temperature. The
sublayer then computes F(N_pre(h_s)) (the usual pre-norm is kept). A final aggregation with its
own pseudo-query feeds the final norm and LM head.

Since N_s(v) = g_s * v / rms(v), the logit w_s . N_s(v_i) = (w_s * g_s) . (v_i / rms(v_i)): each
source is RMS-normalised once and every later sublayer only takes a dot product with it.

h_l for probes is the aggregated input of the first sublayer of layer l + 1 (h_0 = v_0; h_L is
the final aggregation). `internals["depth_weights"]` records, per sublayer (and last the final
aggregation), the softmax weight on each available source averaged over batch and positions.
"""

from __future__ import annotations

import torch
from torch import nn

from depthbench.models.base import Block, DecoderLM, Rope, register
from depthbench.models.layers import RMSNorm, at_least_fp32


class DepthAttention(nn.Module):
    """softmax over sources of w . N(v_i), mixing the sources themselves."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))  # pseudo-query w, zero init
        self.key_norm = RMSNorm(d_model, eps)  # N: its gain applies to the keys only

    def forward(self, sources: torch.Tensor, unit_sources: torch.Tensor):
        """sources, unit_sources: (S, B, T, d), the latter RMS-normalised without gain.
        Returns h (B, T, d) and the weights (S, B, T)."""
        # a (d, 1) matrix rather than a vector: a matmul, which the FLOP counter counts (mv it does not)
        logits = (unit_sources @ (self.query * self.key_norm.weight).unsqueeze(-1)).squeeze(-1)  # (S, B, T)
        weights = torch.softmax(at_least_fp32(logits), dim=0).to(sources.dtype)
        return (weights.unsqueeze(-1) * sources).sum(dim=0), weights


def rms_unit(v: torch.Tensor, eps: float) -> torch.Tensor:
    return v * torch.rsqrt(at_least_fp32(v).pow(2).mean(-1, keepdim=True) + eps).to(v.dtype)


class AttnResBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # N_pre of the attention sublayer
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn_depth = DepthAttention(cfg.d_model, cfg.norm_eps)
        self.ffn_depth = DepthAttention(cfg.d_model, cfg.norm_eps)

    def sublayers(self, rope: Rope):
        """(depth attention, F(N_pre(.))) for the attention then the FFN sublayer."""
        return (
            (self.attn_depth, lambda h: self.attn(self.attn_norm(h), rope)),
            (self.ffn_depth, lambda h: self.ffn(self.ffn_norm(h))),
        )


class DepthSources:
    """The sources a sublayer may attend to. Full AttnRes: every earlier output."""

    def __init__(self, v0: torch.Tensor, eps: float):
        self.eps = eps
        self.values = [v0]
        self.units = [rms_unit(v0, eps)]

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.values), torch.stack(self.units)

    def add(self, out: torch.Tensor, layer: int, is_last_sublayer_of_layer: bool) -> None:
        self.values.append(out)
        self.units.append(rms_unit(out, self.eps))


@register("attnres_full")
class AttnResFull(DecoderLM):
    block_class = AttnResBlock
    has_final_norm = True

    def __init__(self, cfg, initialize: bool = True):
        super().__init__(cfg, initialize=False)
        self.final_depth = DepthAttention(cfg.d_model, cfg.norm_eps)
        if initialize:
            self.reset_parameters()

    def init_architecture(self) -> None:
        for module in self.modules():
            if isinstance(module, DepthAttention):
                nn.init.zeros_(module.query)

    def make_sources(self, h0: torch.Tensor) -> DepthSources:
        return DepthSources(h0, self.cfg.norm_eps)

    def trunk(self, h0: torch.Tensor, rope: Rope, hidden: list | None, internals: dict | None) -> torch.Tensor:
        sources = self.make_sources(h0)
        record = internals.setdefault("depth_weights", []) if internals is not None else None
        for layer, block in enumerate(self.blocks, start=1):
            for position, (depth, sublayer) in enumerate(block.sublayers(rope)):
                h, weights = depth(*sources.stacked())
                if position == 0 and hidden is not None:
                    hidden.append(h)  # h_{layer-1}: what layer `layer` reads
                if record is not None:
                    record.append(weights.detach().float().mean(dim=(1, 2)))
                sources.add(sublayer(h), layer, is_last_sublayer_of_layer=position == 1)
        h_final, weights = self.final_depth(*sources.stacked())
        if record is not None:
            record.append(weights.detach().float().mean(dim=(1, 2)))
        if hidden is not None:
            hidden.append(h_final)
        return h_final

