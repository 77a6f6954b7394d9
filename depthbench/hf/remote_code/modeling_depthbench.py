"""transformers model of a DepthBench run exported with `depthbench export` (remote code).

Needs the `depthbench` package importable beside transformers: the model is DepthBench's own
`DecoderLM`, built from the `ModelConfig` in config.json (`depthbench_model`) and holding
DepthBench's parameter names under the prefix `depthbench.`
(`depthbench.blocks.0.attn.wqkv.weight`). Nothing here knows an architecture's parameters, so any
DepthBench state dict loads.

Inputs: token ids only. An attention mask may mark right padding (harmless under causal
attention: no scored position sees it); left padding, inputs_embeds and a KV cache are refused.
`labels` gives the mean next-token cross-entropy, shifted as in transformers' causal LMs.
`output_hidden_states=True` returns DepthBench's h_0 .. h_L (h_L: the input of the final norm).
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_depthbench import DepthBenchConfig


class DepthBenchForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DepthBenchConfig
    base_model_prefix = "depthbench"
    main_input_name = "input_ids"
    _supports_cache_class = False
    _no_split_modules = []

    def __init__(self, config):
        super().__init__(config)
        from depthbench.models.config import ModelConfig
        from depthbench.models.registry import build_model

        self.depthbench = build_model(
            ModelConfig.from_dict(dict(config.depthbench_model)), initialize=False
        )
        self._reference = {}  # a plain dict, so the CPU copy is not registered as a submodule
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loading, then a strict check: every DepthBench parameter must come from
        model.safetensors (a missing one would otherwise be left at a random init)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        bad = {
            k: sorted(v)
            for k, v in info.items()
            if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
        }
        if bad:
            raise ValueError(
                f"DepthBench export {args[0] if args else ''}: "
                "the weights do not match the installed depthbench's "
                f"model ({bad}); install the depthbench version that trained the run"
            )
        return (model, info) if want_info else model

    def _init_weights(self, module):
        """Only non-persistent buffers (RoPE tables) are ever initialized here: transformers
        replaces them with empty tensors while loading. They are copied from a DecoderLM built
        on CPU from the same config, whatever module holds them."""
        if not getattr(module, "_non_persistent_buffers_set", None) or module is self:
            return
        if not self._reference:
            from depthbench.models.config import ModelConfig
            from depthbench.models.registry import build_model

            with torch.device("cpu"):
                self._reference["model"] = build_model(
                    ModelConfig.from_dict(dict(self.config.depthbench_model)), initialize=False
                )
            self._reference["names"] = {id(m): n for n, m in self.depthbench.named_modules()}
        source = self._reference["model"].get_submodule(self._reference["names"][id(module)])
        for name in module._non_persistent_buffers_set:
            with torch.no_grad():
                getattr(module, name).copy_(getattr(source, name))

    def get_input_embeddings(self):
        return self.depthbench.embed

    def get_output_embeddings(self):
        return self.depthbench.lm_head

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        labels=None,
        inputs_embeds=None,
        past_key_values=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("DepthBenchForCausalLM takes input_ids only (no inputs_embeds)")
        if past_key_values is not None:
            raise ValueError("DepthBenchForCausalLM has no KV cache: generate with use_cache=False")
        if attention_mask is not None:
            mask = attention_mask.to(torch.bool)
            # right padding only: each row's mask is 1 ... 1 0 ... 0 (non-increasing)
            if (mask[:, 1:] & ~mask[:, :-1]).any():
                raise ValueError(
                    "DepthBenchForCausalLM supports right padding only (padding_side='right')"
                )
        out = self.depthbench(input_ids, return_hidden=bool(output_hidden_states))
        loss = None
        if labels is not None:
            logits = out.logits[:, :-1].float()
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        hidden = tuple(out.hidden) if out.hidden is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=out.logits, hidden_states=hidden)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # No cache: every step reruns the whole sequence.
        return {"input_ids": input_ids, "attention_mask": attention_mask}
