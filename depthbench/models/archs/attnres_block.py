"""Block Attention Residuals (Kimi team, arXiv 2603.15031): depth attention over block summaries.

The L layers are cut into B blocks (8 by default, `arch_options.n_blocks`); block k ends after
layer floor(k L / B + 1/2) (round half up, documented choice), so when B does not divide L the
blocks differ by at most one layer, and when B > L every layer is its own block. Inside a block,
sublayer outputs are summed into a running partial sum. A sublayer's sources are v_0 (the
embedding output), the sums of the completed blocks, and the current partial sum when it is not
empty (at the first sublayer of a block it is). The final aggregation sees v_0 and every block
sum. Everything else (pseudo-queries, key norms, pre-norms, probes) is as in `attnres_full`.
"""

from __future__ import annotations

import torch

from depthbench.models.archs.attnres_full import AttnResBlock, AttnResFull, DepthSources, rms_unit
from depthbench.models.base import register


def block_ends(n_layer: int, n_blocks: int) -> list[int]:
    """The 1-based layer after which each block ends (increasing, last = n_layer)."""
    return sorted({int(k * n_layer / n_blocks + 0.5) for k in range(1, n_blocks + 1)} - {0})


class BlockSources(DepthSources):
    """Sources: v_0, the completed block sums, and the current partial sum, which only the next
    reader sees (its logit is computed when read)."""

    def __init__(self, v0: torch.Tensor, queries: torch.Tensor, eps: float, ends: list[int]):
        super().__init__(v0, queries, eps)
        self.ends = set(ends)
        self.partial: torch.Tensor | None = None

    def read(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        if self.partial is None:
            return super().read()
        partial_logit = (rms_unit(self.partial, self.eps) @ self.queries[:, self.next_reader, None]).squeeze(-1)
        return [*self.values, self.partial], torch.stack([*self.logits[self.next_reader], partial_logit])

    def add(self, out: torch.Tensor, layer: int, is_last_sublayer_of_layer: bool) -> None:
        self.next_reader += 1
        self.partial = out if self.partial is None else self.partial + out
        if is_last_sublayer_of_layer and layer in self.ends:
            self.append(self.partial)
            self.partial = None


@register("attnres_block")
class AttnResBlocks(AttnResFull):
    block_class = AttnResBlock
    probes = AttnResFull.probes | {"partial_sum_weight", "dead_zone_layers"}
    figures = frozenset({"depth_mixing", "dead_zone"})

    def make_sources(self, h0: torch.Tensor) -> BlockSources:
        n_blocks = int(self.cfg.arch_options.get("n_blocks", 8))
        return BlockSources(h0, self.reader_queries(), self.cfg.norm_eps, block_ends(self.cfg.n_layer, n_blocks))
