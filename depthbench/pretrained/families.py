"""The pretrained model families DepthBench can probe, recognised from the transformers class.

A family says where the decoder's parts live in the transformers model (the base model holding
the decoder layers and the final norm) and whether the LM head's logits are soft-capped. Every
family listed here calls its decoder layers as `layer(hidden_states, **kwargs)` and returns the
new hidden state (transformers 5.24.0: modeling_llama.py, modeling_qwen2.py, modeling_qwen3.py,
modeling_olmo2.py, modeling_gpt_neox.py, modeling_gemma2.py, modeling_gemma3.py), which is what
the adapter relies on (depthbench.pretrained.adapter).

What differs between them is inside the layers (pre-norm Llama/Qwen, post-sublayer norms of
OLMo 2, the parallel residual of GPT-NeoX, the four norms and sliding-window layers of Gemma 2/3)
or in what the base model computes before layer 1 (Gemma's sqrt(d) embedding scale, Gemma 3's
per-layer-type rotary tables): the adapter takes both from transformers as is.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from depthbench.util.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str  # the arch name of the run in DepthBench's tables
    base: str = "model"  # attribute of the *ForCausalLM holding the decoder
    layers: str = "layers"  # attribute of the base model: the decoder layers
    final_norm: str = "norm"  # attribute of the base model: the norm before the LM head
    softcap: bool = False  # logits <- c tanh(logits / c), c = config.final_logit_softcapping

    def parts(self, model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module]:
        """(base model, decoder layers, final norm, LM head) of a model of this family."""
        base = getattr(model, self.base)
        return (
            base,
            getattr(base, self.layers),
            getattr(base, self.final_norm),
            model.get_output_embeddings(),
        )


# transformers class name -> family. Llama covers Llama 2 and 3, SmolLM/SmolLM2 and TinyLlama.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "Qwen2ForCausalLM": Family("qwen2"),
    "Qwen3ForCausalLM": Family("qwen3"),
    "Olmo2ForCausalLM": Family("olmo2"),
    "GPTNeoXForCausalLM": Family("gpt_neox", base="gpt_neox", final_norm="final_layer_norm"),
    "Gemma2ForCausalLM": Family("gemma2", softcap=True),
    "Gemma3ForCausalLM": Family("gemma3", softcap=True),
}


def family_of(model: nn.Module, field: str = "pretrained") -> Family:
    """The family of a loaded transformers model; ConfigError naming its class otherwise."""
    name = type(model).__name__
    if name not in FAMILIES:
        raise ConfigError(
            field,
            f"transformers class {name} is not a supported pretrained family; "
            f"supported classes: {sorted(FAMILIES)}",
        )
    return FAMILIES[name]
