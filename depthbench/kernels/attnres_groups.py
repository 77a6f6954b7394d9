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
   earlier sublayers, j < G) are merged in as an online softmax does: h_g is one more source,
   whose logit is lse_g, so that lse = logsumexp(lse_g, l_1 .. l_j) and
   h = exp(lse_g - lse) h_g + sum_i exp(l_i - lse) v_i, in one product (`MergeMix`, which keeps
   for backward the probabilities and the reader's own input, which its sublayer keeps anyway,
   not h_g).

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

from typing import NamedTuple

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
    """Phase 1: the softmax of G readers over S sources and their weighted sums. Takes
    `kernels` (the products over the sources: TORCH, or another backend's pair with the same
    signatures), logits (G, S, N), `first` (N, d) or None (v_0, kept apart), the buffer's view
    of the other sources (N, S', d), `merged` (a list of G flags, see below), then the tensors
    the buffer's slots were copied from -> h (G, N, d) and lse (G, N), in the logits' dtype (at
    least fp32). The buffer is a cache of values, written in place by later sources (the slots
    viewed here never change): held on ctx, not saved, and each slot's gradient is returned to
    the tensor it was copied from.

    With h = sum_i p_i v_i, the logits' gradient is p_i (dh . v_i - dh . h + dlse). A reader
    whose (h, lse) goes into a `MergeMix` (its flag set in `merged` by the merge) receives from
    it s dh and, for its lse, -s (dh . h_out - dlse_out), h_out the merged output and s its
    share: so that nothing need keep this h for backward, the centring term dh . h, which the
    merge cannot form without it, is then not subtracted here (it is within the merge's). For
    the other readers the gradients are the plain ones."""

    @staticmethod
    def forward(ctx, kernels, logits, first, view, merged, *sources):
        with autocast_off(logits.device.type):  # on meta: the memory trace's replay pauses
            lse = torch.logsumexp(logits, dim=1)  # (G, N)
            p = torch.exp(logits - lse[:, None])  # (G, S, N)
            h = kernels[0](p, first, view)
        ctx.save_for_backward(p, first)
        ctx.view, ctx.sources, ctx.merged = view, [(t.shape, t.dtype) for t in sources], merged
        ctx.kernels = kernels
        return h, lse

    @staticmethod
    def backward(ctx, grad_h, grad_lse):
        with autocast_off(grad_h.device.type):
            p, first = ctx.saved_tensors
            dtype = p.dtype
            dq, grad_first, grad_view = ctx.kernels[1](p, first, ctx.view, grad_h.to(dtype))
            # dq_i = dh . v_i; with h = sum_i p_i v_i: dlogit_i = p_i (dq_i - dh . h + dlse)
            plain = torch.tensor([not m for m in ctx.merged], dtype=dtype, device=dq.device)
            centred = dq - (p * dq).sum(1, keepdim=True) * plain[:, None, None]
            if grad_lse is not None:
                centred = centred + grad_lse.to(dtype)[:, None, :]
            if first is not None:
                grad_first = grad_first.to(first.dtype)
            return None, p * centred, grad_first, None, None, *_to_sources(ctx, grad_view)


class MergeMix(torch.autograd.Function):
    """Phase 2 and the merge in one: reader g's cached (h1 (N, d), lse1 (N,)) from phase 1 and
    the j sources added since its group began (their logits (j, N), their values as (N, j, d):
    the buffer's view, or Block AttnRes's partial sum, then the tensors those values are) -> the
    mix over all of them, h (N, d) and lse (N,), as an online softmax merges: h1 is one more
    source, whose logit is lse1.
    `kernels` as GroupMix's (h1 the `first` source of their products).

    Keeps for backward the probabilities and h (the reader's input, which its sublayer keeps
    anyway), not h1. With c = dh . h - dlse: dh1 = s dh and dlse1 = -s c for s = exp(lse1 - lse)
    (GroupMix's convention for merged readers), dlogit_i = p_i (dh . v_i - c), dv_i = p_i dh."""

    @staticmethod
    def forward(ctx, kernels, h1, lse1, logits, view, *sources):
        with autocast_off(h1.device.type):
            both = torch.cat([lse1[None], logits])  # (1 + j, N)
            lse = torch.logsumexp(both, dim=0)
            p = torch.exp(both - lse)  # (1 + j, N)
            h = kernels[0](p[None], h1, view, merge=True)[0]
        ctx.save_for_backward(p, h)
        ctx.view, ctx.sources = view, [(t.shape, t.dtype) for t in sources]
        ctx.kernels = kernels
        return h, lse

    @staticmethod
    def backward(ctx, grad_h, grad_lse):
        with autocast_off(grad_h.device.type):
            p, h = ctx.saved_tensors
            dh = grad_h.to(h.dtype)
            centre = torch.linalg.vecdot(dh, h)  # dh . h
            if grad_lse is not None:
                centre = centre - grad_lse
            dq, _, grad_view = ctx.kernels[1](p[None, 1:], None, ctx.view, dh[None])
            grad_logits = p[1:] * (dq[0] - centre)
            return (
                None,
                p[0, :, None] * dh,
                -p[0] * centre,
                grad_logits,
                None,
                *_to_sources(ctx, grad_view),
            )


def _to_sources(ctx, grad_view) -> list:
    """The view's slots' gradients, each as the gradient of the tensor the slot was copied from
    (views of one tensor; converted to its dtype where the products' dtype differs)."""
    return (
        [g.view(shape).to(t_dtype) for g, (shape, t_dtype) in zip(grad_view.unbind(1), ctx.sources)]
        if ctx.sources
        else []
    )


def torch_products(p, first, view, merge: bool = False):
    """h (G, N, d) = sum_s p_s v_s in p's dtype for the probabilities p (G, S, N), v_0 = `first`
    (when not None), v_1.. the slots of `view` (N, S', d): every source read once for the G
    readers, as bmm (the v_0 term an outer product), so that torch.utils.flop_counter counts the
    2 S d FLOPs per token and reader that depthbench.models.cost charges. `merge`: `first` is a
    reader's cached mix (MergeMix), not a source of the definition, and its term is an
    elementwise product the counter leaves out, as the charged FLOPs do."""
    dtype = p.dtype
    p = p.permute(2, 0, 1)  # (N, G, S)
    k = 0 if first is None else 1
    h = p.new_zeros(p.shape[0], p.shape[1], view.shape[2])
    if first is not None and merge:
        h = p[..., :1] * first.to(dtype)[:, None]
    elif first is not None:  # (N, G, 1) x (N, 1, d)
        h = torch.bmm(p[..., :1], first.to(dtype)[:, None])
    if view.shape[1]:  # (N, G, S') x (N, S', d)
        h = h + torch.bmm(p[..., k:], view.to(dtype))
    return h.transpose(0, 1)


def torch_gradients(p, first, view, dh):
    """From dh (G, N, d) and the probabilities p (G, S, N): dq (G, S, N), dq_s = dh . v_s, and
    the gradients of `first` (N, d) and of the view's slots (N, S', d), in p's dtype (4 S d
    FLOPs per token and reader, as bmm)."""
    dtype = p.dtype
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


TORCH = (torch_products, torch_gradients)  # the products over the sources, in PyTorch


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


class Group(NamedTuple):
    """A phase 1 made for readers start .. start + len(h) - 1 over the first `cached` sources."""

    start: int
    cached: int
    h: tuple  # each reader's (N, d), unbound from the group's (G, N, d)
    lse: tuple  # each reader's (N,)
    v0: torch.Tensor  # the pass's v_0 (another pass's group is not this one's)
    merged: list  # the readers' flags for GroupMix (set by their merges)
    grad: bool  # made with autograd


class GroupedMix:
    """What the grouped subclasses of DepthSources add (module docstring): the sublayer outputs
    (Full AttnRes) or block sums (Block AttnRes) in one buffer of their dtype, v_0 apart, and
    each reader's mix from its group's phase 1 and its own phase 2. `_group_end(r)`: the reader
    after the last of r's group."""

    def __init__(self, *args, capacity: int, kernels: tuple = TORCH, **kwargs):
        self.capacity, self.buffer, self.group, self.kernels = capacity, None, None, kernels
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
        """The phase 1 that covers reader r, made now if the one held does not (or was made in
        the other grad mode: one made without autograd carries no gradient): for the readers
        from r to the end of r's group, over the sources that exist now. h and lse are unbound:
        one autograd node stacks the readers' gradients (indexing would give each reader a node
        that writes its gradient into a zero (G, N, d) tensor)."""
        g, grad = self.group, torch.is_grad_enabled()
        if g is not None and g.start <= r < g.start + len(g.h) and g.v0 is self.values[0]:
            if self._group_end(g.start) == self._group_end(r) and g.grad == grad:
                return g
        c = len(self.values)
        readers = range(r, self._group_end(r))
        logits = at_least_fp32(torch.stack([torch.stack(self.logits[q][:c]) for q in readers]))
        B, T, d = self.values[0].shape
        held = self.values[1:c] if grad else []
        merged = [False] * len(readers)
        h, lse = GroupMix.apply(
            self.kernels,
            logits.view(len(readers), c, B * T),
            self.values[0].reshape(B * T, d),
            self._view(1, c),
            merged,
            *held,
        )
        self.group = Group(r, c, h.unbind(0), lse.unbind(0), self.values[0], merged, grad)
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
        and a function that merges into them the sources added since (phase 2)."""
        group = self._cached_group(r)
        h, lse, merged, j = group.h, group.lse, group.merged, r - group.start

        def merge(logits: torch.Tensor, view: torch.Tensor, sources: list):
            """(h, lse) over the cached sources and `sources`: their logits (j, N), their values
            as (N, j, d) (the buffer's view, or Block AttnRes's partial sum)."""
            if merged[j]:  # its gradient would take the centring term twice (GroupMix)
                raise RuntimeError(f"reader {r}'s cached mix is merged a second time")
            merged[j] = True
            held = sources if torch.is_grad_enabled() else []
            return MergeMix.apply(self.kernels, h[j], lse[j], logits, view, *held)

        return h[j], lse[j], group.cached, merge

    @staticmethod
    def _own(h: torch.Tensor) -> torch.Tensor:
        """A reader's cached mix as a tensor of its own, where no merge made one: a view of the
        group's (G, N, d) would keep all of it alive for as long as the reader's sublayer keeps
        its input."""
        return h.clone()


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
            new = self.values[c:]
            h, lse = merge(
                logits[c:].reshape(len(new), B * T), self._view(c, len(self.values)), new
            )
        else:
            h = self._own(h)
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
            partial = self.partial.reshape(B * T, 1, d)
            h, lse = merge(at_least_fp32(partial_logit).reshape(1, B * T), partial.detach(),
                           [self.partial])  # fmt: skip
        else:
            h = self._own(h)
        logits = at_least_fp32(torch.stack(logits))
        weights = torch.exp(logits - lse.detach().view(B, T)).to(self.values[0].dtype)
        return h.view(B, T, d).to(self.values[0].dtype), weights


class GroupedAttnResFull(AttnResFull):
    mix_kernels = TORCH  # the products over the sources (a subclass swaps in its kernels)

    def make_sources(self, h0: torch.Tensor) -> DepthSources:
        # capacity: every sublayer's output
        return GroupedDepthSources(
            h0,
            self.reader_queries(),
            self.cfg.norm_eps,
            capacity=2 * self.cfg.n_layer,
            kernels=self.mix_kernels,
        )


class GroupedAttnResBlocks(AttnResBlocks):
    mix_kernels = TORCH

    def make_sources(self, h0: torch.Tensor) -> BlockSources:
        ends = block_ends(self.cfg.n_layer, self.options.n_blocks)
        queries, eps = self.reader_queries(), self.cfg.norm_eps
        # capacity: the block sums
        return GroupedBlockSources(
            h0, queries, eps, ends, capacity=len(ends), kernels=self.mix_kernels
        )


SWAPS = {
    ("cuda", AttnResFull): GroupedAttnResFull,
    ("cuda", AttnResBlocks): GroupedAttnResBlocks,
}
