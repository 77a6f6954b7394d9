"""Full AttnRes's depth mix in two phases over groups of readers: the CUDA backend's implementation
(depthbench.kernels.swap), swapped in for the definition's mix of one multiply-add per source.

Reader r mixes the sources that exist when it runs: h_r = sum_i softmax_i(l_{r,i}) v_i. Reader by
reader, every earlier source is read once per reader: at L = 70, 141 readers and about 10,000
source reads a token forward, as many again backward. Here the readers are taken in groups of
`GROUP` consecutive ones, and each group is mixed in two phases:

1. When the group's first reader runs, the c sources that exist then (the cached ones) are read
   once for every reader g of the group at once: the softmax over the cached sources and their
   weighted sum, kept as (h_g, lse_g), lse_g the log-sum-exp of g's cached logits
   (`GroupMix`: one batched product of (G, c) weights by (c, d) sources per token forward; its
   backward gives every cached source's gradient for the whole group in one product, where the
   reader-by-reader mix sends G of them through autograd).
2. When reader g runs, the j sources added since the group began (the outputs of the group's
   earlier sublayers, j < G) are mixed the same way (h', lse') and merged in as an online softmax
   does: lse = logaddexp(lse_g, lse'), h = exp(lse_g - lse) h_g + exp(lse' - lse) h'.

The sources are stored as they come: v_0 (the embedding output, fp32 under autocast) apart, the
sublayer outputs (the training dtype: bf16 under autocast) in one buffer of their own dtype, written
once each, so that nothing is rounded and a bf16 source takes half an fp32 one's bytes. The products
run in at least float32 (the buffer's slots upcast as they are read), as the definition's mixing
does. The logits are the definition's (each source's against every later reader's effective query,
from one matmul when the source is added), and the depth weights the probes record are exp(l - lse)
of them. `GROUP` = 8: the sources are read about 8 times less often, while phase 2 mixes at most 7
sources per reader.
"""

from __future__ import annotations

import torch

from depthbench.kernels.attnres_mix import GRADIENT_COPIES
from depthbench.models.archs.attnres_full import AttnResFull
from depthbench.models.archs.attnres_sources import DepthSources
from depthbench.models.layers import at_least_fp32, held_for_backward
from depthbench.models.precision import autocast_off

GROUP = 8  # readers mixed together in phase 1


class GroupMix(torch.autograd.Function):
    """The softmax of G readers over S sources and their weighted sums: logits (G, S, N),
    `first` (N, d) or None (v_0, kept apart), the buffer's view of the other sources
    (N, S', d), then the tensors its slots were copied from -> h (G, N, d) and lse (G, N), in
    the logits' dtype (at least fp32). Every product is a bmm (the v_0 terms as outer products),
    so torch.utils.flop_counter counts the 2 S d forward and 4 S d backward FLOPs per token and
    reader that depthbench.models.cost charges. The buffer is a cache of values, written in
    place by later sources (the slots viewed here never change): held on ctx, not saved, and
    each slot's gradient is returned to the tensor it was copied from."""

    @staticmethod
    def forward(ctx, logits, first, view, *sources):
        with autocast_off(logits.device.type):  # on meta: the memory trace's replay pauses
            return GroupMix._forward(ctx, logits, first, view, *sources)

    @staticmethod
    def _forward(ctx, logits, first, view, *sources):
        dtype = logits.dtype
        lse = torch.logsumexp(logits, dim=1)  # (G, N)
        p = torch.exp(logits - lse[:, None]).permute(2, 0, 1)  # (N, G, S)
        k = 0 if first is None else 1
        h = p.new_zeros(p.shape[0], p.shape[1], view.shape[2])
        if first is not None:  # (N, G, 1) x (N, 1, d)
            h = torch.bmm(p[..., :1], first.to(dtype)[:, None])
        if view.shape[1]:  # (N, G, S') x (N, S', d): every source read once for the G readers
            h = h + torch.bmm(p[..., k:], view.to(dtype))
        ctx.save_for_backward(logits, lse, first)
        ctx.view, ctx.sources = view, [(t.shape, t.dtype) for t in sources]
        return h.transpose(0, 1), lse

    @staticmethod
    def backward(ctx, grad_h, grad_lse):
        with autocast_off(grad_h.device.type):
            return GroupMix._backward(ctx, grad_h, grad_lse)

    @staticmethod
    def _backward(ctx, grad_h, grad_lse):
        logits, lse, first = ctx.saved_tensors
        view, dtype = ctx.view, logits.dtype
        p = torch.exp(logits - lse[:, None]).permute(2, 0, 1)  # (N, G, S)
        dh = grad_h.to(dtype).transpose(0, 1)  # (N, G, d)
        # dq_i = dh . v_i; with h = sum_i p_i v_i: dlogit_i = p_i (dq_i - dh . h + dlse)
        parts, grad_first, grad_sources = [], None, []
        k = 0 if first is None else 1
        if first is not None:
            f = first.to(dtype)[:, :, None]  # (N, d, 1)
            parts.append(torch.bmm(dh, f))  # (N, G, 1)
            grad_first = torch.bmm(p[..., :1].transpose(1, 2), dh).squeeze(1).to(first.dtype)
        if view.shape[1]:
            values = view.to(dtype)
            parts.append(torch.bmm(dh, values.transpose(1, 2)))  # (N, G, S')
            # every source's gradient for the G readers at once: (N, S', G) x (N, G, d)
            grad_view = torch.bmm(p[..., k:].transpose(1, 2), dh)
            grad_sources = [
                g.view(shape).to(t_dtype)
                for g, (shape, t_dtype) in zip(grad_view.unbind(1), ctx.sources)
            ]
        dq = torch.cat(parts, dim=2)  # (N, G, S)
        centred = dq - (p * dq).sum(2, keepdim=True)
        if grad_lse is not None:
            centred = centred + grad_lse.to(dtype).transpose(0, 1)[..., None]
        return (p * centred).permute(1, 2, 0), grad_first, None, *grad_sources


def merge(h1, lse1, h2, lse2):
    """Two softmax-weighted sums over disjoint sets of sources as one over their union."""
    lse = torch.logaddexp(lse1, lse2)
    return (
        torch.exp(lse1 - lse).unsqueeze(-1) * h1 + torch.exp(lse2 - lse).unsqueeze(-1) * h2,
        lse,
    )


class OutputBuffer:
    """The sublayer outputs of one forward, (B, T, capacity, d) in their own dtype, written once
    each; `sources` the tensors the slots hold, in order."""

    def __init__(self, like: torch.Tensor, capacity: int):
        B, T, d = like.shape
        self.values = held_for_backward(like.new_empty(B, T, max(capacity, 1), d), GRADIENT_COPIES)
        self.sources: list[torch.Tensor] = []

    def push(self, t: torch.Tensor) -> bool:
        """Copy t into the next slot (False where it does not fit: another shape or dtype)."""
        v = self.values
        if t.shape != (v.shape[0], v.shape[1], v.shape[3]) or t.dtype != v.dtype:
            return False
        n = len(self.sources)
        if n == v.shape[2]:
            self.values = held_for_backward(torch.cat([v, torch.empty_like(v)], 2), GRADIENT_COPIES)
        with torch.no_grad():
            self.values[:, :, n].copy_(t)
        self.sources.append(t)
        return True

    def holds(self, sources: list) -> bool:
        return len(self.sources) >= len(sources) and all(
            a is b for a, b in zip(self.sources, sources)
        )


class GroupedDepthSources(DepthSources):
    """Full AttnRes's sources mixed in groups of readers (module docstring)."""

    def __init__(self, v0: torch.Tensor, queries: torch.Tensor, eps: float, capacity: int):
        self.capacity, self.buffer, self.group = capacity, None, None
        super().__init__(v0, queries, eps)

    def append(self, v: torch.Tensor) -> None:
        if self.values:  # a sublayer output (v_0 stays apart)
            if self.buffer is None:
                self.buffer = OutputBuffer(v, self.capacity)
            if (
                self.buffer.holds(self.values[1:])
                and len(self.buffer.sources) == len(self.values) - 1
            ):
                self.buffer.push(v)
        super().append(v)

    def fork(self, queries: torch.Tensor) -> "GroupedDepthSources":
        other = super().fork(queries)
        other.group = None  # phase 1 again over the fork's own sources and logits
        return other

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.next_reader
        if r not in self.reads:
            self.reads = {r: self._mix(r)}
        return self.reads[r]

    def _cached_group(self, r: int):
        """(its first reader, cached source count, h (G, N, d), lse (G, N)) of the phase 1 that
        covers reader r, made now if the one held does not: for the readers from r to the end of
        r's group, over the sources that exist now."""
        g = self.group
        if (
            g is not None
            and g[0] // GROUP == r // GROUP
            and g[0] <= r < g[0] + len(g[2])
            and g[4] is self.values[0]
        ):
            return g
        c = len(self.values)
        readers = range(r, min(r // GROUP * GROUP + GROUP, len(self.logits)))
        logits = at_least_fp32(torch.stack([torch.stack(self.logits[q][:c]) for q in readers]))
        B, T, d = self.values[0].shape
        view = self._view(1, c)
        held = self.values[1:c] if torch.is_grad_enabled() else []
        h, lse = GroupMix.apply(
            logits.view(len(readers), c, B * T), self.values[0].reshape(B * T, d), view, *held
        )
        self.group = (r, c, h, lse, self.values[0])
        return self.group

    def _view(self, lo: int, hi: int) -> torch.Tensor:
        """Sources lo..hi - 1 (sublayer outputs: lo >= 1) as (N, hi - lo, d): the buffer's slots
        where it holds them, else stacked (outputs of another dtype, or a pass that resumed
        another's state)."""
        B, T, d = self.values[0].shape
        outputs = self.values[lo:hi]
        buf = self.buffer
        if buf is not None and buf.holds(self.values[1:hi]):
            return buf.values[:, :, lo - 1 : hi - 1].reshape(B * T, hi - lo, d)
        if not outputs:
            return self.values[0].new_empty(B * T, 0, d)
        return torch.stack([t.reshape(B * T, d) for t in outputs], dim=1)

    def _mix(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, c, h, lse, _ = self._cached_group(r)
        B, T, d = self.values[0].shape
        h_g, lse_g = h[r - start], lse[r - start]  # (N, d), (N,)
        logits = at_least_fp32(torch.stack(self.logits[r]))  # (S, B, T)
        new = self.values[c:]
        if new:  # phase 2: the group's own outputs so far, merged online
            held = new if torch.is_grad_enabled() else []
            h_new, lse_new = GroupMix.apply(
                logits[None, c:].reshape(1, len(new), B * T),
                None,
                self._view(c, len(self.values)),
                *held,
            )
            h_g, lse_g = merge(h_g, lse_g, h_new[0], lse_new[0])
        weights = torch.exp(logits - lse_g.view(B, T)).to(self.values[0].dtype)
        return h_g.view(B, T, d).to(self.values[0].dtype), weights


class GroupedAttnResFull(AttnResFull):
    def make_sources(self, h0: torch.Tensor) -> DepthSources:
        # capacity: every sublayer's output
        return GroupedDepthSources(
            h0, self.reader_queries(), self.cfg.norm_eps, capacity=2 * self.cfg.n_layer
        )


SWAPS = {("cuda", AttnResFull): GroupedAttnResFull}
