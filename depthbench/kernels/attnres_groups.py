"""AttnRes's depth mix in two phases over groups of readers: the CUDA backend's implementation of
Full and Block AttnRes (depthbench.kernels.swap), swapped in for the definition's mix of one
multiply-add per source and reader.

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
   does: lse = logaddexp(lse_g, lse'), h = exp(lse_g - lse) h_g + exp(lse' - lse) h' (`Merge`,
   which keeps neither h_g nor h' for backward: only the reader's own input, which its sublayer
   keeps anyway).

The sources are stored as they come: v_0 (the embedding output, fp32 under autocast) apart, the
sublayer outputs (the training dtype: bf16 under autocast) in one buffer of their own dtype, written
once each, so that nothing is rounded and a bf16 source takes half an fp32 one's bytes. The products
run in at least float32 (the buffer's slots upcast as they are read), as the definition's mixing
does. The logits are the definition's (each source's against every later reader's effective query,
from one matmul when the source is added), and the depth weights the probes record are exp(l - lse)
of them. `GROUP` = 8: the sources are read about 8 times less often, while phase 2 mixes at most 7
sources per reader.

Block AttnRes groups the readers of one block: they all see v_0 and the same completed block
sums, read once for the block in phase 1; phase 2 is the block's partial sum.

The products over the sources here are batched matmuls (`torch_products`, `torch_gradients`);
where triton is installed the CUDA backend swaps in the same schedule with them in Triton
(depthbench.kernels.attnres_triton), and this module's classes are what runs without triton. On
the CPU the definition's loop is faster than batched products (docs/design/architectures.md), so
the CPU backend keeps it.
"""

from __future__ import annotations

import torch

from depthbench.models.archs.attnres_block import AttnResBlocks, BlockSources, block_ends
from depthbench.models.archs.attnres_full import AttnResFull
from depthbench.models.archs.attnres_sources import DepthSources, rms_unit
from depthbench.models.layers import at_least_fp32, held_for_backward
from depthbench.models.precision import autocast_off

GROUP = 8  # readers mixed together in phase 1
# Buffer-sized gradients the backward of the mixes holds at once (the memory estimate's held
# working set): a group's gradient of its cached sources is one (N, c, d) tensor, returned to the
# sources as views of it, so it lives until every source it reaches has received another group's
# gradient or run its own backward, while the sources' accumulated gradients wait for their
# producers.
GRADIENT_COPIES = 2.0


class GroupMix(torch.autograd.Function):
    """The softmax of G readers over S sources and their weighted sums: logits (G, S, N),
    `first` (N, d) or None (v_0, kept apart), the buffer's view of the other sources
    (N, S', d), `merged` (a list of G flags, see below), then the tensors the buffer's slots
    were copied from -> h (G, N, d) and lse (G, N), in the logits' dtype (at least fp32). The
    buffer is a cache of values, written in place by later sources (the slots viewed here never
    change): held on ctx, not saved, and each slot's gradient is returned to the tensor it was
    copied from.

    With h = sum_i p_i v_i, the logits' gradient is p_i (dh . v_i - dh . h + dlse). A reader
    whose (h, lse) goes into a `Merge` (its flag set in `merged` by the merge) receives from it
    s dh and, for its lse, -s dh . h_out, h_out the merged output and s its share: so that the
    merge need not keep this h for backward, the centring term dh . h, which the merge cannot
    form without it, is then not subtracted here (it is within -s dh . h_out). For the other
    readers the gradients are the plain ones.

    The products over the sources (`torch_products`, `torch_gradients`: batched matmuls) are
    what a subclass replaces (depthbench.kernels.attnres_triton): it passes its own to
    `mix_forward`, which keeps them on ctx for `mix_backward`."""

    @staticmethod
    def forward(ctx, logits, first, view, merged, *sources):
        return mix_forward(
            ctx, (torch_products, torch_gradients), logits, first, view, merged, sources
        )

    @staticmethod
    def backward(ctx, grad_h, grad_lse):
        return mix_backward(ctx, grad_h, grad_lse)


def mix_forward(ctx, kernels, logits, first, view, merged, sources):
    """GroupMix's forward with `kernels` = (products, gradients) (see torch_products)."""
    with autocast_off(logits.device.type):  # on meta: the memory trace's replay pauses
        lse = torch.logsumexp(logits, dim=1)  # (G, N)
        h = kernels[0](logits, lse, first, view)
    ctx.save_for_backward(logits, lse, first)
    ctx.view, ctx.sources, ctx.merged = view, [(t.shape, t.dtype) for t in sources], merged
    ctx.gradients = kernels[1]
    return h, lse


def mix_backward(ctx, grad_h, grad_lse):
    """GroupMix's backward: the sources' gradients from ctx.gradients, the logits' here."""
    with autocast_off(grad_h.device.type):
        logits, lse, first = ctx.saved_tensors
        dtype = logits.dtype
        p = torch.exp(logits - lse[:, None])  # (G, S, N)
        dq, grad_first, grad_view = ctx.gradients(logits, lse, p, first, ctx.view, grad_h.to(dtype))
        # dq_i = dh . v_i; with h = sum_i p_i v_i: dlogit_i = p_i (dq_i - dh . h + dlse)
        plain = torch.tensor([not m for m in ctx.merged], dtype=dtype, device=dq.device)
        centred = dq - (p * dq).sum(1, keepdim=True) * plain[:, None, None]
        if grad_lse is not None:
            centred = centred + grad_lse.to(dtype)[:, None, :]
        grad_sources = []
        if ctx.sources:
            grad_sources = [
                g.view(shape).to(t_dtype)
                for g, (shape, t_dtype) in zip(grad_view.unbind(1), ctx.sources)
            ]
        if first is not None:
            grad_first = grad_first.to(first.dtype)
        return p * centred, grad_first, None, None, *grad_sources


def torch_products(logits, lse, first, view):
    """h (G, N, d) = sum_s exp(logits - lse)_s v_s in the logits' dtype, v_0 = `first` (when not
    None), v_1.. the slots of `view` (N, S', d): every source read once for the G readers, as
    bmm (the v_0 term an outer product), so that torch.utils.flop_counter counts the 2 S d
    FLOPs per token and reader that depthbench.models.cost charges."""
    dtype = logits.dtype
    p = torch.exp(logits - lse[:, None]).permute(2, 0, 1)  # (N, G, S)
    k = 0 if first is None else 1
    h = p.new_zeros(p.shape[0], p.shape[1], view.shape[2])
    if first is not None:  # (N, G, 1) x (N, 1, d)
        h = torch.bmm(p[..., :1], first.to(dtype)[:, None])
    if view.shape[1]:  # (N, G, S') x (N, S', d)
        h = h + torch.bmm(p[..., k:], view.to(dtype))
    return h.transpose(0, 1)


def torch_gradients(logits, lse, p, first, view, dh):
    """From dh (G, N, d) and p = exp(logits - lse) (G, S, N): dq (G, S, N), dq_s = dh . v_s,
    and the gradients of `first` (N, d) and of the view's slots (N, S', d), in the logits'
    dtype (4 S d FLOPs per token and reader, as bmm)."""
    dtype = logits.dtype
    p = p.permute(2, 0, 1)  # (N, G, S)
    dh = dh.transpose(0, 1)  # (N, G, d)
    parts, grad_first, grad_view = [], None, None
    k = 0 if first is None else 1
    if first is not None:
        parts.append(torch.bmm(dh, first.to(dtype)[:, :, None]))  # (N, G, 1)
        grad_first = torch.bmm(p[..., :1].transpose(1, 2), dh).squeeze(1)
    if view.shape[1]:
        parts.append(torch.bmm(dh, view.to(dtype).transpose(1, 2)))  # (N, G, S')
        # every source's gradient for the G readers at once: (N, S', G) x (N, G, d)
        grad_view = torch.bmm(p[..., k:].transpose(1, 2), dh)
    return torch.cat(parts, dim=2).permute(1, 2, 0), grad_first, grad_view


class Merge(torch.autograd.Function):
    """Two softmax-weighted sums over disjoint sets of sources as one over their union (the
    online softmax's merge): lse = logaddexp(lse1, lse2), h = s1 h1 + s2 h2 with
    s_k = exp(lse_k - lse). Keeps s1, s2 and h (the reader's input, which its sublayer keeps
    anyway) for backward, not h1 and h2; returns s_k dh for h_k and -s_k dh . h for lse_k, the
    convention of `GroupMix` for merged readers (see there)."""

    @staticmethod
    def forward(ctx, h1, lse1, h2, lse2):
        lse = torch.logaddexp(lse1, lse2)
        s1, s2 = torch.exp(lse1 - lse), torch.exp(lse2 - lse)
        h = s1.unsqueeze(-1) * h1 + s2.unsqueeze(-1) * h2
        ctx.save_for_backward(s1, s2, h)
        return h, lse

    @staticmethod
    def backward(ctx, grad_h, grad_lse):
        s1, s2, h = ctx.saved_tensors
        grad_h = grad_h.to(h.dtype)
        centre = torch.linalg.vecdot(grad_h, h)  # dh . h
        if grad_lse is not None:  # lse's own use (none in the models: the weights detach it)
            centre = centre - grad_lse
        return (
            s1.unsqueeze(-1) * grad_h,
            -s1 * centre,
            s2.unsqueeze(-1) * grad_h,
            -s2 * centre,
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


class GroupedMix:
    """What the grouped subclasses of DepthSources add (module docstring): the sublayer outputs
    (Full AttnRes) or block sums (Block AttnRes) in one buffer of their dtype, v_0 apart, and
    each reader's mix from its group's phase 1 and its own phase 2. `_group_end(r)`: the reader
    after the last of r's group."""

    def __init__(self, *args, capacity: int, mix: type = GroupMix, **kwargs):
        self.capacity, self.buffer, self.group, self.group_mix = capacity, None, None, mix
        super().__init__(*args, **kwargs)

    def append(self, v: torch.Tensor) -> None:
        if self.values:  # after v_0, which stays apart
            if self.buffer is None:
                self.buffer = OutputBuffer(v, self.capacity)
            if (
                self.buffer.holds(self.values[1:])
                and len(self.buffer.sources) == len(self.values) - 1
            ):
                self.buffer.push(v)
        super().append(v)

    def fork(self, queries: torch.Tensor, key: tuple | None = None):
        other = super().fork(queries, key)
        other.group = None  # phase 1 again over the fork's own sources and logits
        return other

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.next_reader
        if r not in self.reads:
            self.reads = {r: self._mix(r)}
        return self.reads[r]

    def _cached_group(self, r: int):
        """(its first reader, cached source count, h (G, N, d), lse (G, N), v_0) of the phase 1
        that covers reader r, made now if the one held does not: for the readers from r to the
        end of r's group, over the sources that exist now."""
        g = self.group
        if g is not None and g[0] <= r < g[0] + len(g[2]) and g[4] is self.values[0]:
            if self._group_end(g[0]) == self._group_end(r):
                return g
        c = len(self.values)
        readers = range(r, self._group_end(r))
        logits = at_least_fp32(torch.stack([torch.stack(self.logits[q][:c]) for q in readers]))
        B, T, d = self.values[0].shape
        held = self.values[1:c] if torch.is_grad_enabled() else []
        merged = [False] * len(readers)
        h, lse = self.group_mix.apply(
            logits.view(len(readers), c, B * T),
            self.values[0].reshape(B * T, d),
            self._view(1, c),
            merged,
            *held,
        )
        self.group = (r, c, h, lse, self.values[0], merged)
        return self.group

    def _view(self, lo: int, hi: int) -> torch.Tensor:
        """Sources lo..hi - 1 (not v_0: lo >= 1) as (N, hi - lo, d): the buffer's slots where it
        holds them, else stacked (sources of another dtype, or a pass that resumed another's
        state)."""
        B, T, d = self.values[0].shape
        outputs = self.values[lo:hi]
        buf = self.buffer
        if buf is not None and buf.holds(self.values[1:hi]):
            return buf.values[:, :, lo - 1 : hi - 1].reshape(B * T, hi - lo, d)
        if not outputs:
            return self.values[0].new_empty(B * T, 0, d)
        return torch.stack([t.reshape(B * T, d) for t in outputs], dim=1)

    def _phase1(self, r: int):
        """Reader r's (h (N, d), lse (N,)) over its group's cached sources, the count of those,
        and a function that merges another (h, lse) into them (phase 2)."""
        start, c, h, lse, _, merged = self._cached_group(r)
        j = r - start

        def merge(h2: torch.Tensor, lse2: torch.Tensor, merged2: list):
            merged[j] = merged2[0] = True
            return Merge.apply(h[j], lse[j], h2, lse2)

        # a tensor of its own: a view of the group's (G, N, d) would keep all of it alive for
        # as long as this reader's sublayer keeps its input
        return h[j].clone(), lse[j], c, merge


class GroupedDepthSources(GroupedMix, DepthSources):
    """Full AttnRes's sources: groups of GROUP consecutive readers; phase 2 over the group's own
    outputs."""

    def _group_end(self, r: int) -> int:
        return min(r // GROUP * GROUP + GROUP, len(self.logits))

    def _mix(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, lse, c, merge = self._phase1(r)
        B, T, d = self.values[0].shape
        logits = at_least_fp32(torch.stack(self.logits[r]))  # (S, B, T)
        if len(self.values) > c:  # phase 2: the group's own outputs so far, merged online
            new, merged = self.values[c:], [True]
            h2, lse2 = self.group_mix.apply(
                logits[None, c:].reshape(1, len(new), B * T),
                None,
                self._view(c, len(self.values)),
                merged,
                *(new if torch.is_grad_enabled() else []),
            )
            h, lse = merge(h2[0], lse2[0], merged)
        weights = torch.exp(logits - lse.detach().view(B, T)).to(self.values[0].dtype)
        return h.view(B, T, d).to(self.values[0].dtype), weights


class GroupedBlockSources(GroupedMix, BlockSources):
    """Block AttnRes's sources: a group is the readers of one block, which all see v_0 and the
    same completed block sums (read once for the block); phase 2 is the block's partial sum."""

    def _group_end(self, r: int) -> int:
        last = len(self.logits) - 1  # the final aggregation, alone
        if r >= last:
            return last + 1
        layer = r // 2 + 1
        return min(2 * min(e for e in self.ends if e >= layer), last)

    def _mix(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, lse, c, merge = self._phase1(r)
        B, T, d = self.values[0].shape
        logits = self.logits[r][:c]
        if self.partial is not None:  # phase 2: the partial sum, as one more source
            # a (d, 1) matrix, as the definition's: a product torch.utils.flop_counter counts
            partial_logit = (rms_unit(self.partial, self.eps) @ self.queries[:, r, None])[..., 0]
            logits = [*logits, partial_logit]
            merged = [True]
            h2, lse2 = self.group_mix.apply(
                at_least_fp32(partial_logit).reshape(1, 1, B * T),
                self.partial.reshape(B * T, d),
                self.values[0].new_empty(B * T, 0, d),
                merged,
            )
            h, lse = merge(h2[0], lse2[0], merged)
        logits = at_least_fp32(torch.stack(logits))
        weights = torch.exp(logits - lse.detach().view(B, T)).to(self.values[0].dtype)
        return h.view(B, T, d).to(self.values[0].dtype), weights


class GroupedAttnResFull(AttnResFull):
    group_mix = GroupMix  # the products over the sources (a subclass swaps in its kernels)

    def make_sources(self, h0: torch.Tensor) -> DepthSources:
        # capacity: every sublayer's output
        return GroupedDepthSources(
            h0,
            self.reader_queries(),
            self.cfg.norm_eps,
            capacity=2 * self.cfg.n_layer,
            mix=self.group_mix,
        )


class GroupedAttnResBlocks(AttnResBlocks):
    group_mix = GroupMix

    def make_sources(self, h0: torch.Tensor) -> BlockSources:
        ends = block_ends(self.cfg.n_layer, self.options.n_blocks)
        queries, eps = self.reader_queries(), self.cfg.norm_eps
        # capacity: the block sums
        return GroupedBlockSources(h0, queries, eps, ends, capacity=len(ends), mix=self.group_mix)


SWAPS = {
    ("cuda", AttnResFull): GroupedAttnResFull,
    ("cuda", AttnResBlocks): GroupedAttnResBlocks,
}
