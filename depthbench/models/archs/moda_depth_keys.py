"""MoDA's depth keys (depthbench.models.archs.moda): the (k, v) pairs that each layer leaves for
the later layers' joint softmax over depth, carried from layer to layer and, for the fused
attention, copied as they come into a depth K/V buffer (depthbench.models.archs.moda_fused).
"""

from __future__ import annotations

import torch

from depthbench.models.archs.moda_fused import DepthBuffer


class DepthKeys:
    """The (k, v) pairs (B, H_kv, T, hd) that earlier layers left for later ones, in order.

    A plain object rather than a list on purpose: module hooks that walk a forward's arguments
    as a pytree (FSDP2 moving inputs, for one) rebuild the lists they find, and every layer must
    append to the very object the next layer reads. Iterating gives the pairs.

    With `buffered` (the fused attention) the pairs are also copied, as they come, into a
    `DepthBuffer` sized for `capacity` pairs, which forks share: a fork appends in place while it
    is the buffer's longest user, and otherwise (a probe resuming from an earlier state, or
    `pairs` edited from outside) `buffer()` rebuilds one from `pairs` on the next read."""

    def __init__(self, pairs: list | None = None, capacity: int = 0, buffered: bool = True):
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
