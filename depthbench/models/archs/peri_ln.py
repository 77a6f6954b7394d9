"""Peri-LN (Kim et al. 2025, arXiv 2502.02732; Gemma 2's sandwich norm).

x <- x + N_out(F(N_in(x))) for each sublayer, final norm before the LM head. The option
`arch_options.embed_norm` (off by default) also normalizes the embedding output; h_0 is then
the normalized embedding, since that is what layer 1 reads.
"""

from dataclasses import dataclass

import torch

from depthbench.util.errors import ConfigError
from depthbench.models.base import ArchOptions, Block, DecoderLM, Rope
from depthbench.models.registry import register
from depthbench.models.layers import RMSNorm


class PeriLNBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn_norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn_norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, internals: dict | None = None) -> torch.Tensor:
        x = x + self.attn_norm_out(self.attn(self.attn_norm_in(x), rope))
        x = x + self.ffn_norm_out(self.ffn(self.ffn_norm_in(x)))
        return x


@dataclass(frozen=True)
class PeriLNOptions(ArchOptions):
    embed_norm: bool = False  # also normalize the embedding output (h_0 is then normalized)

    def __post_init__(self) -> None:
        if not isinstance(self.embed_norm, bool):
            raise ConfigError(
                "model.arch_options.embed_norm", f"must be true or false, got {self.embed_norm!r}"
            )


@register("peri_ln", "sandwich_ln")
class PeriLN(DecoderLM):
    block_class = PeriLNBlock
    has_final_norm = True
    Options = PeriLNOptions

    def __init__(self, cfg, initialize: bool = True):
        super().__init__(cfg, initialize)
        # Created after the base init: a fresh RMSNorm's gain is already 1.
        self.embed_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if self.options.embed_norm else None

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        h0 = self.embed(idx)
        return self.embed_norm(h0) if self.embed_norm is not None else h0
