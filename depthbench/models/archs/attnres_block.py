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

from dataclasses import dataclass

import torch

from depthbench.models.archs.attnres_full import AttnResBlock, AttnResFull
from depthbench.models.archs.attnres_sources import DepthSources, rms_unit
from depthbench.models.base import ArchOptions
from depthbench.models.registry import register
from depthbench.util.errors import ConfigError


def block_ends(n_layer: int, n_blocks: int) -> list[int]:
    """The 1-based layer after which each block ends (increasing, last = n_layer)."""
    return sorted({int(k * n_layer / n_blocks + 0.5) for k in range(1, n_blocks + 1)} - {0})


class BlockSources(DepthSources):
    """Sources: v_0, the completed block sums, and the current partial sum, which only the next
    reader sees (its logit is computed when read)."""

    def __init__(
        self,
        v0: torch.Tensor,
        queries: torch.Tensor,
        eps: float,
        ends: list[int],
    ):
        super().__init__(v0, queries, eps)
        self.ends = set(ends)
        self.partial: torch.Tensor | None = None

    def read(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        if self.partial is None:
            return super().read()
        partial_logit = (
            rms_unit(self.partial, self.eps) @ self.queries[:, self.next_reader, None]
        ).squeeze(-1)
        return self.sources(self.partial), torch.stack(
            [*self.logits[self.next_reader], partial_logit]
        )

    def add(self, out: torch.Tensor, layer: int, is_last_sublayer_of_layer: bool) -> None:
        self.next_reader += 1
        self.partial = out if self.partial is None else self.partial + out
        if is_last_sublayer_of_layer:
            self._close_block(layer)

    def skip_layer(self, layer: int) -> None:
        """Layer `layer` removed: it adds nothing to the partial sum. The blocks stay where they
        are (their boundaries are bound to positions); a block whose every layer is skipped adds
        no source."""
        self.next_reader += 2
        self._close_block(layer)

    def _close_block(self, layer: int) -> None:
        if layer in self.ends and self.partial is not None:
            self.append(self.partial)
            self.partial = None


@dataclass(frozen=True)
class AttnResBlockOptions(ArchOptions):
    n_blocks: int = 8  # B: the layers are cut into B blocks

    def __post_init__(self) -> None:
        if not isinstance(self.n_blocks, int) or self.n_blocks < 1:
            raise ConfigError(
                "model.arch_options.n_blocks", f"must be a positive integer, got {self.n_blocks!r}"
            )


@register("attnres_block")
class AttnResBlocks(AttnResFull):
    block_class = AttnResBlock
    probes = AttnResFull.probes | {"partial_sum_weight", "dead_zone_layers"}
    figures = frozenset({"depth_mixing", "dead_zone"})
    position_bound_constants = True  # the block boundaries depend on l and on the depth L

    Options = AttnResBlockOptions

    def make_sources(self, h0: torch.Tensor) -> BlockSources:
        ends = block_ends(self.cfg.n_layer, self.options.n_blocks)
        return BlockSources(h0, self.reader_queries(), self.cfg.norm_eps, ends)

    def source_counts(self) -> list[int]:
        """How many sources each reader sees (2L sublayers, then the final aggregation): v_0, the
        completed blocks and, after a block's first sublayer, its partial sum."""
        ends = set(block_ends(self.cfg.n_layer, self.options.n_blocks))
        counts, completed, partial = [], 1, False
        for layer in range(1, self.cfg.n_layer + 1):
            for position in range(2):
                counts.append(completed + int(partial))
                partial = True
                if position == 1 and layer in ends:
                    completed, partial = completed + 1, False
        counts.append(completed)
        return counts

    def dead_zone(
        self, depth_weights: list[torch.Tensor], threshold: float
    ) -> tuple[int, list[float]]:
        """Per layer, the weight its sublayers put on the current partial sum, and the dead-zone
        length: the number of leading layers whose weight is below `threshold`.

        A layer's weight is the mean over its sublayers that have a partial sum to weigh: the FFN
        sublayer always has one (at least the same layer's attention output), the attention
        sublayer unless the layer starts a block. So the weight is defined for every layer, also
        when every layer is its own block (n_blocks >= n_layer). The partial sum is the last source
        of a sublayer's depth softmax (see BlockSources.read)."""
        L = self.cfg.n_layer
        starts = {1} | {e + 1 for e in block_ends(L, self.options.n_blocks)}
        weights = []
        for l in range(1, L + 1):
            attn, ffn = depth_weights[2 * (l - 1)], depth_weights[2 * (l - 1) + 1]
            parts = [float(ffn[-1])] + ([] if l in starts else [float(attn[-1])])
            weights.append(sum(parts) / len(parts))
        length = 0
        for w in weights:
            if w >= threshold:
                break
            length += 1
        return length, weights
