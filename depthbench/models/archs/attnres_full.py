"""Full Attention Residuals (Kimi team, arXiv 2603.15031).

The residual sum is replaced by attention over depth. Sources: v_0 = embedding output, v_i =
output of sublayer i (i = 1..2L). Sublayer s reads

    h_s = sum_i softmax_i(w_s . N_s(v_i)) v_i       over i = 0 .. s-1

with w_s (d) a learned pseudo-query of that sublayer (zero init: uniform weights at start) and
N_s an RMSNorm with its own gain applied to the keys only; no 1/sqrt(d) temperature. The
sublayer then computes F(N_pre(h_s)) (the usual pre-norm is kept). A final aggregation with its
own pseudo-query feeds the final norm and LM head.

Since N_s(v) = g_s * v / rms(v), the logit w_s . N_s(v_i) = (w_s * g_s) . (v_i / rms(v_i)): each
source is RMS-normalised once, and when it is added its logits against the effective queries
q_s = w_s * g_s of every later reader come from one matmul (unit_i @ [q_s ...]). A sublayer then
only stacks its sources' logit columns and mixes them, one multiply-add per source, without
re-stacking the sources per reader (O(L^2) copies). Faster mixes are swapped in from outside
(depthbench.kernels.swap) by replacing `make_sources`.

The readers' pseudo-queries (`DepthAttention`) and the sources with their logits and mix
(`DepthSources`, which Block AttnRes extends) are in attnres_sources.py.

h_l for probes is the aggregated input of the first sublayer of layer l + 1 (h_0 = v_0; h_L is
the final aggregation). `internals["depth_weights"]` records, per sublayer (and last the final
aggregation), the softmax weight on each available source averaged over batch and positions.
"""

from __future__ import annotations

import torch
from torch import nn

from depthbench.models.archs.attnres_sources import DepthAttention, DepthSources
from depthbench.models.base import GENERIC_PROBES, Block, DecoderLM, Rope
from depthbench.models.registry import register
from depthbench.models.layers import RMSNorm


class PreNormed(nn.Module):
    """F(N_pre(h)): one sublayer with its pre-norm, the unit that activation checkpointing
    recomputes (`checkpoint_units`). It holds the norm and the sublayer without owning them (not
    registered as children), so parameter names and state dicts stay those of the block. Were
    the sublayer alone the unit, the norm's saved input and output (two fp32 (B, T, d) tensors
    per sublayer under autocast) would stay saved through every checkpointed layer
    (docs/design/parallelism.md)."""

    def __init__(self, norm: nn.Module, sublayer: nn.Module):
        super().__init__()
        object.__setattr__(self, "parts", (norm, sublayer))

    def forward(self, h: torch.Tensor, *args) -> torch.Tensor:
        norm, sublayer = self.parts
        return sublayer(norm(h), *args)


class AttnResBlock(Block):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # N_pre of the attention sublayer
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn_depth = DepthAttention(cfg.d_model, cfg.norm_eps)
        self.ffn_depth = DepthAttention(cfg.d_model, cfg.norm_eps)
        object.__setattr__(
            self,
            "units",
            (PreNormed(self.attn_norm, self.attn), PreNormed(self.ffn_norm, self.ffn)),
        )

    def sublayers(self, rope: Rope):
        """F(N_pre(.)) for the attention then the FFN sublayer."""
        attn_unit, ffn_unit = self.units
        return (lambda h: attn_unit(h, rope), lambda h: ffn_unit(h))


@register("attnres_full")
class AttnResFull(DecoderLM):
    block_class = AttnResBlock
    has_final_norm = True
    probes = GENERIC_PROBES | {"depth_weight"}
    figures = frozenset({"depth_mixing"})

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
        return DepthSources(h0, self.reader_queries(), self.cfg.norm_eps)

    def depth_readers(self) -> list[DepthAttention]:
        """Every reader's depth attention: each sublayer's in order, then the final one's."""
        sublayers = [d for block in self.blocks for d in (block.attn_depth, block.ffn_depth)]
        return sublayers + [self.final_depth]

    def reader_queries(self) -> torch.Tensor:
        """(d, 2L + 1): the effective query of every sublayer in order, then the final one."""
        return torch.stack([depth.effective_query() for depth in self.depth_readers()], dim=1)

    def fsdp_units(self) -> list[nn.Module]:
        """The trunk calls each layer's attention and FFN sublayers, never the block itself, and
        reads every pseudo-query at its start (reader_queries): the sublayers are the units and
        the norms and depth-attention parameters stay in the root unit."""
        return [sub for block in self.blocks for sub in (block.attn, block.ffn)]

    def checkpoint_units(self) -> list[nn.Module]:
        """Each sublayer with its pre-norm (PreNormed): the norms' parameters stay in the root
        FSDP2 unit while their activations are recomputed with the sublayer's."""
        return [unit for block in self.blocks for unit in block.units]

    # The trunk state is the source list (see DecoderLM.layer_step).
    def reader_key(self) -> tuple:
        """What `reader_queries()` is made of, without reading a value: each reader's pseudo-query
        and key-norm gain, in order, with its in-place version (DepthSources.same_key compares
        them by identity and version). Equal keys mean equal queries, so a fork compares keys on
        the host instead of the queries on the device. The contract: parameters change through
        operations autograd sees (copy_, add_, load_state_dict, an optimizer step), which bump
        the version; a write through `.data` does not, and a fork would not see it."""
        return tuple(
            (p, p._version)
            for depth in self.depth_readers()
            for p in (depth.query, depth.key_norm.weight)
        )

    def init_state(self, h0: torch.Tensor) -> DepthSources:
        sources = self.make_sources(h0)
        sources.key = self.reader_key()
        return sources

    def run_layer(
        self,
        sources: DepthSources,
        block: AttnResBlock,
        rope: Rope,
        hidden: list | None = None,
        record: list | None = None,
        outputs: list | None = None,
    ) -> DepthSources:
        for position, sublayer in enumerate(block.sublayers(rope)):
            h, weights = sources.current()
            if position == 0 and hidden is not None:
                hidden.append(h)  # h_{layer-1}: what layer `layer` reads
            if record is not None:
                record.append(weights.detach().float().mean(dim=(1, 2)))
            out = sublayer(h)
            if outputs is not None:
                outputs.append(out)
            sources.add(out, block.layer_index, is_last_sublayer_of_layer=position == 1)
        return sources

    def layer_step(self, state: DepthSources, block: AttnResBlock, rope: Rope) -> DepthSources:
        return self.run_layer(state, block, rope)

    def final_aggregation(self, sources: DepthSources) -> tuple[torch.Tensor, torch.Tensor]:
        return sources.current()

    def trunk_output(self, state: DepthSources) -> torch.Tensor:
        return self.final_aggregation(state)[0]

    def read_stream(self, state: DepthSources) -> torch.Tensor:
        """h_l: the aggregated input of layer l + 1's first sublayer (the final aggregation
        after the last layer), whichever reader the state has next."""
        return state.current()[0]

    def fork_state(self, state: DepthSources) -> DepthSources:
        return state.fork(self.reader_queries(), self.reader_key())

    # Skip and replace (depthbench.models.adapter): a skipped layer's two sublayers add no
    # source. A replaced layer's input is what it reads first, h_(l-1), and its output features
    # are the two sources it adds (attention and FFN outputs, (N, T, 2d)): an affine replacement
    # makes both functions of h_(l-1), and they enter the later softmaxes as the layer's own did.
    def skip_layer(self, state: DepthSources, layer: int) -> DepthSources:
        state.skip_layer(layer)
        return state

    def layer_features(self, state: DepthSources, layer: int, rope: Rope):
        x = self.read_stream(state)
        after, outputs = self.fork_state(state), []
        self.run_layer(after, self.blocks[layer - 1], rope, outputs=outputs)
        return x, torch.cat(outputs, dim=-1), after

    def from_layer_features(
        self, state: DepthSources, layer: int, outputs: torch.Tensor, rope: Rope
    ) -> DepthSources:
        attn_out, ffn_out = outputs.to(state.values[0].dtype).chunk(2, dim=-1)
        state.add(attn_out, layer, is_last_sublayer_of_layer=False)
        state.add(ffn_out, layer, is_last_sublayer_of_layer=True)
        return state

    def source_counts(self) -> list[int]:
        """How many sources each reader sees: sublayer s (1-based) s of them, the final 2L + 1."""
        return list(range(1, 2 * self.cfg.n_layer + 2))

    def extra_flops_per_token(self, seq_len: int) -> float:
        """The depth logits w . N(v_i) and the mix sum_i w_i v_i: 2 d each per source per reader
        (the matmul of DepthSources._add_logits; the mix's multiply-adds, or the batched
        products of depthbench.kernels.attnres_groups)."""
        return 4.0 * self.cfg.d_model * sum(self.source_counts())

    def depth_state_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """The stored sources a decode step holds (at most the final reader's)."""
        return max(self.source_counts()) * self.cfg.d_model * bytes_per_value

    def trunk(
        self, h0: torch.Tensor, rope: Rope, hidden: list | None, internals: dict | None
    ) -> torch.Tensor:
        sources = self.init_state(h0)
        record = internals.setdefault("depth_weights", []) if internals is not None else None
        for block in self.blocks:
            self.run_layer(sources, block, rope, hidden, record)
        h_final, weights = self.final_aggregation(sources)
        if record is not None:
            record.append(weights.detach().float().mean(dim=(1, 2)))
        if hidden is not None:
            hidden.append(h_final)
        return h_final
