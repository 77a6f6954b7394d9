"""MoDA's depth keys (depthbench.models.archs.moda): the (k, v) pairs that each layer leaves for
the later layers' joint softmax over depth, carried from layer to layer and, once a fused joint
attention asks for them (depthbench.kernels.moda_fused), copied as they come into a depth K/V
buffer.
"""

from __future__ import annotations

import weakref

import torch

from depthbench.models.layers import held_for_backward


class DepthBuffer:
    """Preallocated depth keys and values (capacity, B, H_kv, T, hd) of one forward, written slot
    by slot as the layers run (each slot contiguous). `sources` are weak references to the
    tensors the slots were copied from, in order: a slot's gradient is returned to its tensor,
    and the buffer must not keep a tensor alive that nothing else needs (after the forward the
    tensors live only where autograd, or a checkpointed unit's inputs, keep them, which is what
    the memory estimate counts). Capacity doubles when full (an O(D) copy, amortised), so the
    keys are never re-stacked."""

    def __init__(self, like: torch.Tensor, capacity: int):
        # one buffer-sized gradient in backward (held_for_backward's default): each slot's
        # gradient is its own tensor, returned to the key it was copied from; the estimate is
        # then 1.01-1.08 times MoDA's peaks measured on an H200
        self.k = held_for_backward(like.new_empty(max(capacity, 1), *like.shape))
        self.v = held_for_backward(torch.empty_like(self.k))
        self.sources: list[tuple[weakref.ref, weakref.ref]] = []

    def fits(self, t: torch.Tensor) -> bool:
        return t.shape == self.k.shape[1:] and t.dtype == self.k.dtype and t.device == self.k.device

    def push(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        n = len(self.sources)
        if n == self.k.shape[0]:  # full: double (never during a model's own forward, sized to it)
            self.k = held_for_backward(torch.cat([self.k, torch.empty_like(self.k)]))
            self.v = held_for_backward(torch.cat([self.v, torch.empty_like(self.v)]))
        with (
            torch.no_grad()
        ):  # a cache of values: gradients reach the sources through _JointAttention
            self.k[n].copy_(pair[0])
            self.v[n].copy_(pair[1])
        self.sources.append((weakref.ref(pair[0]), weakref.ref(pair[1])))

    def holds(self, pairs: list) -> bool:
        """Whether the first len(pairs) slots are exactly these tensors."""
        return len(self.sources) >= len(pairs) and all(
            rk() is k and rv() is v for (rk, rv), (k, v) in zip(self.sources, pairs)
        )

    def tensors(self, n_pairs: int) -> list[torch.Tensor] | None:
        """The tensors of the first n_pairs slots (k_1, v_1, k_2, ...), or None if one is gone."""
        out = [ref() for pair in self.sources[:n_pairs] for ref in pair]
        return None if any(t is None for t in out) else out


class DepthKeys:
    """The (k, v) pairs (B, H_kv, T, hd) that earlier layers left for later ones, in order.

    A plain object rather than a list on purpose: module hooks that walk a forward's arguments
    as a pytree (FSDP2 moving inputs, for one) rebuild the lists they find, and every layer must
    append to the very object the next layer reads. Iterating gives the pairs.

    With `buffered` (a fused joint attention reads them: depthbench.kernels.moda_fused) the pairs
    are also copied, as they come, into a `DepthBuffer` sized for `capacity` pairs, which forks
    share: a fork appends in place while it is the buffer's longest user, and otherwise (a probe
    resuming from an earlier state, or `pairs` edited from outside) `buffer()` rebuilds one from
    `pairs` on the next read. The definition's explicit attention stacks the pairs instead."""

    def __init__(self, pairs: list | None = None, capacity: int = 0, buffered: bool = False):
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = list(pairs or [])
        self.capacity, self.buffered = capacity, buffered
        self._buffer: DepthBuffer | None = None

    def append(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        buf, n = self._buffer, len(self.pairs)
        self.pairs.append(pair)
        if not self.buffered:
            return
        if buf is None and n == 0:
            buf = self._buffer = DepthBuffer(pair[0], self.capacity)
        if (
            buf is not None
            and len(buf.sources) == n
            and buf.holds(self.pairs[:n])
            and all(map(buf.fits, pair))
        ):
            buf.push(pair)

    def buffer(self) -> DepthBuffer | None:
        """A buffer whose first len(self) slots hold exactly `pairs` (None if they differ in
        shape)."""
        if self._buffer is not None and self._buffer.holds(self.pairs):
            return self._buffer
        if not self.pairs:
            return None
        buf = DepthBuffer(self.pairs[0][0], max(self.capacity, len(self.pairs)))
        if not all(buf.fits(t) for pair in self.pairs for t in pair):
            return None
        for pair in self.pairs:
            buf.push(pair)
        self._buffer = buf
        return buf

    def fork(self) -> "DepthKeys":
        """A copy that later layers may extend without changing this one (tensors shared)."""
        other = DepthKeys(self.pairs, self.capacity, self.buffered)
        other._buffer = self._buffer
        return other

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self):
        return iter(self.pairs)
