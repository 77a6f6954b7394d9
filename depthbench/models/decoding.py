"""Incremental decoding with a KV cache, for every architecture.

Inside `incremental_decoding(model)` each attention layer keeps the keys and values (after RoPE)
of every position it has seen, and the model's position offset advances with each call, so that
`step(idx)` with only the new tokens returns the same logits as a full forward over the whole
sequence. Per-position state that is not kept across tokens (HC/mHC streams, AttnRes sources,
MoDA's depth keys of the current position) is recomputed for the new tokens: it never reads
earlier positions. Used to check the cost table's KV-cache bytes against what a generate-style
pass actually caches, and by `generate`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from depthbench.models.layers import CausalSelfAttention, KVCache


class Decoder:
    def __init__(self, model) -> None:
        self.model = model
        self.caches = [m.cache for m in model.modules() if isinstance(m, CausalSelfAttention)]

    @torch.no_grad()
    def step(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T_new, V) of the new tokens `idx` (B, T_new) given everything before."""
        logits = self.model(idx).logits
        self.model.position_offset += idx.shape[1]
        return logits

    @property
    def position(self) -> int:
        return self.model.position_offset

    def cache_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)


@contextlib.contextmanager
def incremental_decoding(model) -> Iterator[Decoder]:
    attention = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    for m in attention:
        m.cache = KVCache()
    model.position_offset = 0
    try:
        yield Decoder(model)
    finally:
        for m in attention:
            m.cache = None
        model.position_offset = 0


@torch.no_grad()
def generate(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of `prompt` (B, T) by `new_tokens` tokens, with the KV cache."""
    with incremental_decoding(model) as decoder:
        logits = decoder.step(prompt)
        out = [prompt]
        for _ in range(new_tokens):
            nxt = logits[:, -1:].argmax(dim=-1)
            out.append(nxt)
            logits = decoder.step(nxt)
    return torch.cat(out, dim=1)
