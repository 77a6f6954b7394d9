"""The model adapter: the one interface that probes, NLL, cost and figures talk to.

Every DepthBench architecture implements it (`DecoderLM` gives the defaults, an architecture
module overrides what its trunk needs), and so does the wrapper of a pretrained Hugging Face
model. A pass through the trunk is a fold over layers 1..L:

    state_0 = begin(idx)              h_0 = residual(state_0)   (the embedding output)
    state_l = step(state_(l-1), l)    h_l = residual(state_l)   (what layer l + 1 reads)
    logits  = logits(state_L)                                   (final norm and LM head)

h_L is the input of the final norm, never its output. A state is a value: `step`, `skip` and
`replace` never change the state they are given, so a probe can keep the state entering each
layer from one baseline pass and resume any number of changed passes from it.

The three interventions of the probes, with one meaning for every architecture:
- `skip(state, l)`: layer l is removed. The trunk state passes unchanged (the residual stream,
  HC/mHC streams with no mixing, Post-LN with no norm) and nothing of the layer reaches later
  layers (MoDA's depth keys and values of that layer; AttnRes sources, which leave the softmax
  instead of entering it as zeros). Constants bound to positions (LNS's 1/sqrt(l), DeepNorm's
  alpha, AttnRes block boundaries) stay with their positions.
- `swapped(a, b)`: every parameter of layers a and b exchanged (in place, restored on exit);
  position-bound constants stay.
- `replace(state, l, outputs)`: layer l's contribution given from outside: `layer_io` says what
  the layer reads (its input features) and what it contributes (its output features), so that a
  probe can fit any map from one to the other (the usefulness probe fits an affine one) and put
  its result in the layer's place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Iterator

import torch


class ModelAdapter(ABC):
    """What a probe, the NLL stage or the cost table may ask of a model (see the module docstring).

    Attributes every adapter sets: `arch_name` (registry name, or the pretrained model's family),
    `n_layer`, `probes` (the probe families that apply), `figures` (architecture-specific
    figures a grid containing it gets)."""

    arch_name: str
    n_layer: int
    probes: frozenset[str]
    figures: frozenset[str]

    # -- the trunk as a fold over layers ---------------------------------------------------------
    @abstractmethod
    def begin(self, idx: torch.Tensor) -> Any:
        """The trunk state entering layer 1 for token ids `idx` (N, T)."""

    @abstractmethod
    def step(self, state: Any, layer: int) -> Any:
        """The state after layer `layer` (1-based) from the state entering it."""

    @abstractmethod
    def residual(self, state: Any) -> torch.Tensor:
        """h_l (N, T, d) of the state after layer l: what layer l + 1 reads before its own norm;
        for l = L the input of the final norm."""

    @abstractmethod
    def logits(self, state: Any) -> torch.Tensor:
        """LM logits (N, T, V) from the state after the last layer."""

    @abstractmethod
    def lens_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head applied to a residual h_l (N, T, d): the logit lens
        (depthbench.probes.lens). For h_L = residual(state_L) it equals logits(state_L)."""

    # -- interventions -----------------------------------------------------------------------------
    @abstractmethod
    def skip(self, state: Any, layer: int) -> Any:
        """The state after layer `layer` when that layer is removed (see the module docstring)."""

    @abstractmethod
    def layer_io(self, state: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(input features (N, T, k), output features (N, T, m), state after the layer) of layer
        `layer` run on `state`: what `replace` takes the layer's place with."""

    @abstractmethod
    def replace(self, state: Any, layer: int, outputs: torch.Tensor) -> Any:
        """The state after layer `layer` when its output features are `outputs` (N, T, m)."""

    @abstractmethod
    def swapped(self, a: int, b: int):
        """Context manager: every parameter of layers a and b exchanged, restored on exit."""

    # -- records and cost --------------------------------------------------------------------------
    def records(self, idx: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Per-sublayer records of one forward pass: `stream_mixing` (the matrices M acting as
        H <- M H + ..., (N, T, n, n), hc/mhc), `depth_weights` (mean depth-softmax weight per
        source, attnres); empty where the architecture has none."""
        return {}

    def extra_flops_per_token(self, seq_len: int) -> float:
        """Forward matmul FLOPs per token beyond 2 N_mm + attention (depthbench.models.cost)."""
        return 0.0

    def depth_state_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Per-token state a decode step holds across depth beyond the d-vector every model
        holds."""
        return 0


@contextmanager
def swapped_parameters(layers: list[torch.nn.Module], a: int, b: int) -> Iterator[None]:
    """Exchange every parameter of layers a and b (1-based modules in `layers`) in place; restored
    on exit. Attributes that are not parameters (position-bound constants) stay where they are."""
    pa = dict(layers[a - 1].named_parameters())
    pb = dict(layers[b - 1].named_parameters())
    if pa.keys() != pb.keys():
        raise ValueError(f"layers {a} and {b} have different parameters; they cannot be exchanged")

    def exchange() -> None:
        with torch.no_grad():
            for name in pa:
                tmp = pa[name].detach().clone()
                pa[name].copy_(pb[name])
                pb[name].copy_(tmp)

    exchange()
    try:
        yield
    finally:
        exchange()


# -- passes built from the fold ------------------------------------------------------------------
def trunk_states(adapter: ModelAdapter, idx: torch.Tensor) -> list[Any]:
    """states[l] = the state after layer l (states[0]: entering layer 1), one baseline pass."""
    states = [adapter.begin(idx)]
    for layer in range(1, adapter.n_layer + 1):
        states.append(adapter.step(states[-1], layer))
    return states


def run_from(adapter: ModelAdapter, state: Any, first: int) -> Iterator[Any]:
    """The states after layers first, first + 1, .., L of a pass resumed from `state`, the state
    after layer first - 1 (whatever intervention produced it)."""
    for layer in range(first, adapter.n_layer + 1):
        state = adapter.step(state, layer)
        yield state


def hidden_states(adapter: ModelAdapter, idx: torch.Tensor) -> list[torch.Tensor]:
    """h_0 .. h_L of the sample."""
    return [adapter.residual(s) for s in trunk_states(adapter, idx)]


def final_state(adapter: ModelAdapter, state: Any, first: int) -> Any:
    """The state after layer L of a pass resumed at layer `first` from `state`."""
    for state in run_from(adapter, state, first):
        pass
    return state


def next_token_loss(adapter: ModelAdapter, state: Any, targets: torch.Tensor) -> float:
    """Mean next-token cross-entropy (fp32) of the logits of a final state against `targets`."""
    logits = adapter.logits(state)
    return float(
        torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
    )
