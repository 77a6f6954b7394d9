"""The model adapter of a DepthBench model (depthbench.models.adapter) as a fold over its
layers, on value-level hooks over the architecture's own trunk state.

The defaults serve every architecture whose trunk state is one tensor between layers (the
normalization family, hc, mhc); an architecture with side state (attnres's sources, moda's depth
keys) overrides the hooks in its own module. `DecoderLM` (depthbench.models.base) mixes this in
and supplies what the hooks read: `cfg`, `blocks`, `rope`, `embed_tokens`, `lm_head`,
`final_norm`, `position_offset`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from depthbench.models.adapter import ModelAdapter, swapped_parameters


@dataclass(frozen=True)
class Trunk:
    """A DepthBench model's trunk state between two layers, as the adapter hands it out: the
    architecture's own state (`value`: the residual stream, HC's streams, AttnRes's sources, MoDA's
    stream and depth keys) and the RoPE tables of the pass."""

    value: Any
    rope: tuple[torch.Tensor, torch.Tensor]  # the (cos, sin) RoPE tables


class LayerFold(ModelAdapter):
    """The adapter's methods on value-level hooks over the trunk state (see the module
    docstring)."""

    # -- the trunk state ----------------------------------------------------------------------
    def init_state(self, h0: torch.Tensor):
        """The trunk's state before layer 1 (multi-stream architectures hold n copies)."""
        return h0

    def read_stream(self, state) -> torch.Tensor:
        """h_l from the trunk state after layer l (the sum of streams for hc/mhc)."""
        return state

    # -- layer-by-layer stepping --------------------------------------------------------------
    # The trunk as a fold over layers: state <- layer_step(state, block); the trunk output is
    # trunk_output(state). The adapter methods build on these value-level hooks, so that
    # probes can resume a pass at any layer from a saved state (a permutation that swaps layers
    # a and b leaves layers 1 .. a-1 as they were). An architecture whose state is not one
    # immutable tensor (attnres's source list, moda's depth keys) overrides them, and its
    # `trunk` must take the same steps.
    def layer_step(self, state, block: nn.Module, rope):
        """The trunk state after `block`, from the state before it (no probe records)."""
        return block(state, rope, None)

    def trunk_output(self, state) -> torch.Tensor:
        """h_L from the state after the last layer: what the final norm reads."""
        return self.read_stream(state)

    def fork_state(self, state):
        """A copy of `state` that later layer steps may advance without changing the original.
        Tensor states are never modified in place, so the default shares them."""
        return state

    def skip_layer(self, state, layer: int):
        """The state after layer `layer` removed, from a fork of the state entering it. A
        skipped layer is the identity on the trunk state: for one tensor, the state itself."""
        return state

    def layer_features(self, state, layer: int, rope):
        """(input, output features, state after) of layer `layer`: for one tensor state, the state
        before and after, flattened per token ((N, T, d), or (N, T, n d) for n streams)."""
        after = self.layer_step(self.fork_state(state), self.blocks[layer - 1], rope)
        return _per_token(state), _per_token(after), after

    def from_layer_features(self, state, layer: int, outputs: torch.Tensor, rope):
        """The state after layer `layer` whose output features are `outputs` (see
        layer_features)."""
        return outputs.reshape(state.shape).to(state.dtype)

    # -- the model adapter (depthbench.models.adapter) ------------------------------------------
    @property
    def n_layer(self) -> int:
        return self.cfg.n_layer

    def begin(self, idx: torch.Tensor) -> Trunk:
        return Trunk(
            self.init_state(self.embed_tokens(idx)), self.rope(idx.shape[1], self.position_offset)
        )

    def step(self, state: Trunk, layer: int) -> Trunk:
        return Trunk(
            self.layer_step(self.fork_state(state.value), self.blocks[layer - 1], state.rope),
            state.rope,
        )

    def residual(self, state: Trunk) -> torch.Tensor:
        return self.read_stream(state.value)

    def logits(self, state: Trunk) -> torch.Tensor:
        return self.lens_logits(self.trunk_output(state.value))

    def lens_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(hidden) if self.final_norm is not None else hidden)

    def skip(self, state: Trunk, layer: int) -> Trunk:
        return Trunk(self.skip_layer(self.fork_state(state.value), layer), state.rope)

    def layer_io(self, state: Trunk, layer: int):
        x, y, after = self.layer_features(state.value, layer, state.rope)
        return x, y, Trunk(after, state.rope)

    def replace(self, state: Trunk, layer: int, outputs: torch.Tensor) -> Trunk:
        return Trunk(
            self.from_layer_features(self.fork_state(state.value), layer, outputs, state.rope),
            state.rope,
        )

    def swapped(self, a: int, b: int):
        return swapped_parameters(list(self.blocks), a, b)

    @torch.no_grad()
    def records(self, idx: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        return self(idx, return_internals=True).internals or {}


def _per_token(state: torch.Tensor) -> torch.Tensor:
    """(N, T, ...) -> (N, T, features)."""
    return state.reshape(*state.shape[:2], -1)
