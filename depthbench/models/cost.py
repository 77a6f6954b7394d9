"""Cost accounting: parameters, analytic FLOPs, KV-cache bytes, and the measured cost of a run.

FLOP convention (the one of MFU, PaLM appendix B and `torch.utils.flop_counter`): count the
multiply-adds of matrix products, 2 FLOPs each, and nothing element-wise (norms, activations,
softmax, HC's write of a sublayer's output into the streams, Sinkhorn iterations). Attention
scores and value mixing are counted over the full T x T square, not the causal half (as fused
SDPA kernels are counted).
Per token, at sequence length T:

    forward(T) = 2 N_mm + 4 L T d_q + depth(T)        training(T) = 3 forward(T)

N_mm: the weights that multiply each token once (every Linear, LM head included, with an MoE
layer's router and top-k experts only); d_q = n_head * head_dim. depth(T) is what an
architecture adds in matrix products beyond those, `extra_flops_per_token` of its module (0 for
the norm family; HC's dynamic projection over all streams and the read and mix of the streams,
AttnRes's depth logits and mix, MoDA's depth attention).
Backward costs twice the forward, as for every matmul: both operands' gradients count, also
where one is an outer product (the gradient w_i dh of a weighted sum's sources, a product with
inner size 1); element-wise work of the forward stays uncounted in the backward too. The count
is exact: on the PyTorch paths (HC's and mHC's PyTorch code, MoDA's explicit attention,
AttnRes's batched mix; the C++ kernels, fused attention and the `loop` mix do the same
arithmetic) every term is a product `torch.utils.flop_counter` sees, and
tests/unit/test_cost.py holds every architecture to it at a relative 1e-9. Prefill of a
4096-token sequence is 4096 x forward(4096).

KV cache (bytes per token at bf16, what persists across tokens in decoding): K and V of every
attention layer, 2 L n_kv_head head_dim x 2 bytes (checked against the cache that
depthbench.models.decoding fills while generating). MoDA's depth keys and values of position t are
read only by position t: with reuse_kv they are the same tensors as the sequence cache (no extra
bytes), with ffn_kv the FFN-side K/V are per-token working state, not cache. That per-token state a
decode step holds across the depth of the network is reported separately as
`depth_state_bytes_per_token` (each architecture's module says what it holds: the n streams of
hc/mhc, the stored sources of AttnRes, MoDA ffn_kv's extra K/V; 0 for single-stream architectures
beyond the d-vector every model holds).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model, parameters_on_meta

PREFILL_TOKENS = 4096
BF16_BYTES = 2


def meta_model(cfg: ModelConfig) -> nn.Module:
    """The model with its weights on the meta device: their shapes, no memory."""
    with parameters_on_meta():
        return build_model(cfg, initialize=False)


def matmul_parameters(model: nn.Module) -> int:
    """Weights multiplied once per token: every Linear, plus the active share of MoE experts."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel()
        elif hasattr(module, "n_experts") and hasattr(module, "w13"):
            per_expert = module.w13[0].numel() + module.w2[0].numel()
            total += module.top_k * per_expert
    return total


def forward_flops_per_token(model: nn.Module, seq_len: int) -> float:
    cfg = model.cfg
    attention = 4.0 * cfg.n_layer * seq_len * cfg.n_head * cfg.head_dim
    return 2.0 * matmul_parameters(model) + attention + model.extra_flops_per_token(seq_len)


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_value: int = BF16_BYTES) -> int:
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * bytes_per_value


def analytic_cost(cfg: ModelConfig, train_seq_len: int) -> dict[str, Any]:
    """Every analytic cost column of one model shape (built on the meta device: no memory)."""
    model = meta_model(cfg)
    total = model.num_parameters()
    embedding = model.embed.weight.numel() + model.lm_head.weight.numel()
    baseline = meta_model(dataclasses.replace(cfg, arch="pre_ln", arch_options={}))
    forward_prefill = forward_flops_per_token(model, PREFILL_TOKENS)
    return {
        "params_total": total,
        "params_embedding": embedding,
        "params_non_embedding": total - embedding,
        "params_active": model.num_active_parameters(),
        # parameters beyond a Pre-LN model of the same shape (HC weights, pseudo-queries, ...)
        "params_extra_vs_pre_ln": total - baseline.num_parameters(),
        "train_flops_per_token": 3.0 * forward_flops_per_token(model, train_seq_len),
        "forward_flops_per_token": forward_flops_per_token(model, train_seq_len),
        "prefill_flops_4096": PREFILL_TOKENS * forward_prefill,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg),
        "kv_cache_bytes_4096": PREFILL_TOKENS * kv_cache_bytes_per_token(cfg),
        "depth_state_bytes_per_token": model.depth_state_bytes_per_token(BF16_BYTES),
    }


def measured_cost(summary: dict[str, Any]) -> dict[str, Any]:
    """The measured columns of one run, from its summary.json."""
    steps = summary.get("steps") or 0
    wall = summary.get("wall_seconds") or float("nan")
    world = int(summary.get("world_size") or 1)
    return {
        "measured_peak_memory_bytes": summary.get("peak_memory_bytes"),
        "peak_memory_kind": summary.get("peak_memory_kind")
        or (
            "cuda_allocator"
            if str(summary.get("device", "")).startswith("cuda")
            else "process_max_rss"
        ),
        "step_seconds": wall / steps if steps else float("nan"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "wall_seconds": wall,
        "world_size": world,
        "device": summary.get("device"),
        "device_hours": wall * world / 3600.0,
    }


def pretrained_cost(summary: dict[str, Any], train_seq_len: int) -> dict[str, Any]:
    """The analytic cost columns of a pretrained model (status `pretrained`), from the counts its
    summary.json holds (depthbench.pretrained.stages.cost_fields), by the same formulas as
    `analytic_cost`: the families DepthBench reads are single-stream decoders, so depth(T) = 0
    and the depth state is 0. Nothing is measured (no training): those columns are empty."""
    L, T = summary["n_layer"], train_seq_len
    d_q = summary["n_head"] * summary["head_dim"]

    def forward(seq_len: int) -> float:
        return 2.0 * summary["matmul_params"] + 4.0 * L * seq_len * d_q

    kv = 2 * L * summary["n_kv_head"] * summary["head_dim"] * BF16_BYTES
    total = summary["n_params"]
    return {
        "params_total": total,
        "params_embedding": summary["params_embedding"],
        "params_non_embedding": total - summary["params_embedding"],
        "params_active": total,
        "params_extra_vs_pre_ln": 0,
        "train_flops_per_token": 3.0 * forward(T),
        "forward_flops_per_token": forward(T),
        "prefill_flops_4096": PREFILL_TOKENS * forward(PREFILL_TOKENS),
        "kv_cache_bytes_per_token": kv,
        "kv_cache_bytes_4096": PREFILL_TOKENS * kv,
        "depth_state_bytes_per_token": 0,
        "measured_peak_memory_bytes": None,
        "peak_memory_kind": None,
        "step_seconds": float("nan"),
        "world_size": None,
        "device_hours": float("nan"),
        "tokens_per_s": float("nan"),
        "wall_seconds": float("nan"),
        "device": None,
    }
