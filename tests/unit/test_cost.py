"""Analytic FLOPs and KV-cache bytes against what the model actually computes and caches.

The analytic count is exact for every architecture (forward and training, GQA and MoE
included), so the tests hold it to torch's FLOP counter at a relative 1e-9: a missing per-layer
term (one (1, S) x (S, d) product per reader is 1e-3 of the total here) fails."""

import pytest
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from depthbench.kernels.swap import swap_in
from depthbench.models.cost import analytic_cost, forward_flops_per_token, measured_cost
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model, registered_architectures

# Every registered architecture at its default options (so a new one is covered without an edit
# here), Block AttnRes with 2 blocks of the 4 layers (its default of 8 blocks gives every layer a
# block of its own at this depth), and MoDA's FFN-KV variant besides.
DEFAULT_OPTIONS_OVERRIDE = {"attnres_block": {"n_blocks": 2}}
ARCHS = [(arch, DEFAULT_OPTIONS_OVERRIDE.get(arch, {})) for arch in registered_architectures()] + [
    ("moda", {"variant": "ffn_kv"}),
]


def _register_cpu_sdpa():
    """FlopCounterMode counts the CUDA SDPA kernels; teach it the CPU one with the same formula
    (4 b h s_q s_k d: QK^T and PV over the full square), forward and backward."""
    aten = torch.ops.aten
    registry = flop_counter.flop_registry
    fwd = aten._scaled_dot_product_flash_attention_for_cpu
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd not in registry:

        @flop_counter.register_flop_formula(fwd)
        def _fwd(query, key, value, *args, out_shape=None, **kwargs):
            b, h, s_q, d = query  # the counter passes shapes
            return 4 * b * h * s_q * key[-2] * d

    if bwd not in registry:

        @flop_counter.register_flop_formula(bwd)
        def _bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs):
            b, h, s_q, d = query
            return 8 * b * h * s_q * key[-2] * d


def small(arch, options, **kw):
    base = dict(
        arch=arch,
        vocab_size=256,
        d_model=64,
        n_layer=4,
        n_head=4,
        max_seq_len=64,
        arch_options=options,
    )
    base.update(kw)
    return ModelConfig(**base)


# beyond the default shape: uneven blocks (5 layers in 3), more blocks than layers, GQA's shared
# depth keys, MoE's routed experts (only the top k run)
FLOP_CASES = [(arch, options, {}) for arch, options in ARCHS] + [
    ("attnres_block", {"n_blocks": 3}, {"n_layer": 5}),
    ("attnres_block", {"n_blocks": 8}, {}),
    ("moda", {}, {"n_kv_head": 2}),
    ("moda", {"variant": "ffn_kv"}, {"n_kv_head": 2}),
    ("hc", {}, {"n_kv_head": 2}),
    ("pre_ln", {}, {"moe": {"n_experts": 4, "top_k": 2}}),
    ("mhc", {}, {"moe": {"n_experts": 4, "top_k": 2}}),
]


def _case_id(value):
    if isinstance(value, str):
        return value
    return (
        "-".join(f"{k}{v}" if not isinstance(v, dict) else k for k, v in value.items()) or "default"
    )


@pytest.mark.parametrize("arch,options,kw", FLOP_CASES, ids=_case_id)
def test_analytic_flops_match_the_flop_counter(arch, options, kw):
    """Forward and training (forward + backward) FLOPs equal the counter's to 1e-9: every
    depth term of every architecture runs as a product the counter sees (AttnRes's mix and its
    outer-product gradients, MoDA's depth values also for one depth source)."""
    # the counter sees aten ops: the definitions (no C++ kernel of HC's and mHC's, no fused MoDA
    # depth chunk, which runs as broadcasts) but for AttnRes's mix, a matmul the counter sees in
    # the batched implementation (the CUDA backend's)
    _register_cpu_sdpa()
    torch.manual_seed(0)
    cfg = small(arch, options, **kw)
    model = build_model(cfg)
    if arch.startswith("attnres"):
        swap_in(model, "cuda")
    B, T = 2, 64
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            model(idx)
    expected = forward_flops_per_token(model, T) * B * T
    assert fwd.get_total_flops() == pytest.approx(expected, rel=1e-9, abs=0)
    with FlopCounterMode(display=False) as train:
        model(idx, idx).loss.backward()
    cost = analytic_cost(cfg, train_seq_len=T)
    assert cost["forward_flops_per_token"] == forward_flops_per_token(model, T)
    assert train.get_total_flops() == pytest.approx(
        cost["train_flops_per_token"] * B * T, rel=1e-9, abs=0
    )


def test_moe_flops_count_only_the_active_experts():
    _register_cpu_sdpa()
    cfg = small("pre_ln", {}, moe={"n_experts": 4, "top_k": 2})
    model = build_model(cfg)
    idx = torch.randint(0, 256, (2, 64))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(idx)
    assert fc.get_total_flops() == pytest.approx(
        forward_flops_per_token(model, 64) * 128, rel=1e-9, abs=0
    )


@pytest.mark.parametrize("arch,options", ARCHS + [("pre_ln", {"gqa": True})], ids=str)
def test_kv_cache_bytes_match_what_generation_caches(arch, options):
    """Prefill 10 tokens, decode 6 one by one with the KV cache: the logits equal a full forward
    pass (so the cache holds everything attention needs), and its bytes per token at bf16 are the
    cost table's figure."""
    from depthbench.models.decoding import generate, incremental_decoding

    options = dict(options)
    kw = {"n_kv_head": 2} if options.pop("gqa", False) else {}
    cfg = small(arch, options, **kw)
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        full = model(idx).logits
    with incremental_decoding(model) as decoder:
        steps = [decoder.step(idx[:, :10])] + [
            decoder.step(idx[:, t : t + 1]) for t in range(10, 16)
        ]
        assert decoder.position == 16
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-10)
    assert model.position_offset == 0 and all(
        getattr(m, "cache", None) is None for m in model.modules()
    )

    model = model.to(torch.bfloat16)
    with incremental_decoding(model) as decoder:
        decoder.step(idx[:, :10])
        for t in range(10, 16):
            decoder.step(idx[:, t : t + 1])
        per_token = decoder.cache_bytes() / (2 * 16)
    assert per_token == analytic_cost(cfg, 16)["kv_cache_bytes_per_token"]
    out = generate(model.float(), idx[:, :4], 5)
    assert out.shape == (2, 9) and torch.equal(out[:, :4], idx[:, :4])


def test_parameter_columns_add_up():
    c = analytic_cost(small("hc", {}), 64)
    assert c["params_total"] == c["params_embedding"] + c["params_non_embedding"]
    assert c["params_extra_vs_pre_ln"] > 0
    assert analytic_cost(small("pre_ln", {}), 64)["params_extra_vs_pre_ln"] == 0
    # the 4096-token prefill grows faster than linearly: attention is quadratic
    assert c["prefill_flops_4096"] > 4096 * c["forward_flops_per_token"]


@pytest.mark.parametrize(
    "arch, options",
    [("attnres_block", {"n_blocks": 2}), ("attnres_block", {"n_blocks": 3}), ("attnres_full", {})],
)
def test_attnres_source_counts_are_what_each_reader_mixes(arch, options, monkeypatch):
    from depthbench.models.registry import build_model
    from depthbench.models.archs.attnres_sources import DepthSources

    model = build_model(small(arch, options))
    seen = []
    mix = DepthSources.mix
    monkeypatch.setattr(
        DepthSources,
        "mix",
        staticmethod(lambda values, logits: (seen.append(len(values)), mix(values, logits))[1]),
    )
    model(torch.randint(0, 256, (1, 5)))
    assert model.source_counts() == seen
    if options == {
        "n_blocks": 2
    }:  # 4 layers in 2 blocks: v0 [+ partial], then v0, b1 [+ partial]; final: v0, b1, b2
        assert seen == [1, 2, 2, 2, 2, 3, 3, 3, 3]


def test_measured_cost_from_summary():
    m = measured_cost(
        {"steps": 10, "wall_seconds": 20.0, "device": "cpu", "tokens_per_s": 5.0, "world_size": 2}
    )
    assert m["step_seconds"] == 2.0 and m["device_hours"] == pytest.approx(40 / 3600)
