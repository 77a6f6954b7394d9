"""The model adapter (depthbench.models.adapter) of a pretrained transformers causal LM.

The trunk is the model's own decoder, layer by layer:

    begin(idx)      the state entering decoder layer 1: h_0, the embedding output as the
                    base model hands it to its first layer (Gemma's sqrt(d) scale included),
                    and the keyword arguments the base model passes to each layer (attention
                    mask or None for plain causal attention, rotary cos/sin, position ids; the
                    KV cache off)
    step(state, l)  decoder layer l called exactly as the base model calls it
    residual(state) the hidden state: h_l is the output of decoder layer l, h_L the input of the
                    final norm (transformers' last `hidden_states` entry is the final norm's
                    output, not h_L)
    logits(state)   final norm, LM head, and the family's final logit soft-capping (Gemma 2/3)

How the layer arguments are obtained: one pass of the base model with every decoder layer's
`forward` replaced by a recorder that keeps (hidden state, keyword arguments) and returns its
input. That runs transformers' own embedding, mask and rotary code (per layer type where Gemma
and Qwen mix sliding-window and full layers) for the price of an embedding lookup and a norm, so
nothing of it is re-implemented here and the layers see what they see in `model(idx)`.

Interventions act on the decoder layer as a whole (docs/design/pretrained.md):
`skip` is the identity on the hidden state, `swapped` exchanges every parameter of two decoder
layers (constants bound to a position, such as a layer's index or its sliding window, and the
per-layer arguments stay where they are), `replace` puts given hidden states in the layer's
output. `layer_io` is (hidden before, hidden after, state after).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace as with_fields
from typing import Any, Iterator

import torch
from torch import nn

from depthbench.models.adapter import ModelAdapter, swapped_parameters
from depthbench.models.base import GENERIC_PROBES
from depthbench.pretrained.families import Family, family_of


@dataclass(frozen=True)
class HFState:
    """The trunk state between two decoder layers: the hidden state (N, T, d) and the keyword
    arguments of every decoder layer for this input (shared by all states of one pass)."""

    hidden: torch.Tensor
    layer_kwargs: tuple[dict[str, Any], ...]


@dataclass
class LMOutput:
    """What the NLL stage reads from `model(idx)` (depthbench.evals.nll.score_windows)."""

    logits: torch.Tensor


@contextmanager
def _recording(layers: nn.ModuleList) -> Iterator[list]:
    """Within the context each decoder layer returns its input and records (input, kwargs)."""
    calls: list = [None] * len(layers)

    def recorder(i: int):
        def forward(hidden_states, *args, **kwargs):
            if args:  # every family passes all but the hidden state by keyword
                raise TypeError(
                    f"decoder layer {i + 1} was called with {len(args)} positional arguments "
                    "beyond the hidden state"
                )
            calls[i] = (hidden_states, kwargs)
            return hidden_states

        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    try:
        yield calls
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


class PretrainedAdapter(nn.Module, ModelAdapter):
    """A transformers *ForCausalLM of a supported family (depthbench.pretrained.families) seen
    through the model adapter. `adapter(idx).logits` are the model's own logits (for the NLL
    stage); everything else goes through the fold begin / step / logits."""

    # prefix_average patches DepthBench's own attention sublayer, which these models do not have
    probes = GENERIC_PROBES - {"prefix_average"}
    figures = frozenset()

    def __init__(self, model: nn.Module, family: Family | None = None):
        super().__init__()
        self.family = family or family_of(model)
        self.model = model.eval()
        self.arch_name = self.family.name
        base, layers, _, _ = self.family.parts(model)
        self.n_layer = int(model.config.num_hidden_layers)
        if len(layers) != self.n_layer:
            raise ValueError(
                f"{type(model).__name__}: {len(layers)} decoder layers "
                f"but config.num_hidden_layers = {self.n_layer}"
            )
        self.d_model = int(model.config.hidden_size)

    # -- parts of the wrapped model (looked up on each call: they move with deepcopy and .to) -----
    @property
    def base(self) -> nn.Module:
        return self.family.parts(self.model)[0]

    @property
    def layers(self) -> nn.ModuleList:
        return self.family.parts(self.model)[1]

    def forward(self, idx: torch.Tensor) -> LMOutput:
        return LMOutput(self.model(input_ids=idx, use_cache=False).logits)

    # -- the fold -------------------------------------------------------------------------------
    def begin(self, idx: torch.Tensor) -> HFState:
        with _recording(self.layers) as calls:
            self.base(input_ids=idx, use_cache=False)
        missing = [i + 1 for i, c in enumerate(calls) if c is None]
        if missing:
            raise RuntimeError(
                f"{type(self.model).__name__}: the base model did not call decoder layers {missing}"
            )
        return HFState(calls[0][0], tuple(kwargs for _, kwargs in calls))

    def step(self, state: HFState, layer: int) -> HFState:
        out = self.layers[layer - 1](state.hidden, **state.layer_kwargs[layer - 1])
        return with_fields(state, hidden=out[0] if isinstance(out, tuple) else out)

    def residual(self, state: HFState) -> torch.Tensor:
        return state.hidden

    def logits(self, state: HFState) -> torch.Tensor:
        return self.lens_logits(state.hidden)

    def lens_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        _, _, norm, head = self.family.parts(self.model)
        logits = head(norm(hidden))
        cap = (
            getattr(self.model.config, "final_logit_softcapping", None)
            if self.family.softcap
            else None
        )
        if cap:  # Gemma 2/3: c tanh(z / c), as *ForCausalLM.forward applies it
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- interventions: the decoder layer as a whole ----------------------------------------------
    def skip(self, state: HFState, layer: int) -> HFState:
        return state  # states are values: the layer removed passes the hidden state on unchanged

    def layer_io(self, state: HFState, layer: int):
        after = self.step(state, layer)
        return state.hidden, after.hidden, after

    def replace(self, state: HFState, layer: int, outputs: torch.Tensor) -> HFState:
        return with_fields(state, hidden=outputs.reshape(state.hidden.shape).to(state.hidden.dtype))

    def swapped(self, a: int, b: int):
        return swapped_parameters(list(self.layers), a, b)

    # -- accounting -------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        """Parameters as stored (a tied LM head counted once)."""
        return sum(p.numel() for p in self.model.parameters())
