"""Block AttnRes's depth mix as batched products over a preallocated source buffer: the CUDA
backend's implementation (depthbench.kernels.swap), where the definition's loop of one
multiply-add per source (depthbench.models.archs.attnres_sources.WeightedSum) launches a kernel
per source and reader. On the CPU the loop is the faster of the two (docs/benchmarks.md), so the
CPU backend keeps the definition. (Full AttnRes, whose readers see every earlier source, mixes in
groups of readers: attnres_groups.py.)

A reader mixes its S sources per token, h = sum_i w_i v_i, i.e. for each of the N = B T tokens the
(1, S) x (S, d) product w^T V. With the sources held token-major in one buffer (B, T, capacity, d),
written once per source as it is produced, the first S slots are a view (N, S, d) and the mix is ONE
batched matrix product forward (bmm) and two backward (dw = dh V^T and dV = w dh^T, the latter an
outer product: a bmm with inner size 1), instead of S multiply-adds forward and 2S kernels backward
per reader. Every product of the mix, the extra source's too, is a bmm, so
`torch.utils.flop_counter` counts the 2 S d forward and 4 S d backward FLOPs per token and reader
that depthbench.models.cost charges (backward twice the forward, as for every matmul); an outer
product as a bmm rounds as the element-wise product does (one multiplication per output). Block
AttnRes's partial sum changes after every sublayer and is read by one reader only: it is not written
to the buffer but enters as one extra source next to the view.

The gradient of each buffer slot is returned to the tensor the slot was copied from (the
buffer itself is a cache of values, written in place and never differentiated), so autograd
sees the same graph as the definition (`DepthSources.mix` on a list of sources).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthbench.models.archs.attnres_block import AttnResBlocks, BlockSources, block_ends
from depthbench.models.archs.attnres_sources import DepthSources
from depthbench.models.layers import at_least_fp32, held_for_backward


# Buffer-sized gradients the backward of the mixes holds at once (the memory estimate's held
# working set): each reader's dV = w dh is one (N, S, d) tensor, returned to the sources as views
# of it, so it lives until every source it reaches has received another reader's gradient or run
# its own backward, while the sources' accumulated gradients wait for their producers. With 2 the
# estimate is 1.007-1.074 times the peaks of Full and Block AttnRes measured on an H200
# (tests/data/h200_training_step_memory.json); with 1 it falls below Full AttnRes's (bf16,
# chunked loss).
GRADIENT_COPIES = 2.0


class SourceBuffer:
    """The sources (B, T, d) of one forward in slots of a (B, T, capacity, d) buffer of the first
    source's dtype (v_0, the embedding output: fp32 under autocast, where later sources may be
    bf16 and are upcast exactly). `sources` are the tensors the slots hold, in order. Capacity
    doubles when full (never during a model's own forward: it is sized for every source)."""

    def __init__(self, like: torch.Tensor, capacity: int):
        B, T, d = like.shape
        self.values = held_for_backward(like.new_empty(B, T, max(capacity, 1), d), GRADIENT_COPIES)
        self.sources: list[torch.Tensor] = []

    def fits(self, t: torch.Tensor) -> bool:
        v = self.values
        return (
            t.shape == (v.shape[0], v.shape[1], v.shape[3])
            and t.device == v.device
            and t.is_floating_point()
        )

    def push(self, t: torch.Tensor) -> None:
        n = len(self.sources)
        if n == self.values.shape[2]:
            self.values = held_for_backward(
                torch.cat([self.values, torch.empty_like(self.values)], dim=2), GRADIENT_COPIES
            )
        with torch.no_grad():
            self.values[:, :, n].copy_(t)
        self.sources.append(t)

    def holds(self, sources: list) -> bool:
        """Whether the first len(sources) slots are exactly these tensors."""
        return len(self.sources) >= len(sources) and all(
            a is b for a, b in zip(self.sources, sources)
        )


def synced_buffer(buffer: SourceBuffer | None, sources: list, capacity: int) -> SourceBuffer | None:
    """`buffer` if its first slots are `sources`, else a new one filled from them (a probe
    resuming from an earlier state, whose later slots another pass has taken); None when the
    sources do not share one shape."""
    if buffer is not None and buffer.holds(sources):
        return buffer
    buffer = SourceBuffer(sources[0], max(capacity, len(sources)))
    if not all(map(buffer.fits, sources)):
        return None
    for t in sources:
        buffer.push(t)
    return buffer


@dataclass
class BufferedSources:
    """What a reader mixes: the first `count` slots of `buffer`, then optionally `extra` (Block
    AttnRes's partial sum). len() is the number of sources, as for a list."""

    buffer: SourceBuffer
    count: int
    extra: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.count + (self.extra is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.values.dtype


class BatchedMix(torch.autograd.Function):
    """h = sum_i w_i v_i for weights (N, S) over the view (N, S_buf, d) of the buffer and an
    optional extra source (N, d) (S = S_buf + 1 with it); the remaining inputs are the tensors
    the S_buf slots hold, which receive the slots' gradients dv_i = w_i dh."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)  # the buffer's dtype throughout, as the reference path
    @torch.autocast("cuda", enabled=False)
    def forward(ctx, weights, view, extra, *sources):
        n = view.shape[1]
        h = torch.bmm(weights[:, None, :n], view).squeeze(1)  # (N, d)
        if extra is not None:  # w_e extra as a (1, 1) x (1, d) product per token
            h = h + torch.bmm(weights[:, None, n:], extra[:, None, :].to(h.dtype)).squeeze(1)
        ctx.view, ctx.n = view, n  # not saved for backward: later sources are written in place
        ctx.save_for_backward(weights, extra)
        ctx.sources = [(t.shape, t.dtype) for t in sources]
        return h

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad):
        weights, extra = ctx.saved_tensors
        view, n = ctx.view, ctx.n
        grad = grad.to(view.dtype)
        grad_w = torch.bmm(grad[:, None, :], view.transpose(1, 2)).squeeze(1)  # dw_i = dh . v_i
        grad_extra = None
        if extra is not None:
            extra_w = torch.bmm(grad[:, None, :], extra[:, :, None].to(grad.dtype)).squeeze(
                1
            )  # dh . extra
            grad_w = torch.cat([grad_w, extra_w], dim=1)
            grad_extra = (
                torch.bmm(weights[:, n:, None], grad[:, None, :]).squeeze(1).to(extra.dtype)
            )
        grad_view = torch.bmm(
            weights[:, :n, None], grad[:, None, :]
        )  # (N, S_buf, d): dv_i = w_i dh
        per_source = [
            g.view(shape).to(dtype) for g, (shape, dtype) in zip(grad_view.unbind(1), ctx.sources)
        ]
        return grad_w, None, grad_extra, *per_source


def batched_mix(sources: BufferedSources, weights: torch.Tensor) -> torch.Tensor:
    """sum_i weights_i v_i over the buffered sources; weights (S, B, T) -> (B, T, d)."""
    buf = sources.buffer
    B, T, _, d = buf.values.shape
    view = buf.values[:, :, : sources.count].reshape(
        B * T, sources.count, d
    )  # a view: (B, T) collapse
    w = weights.to(sources.dtype).permute(1, 2, 0).reshape(B * T, -1)
    extra = sources.extra.reshape(B * T, d) if sources.extra is not None else None
    held = buf.sources[: sources.count] if torch.is_grad_enabled() else []
    return BatchedMix.apply(w, view, extra, *held).view(B, T, d)


class BufferedMix:
    """What DepthSources' batched subclasses add: every source is also written, once, into a
    `SourceBuffer` sized for `capacity` sources and shared by forks (rebuilt by a fork whose slots
    another took), and a reader's mix is one batched product over the buffer's slots."""

    def __init__(self, *args, capacity: int, **kwargs):
        self.capacity, self.buffer = capacity, None
        super().__init__(*args, **kwargs)

    def append(self, v: torch.Tensor) -> None:
        if self.buffer is None and not self.values:  # v_0: the buffer takes its dtype
            self.buffer = SourceBuffer(v, self.capacity)
        buf = self.buffer
        if (
            buf is not None
            and len(buf.sources) == len(self.values)
            and buf.holds(self.values)
            and buf.fits(v)
        ):
            buf.push(v)
        super().append(v)

    def sources(self, extra: torch.Tensor | None = None):
        self.buffer = synced_buffer(self.buffer, self.values, self.capacity)
        if self.buffer is not None and (extra is None or self.buffer.fits(extra)):
            return BufferedSources(self.buffer, len(self.values), extra)
        return super().sources(extra)

    @staticmethod
    def mix(values, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(values, BufferedSources):
            weights = torch.softmax(at_least_fp32(logits), dim=0).to(values.dtype)
            return batched_mix(values, weights), weights
        return DepthSources.mix(values, logits)


class BufferedBlockSources(BufferedMix, BlockSources):
    """Block AttnRes's sources (v_0 and the block sums in the buffer; the partial sum enters as
    the extra source), mixed by batched products."""


class BatchedAttnResBlocks(AttnResBlocks):
    def make_sources(self, h0: torch.Tensor) -> BlockSources:
        ends = block_ends(self.cfg.n_layer, self.options.n_blocks)
        queries, eps = self.reader_queries(), self.cfg.norm_eps
        # capacity: v_0 and the block sums
        return BufferedBlockSources(h0, queries, eps, ends, capacity=len(ends) + 1)


SWAPS = {("cuda", AttnResBlocks): BatchedAttnResBlocks}
