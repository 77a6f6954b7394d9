"""pre_ln as transformers' `LlamaForCausalLM`: the config and the parameter-name mapping.

DepthBench's pre_ln block is LLaMA's (Touvron et al. 2023): x <- x + Attn(N(x)), x <- x + FFN(N(x)),
N an RMSNorm with a learnable gain (eps from the config), a final RMSNorm, an untied LM head and
no biases. The two implementations agree on the rest:
  - RoPE pairs dimension i with i + hd/2 (DepthBench's `apply_rotary` on `chunk(2)`), which is
    exactly HF Llama's `rotate_half`; the frequencies are theta^(-2i/hd) in both.
  - GQA: query head h reads K/V head h // (n_head / n_kv_head) in both (SDPA's enable_gqa and
    HF's repeat_kv repeat each K/V head for consecutive query heads).
  - Fused projections are split along their output rows: wqkv = [W_q | W_k | W_v]
    (n_head*hd, n_kv_head*hd, n_kv_head*hd rows), w13 = [W_1 | W_3] (d_ff rows each), where
    SwiGLU(x) = W_2 (silu(W_1 x) * W_3 x), i.e. W_1 = gate_proj, W_3 = up_proj, W_2 = down_proj.
"""

from __future__ import annotations

import re

import torch

from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig

# DepthBench name (per layer, after "blocks.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^blocks\.(\d+)\.(.+)$")


def is_plain_llama(cfg: ModelConfig, arch: str) -> bool:
    """pre_ln with a dense FFN is exactly Llama. Only the options pre_ln declares count (none):
    a grid's shared `arch_options` section may hold other architectures' options, which a pre_ln
    model never reads."""
    from depthbench.models.registry import declared_options

    return (
        arch == "pre_ln"
        and not cfg.moe.get("n_experts", 0)
        and not declared_options(arch, cfg.arch_options)
    )


def llama_config_kwargs(cfg: ModelConfig) -> dict:
    """LlamaConfig arguments for a DepthBench pre_ln ModelConfig (special token ids added by the
    caller)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.resolved_init_std,
    }


def to_llama_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """DepthBench pre_ln weights under LlamaForCausalLM's names; every input key is used once."""
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in _TOP_NAMES:
            out[_TOP_NAMES[key]] = value
            continue
        match = _LAYER.match(key)
        if not match:
            raise ConfigError(
                "model.safetensors", f"parameter {key!r} has no LlamaForCausalLM counterpart"
            )
        prefix, name = f"model.layers.{match.group(1)}.", match.group(2)
        if name == "attn.wqkv.weight":
            q, k, v = value.split((q_dim, kv_dim, kv_dim), dim=0)
            for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{prefix}self_attn.{proj}.weight"] = part.contiguous()
        elif name == "ffn.w13.weight":
            gate, up = value.split((cfg.d_ff, cfg.d_ff), dim=0)
            out[f"{prefix}mlp.gate_proj.weight"] = gate.contiguous()
            out[f"{prefix}mlp.up_proj.weight"] = up.contiguous()
        elif name in _LAYER_NAMES:
            out[prefix + _LAYER_NAMES[name]] = value
        else:
            raise ConfigError(
                "model.safetensors", f"parameter {key!r} has no LlamaForCausalLM counterpart"
            )
    expected = 3 + 9 * cfg.n_layer
    if len(out) != expected:
        raise ConfigError(
            "model.safetensors",
            f"{len(out)} Llama tensors from the run's weights, expected {expected}",
        )
    return out
