"""Each architecture computes exactly the update its paper defines."""

import math

import pytest
import torch
import torch.nn.functional as F

from depthbench.util.errors import ConfigError
from depthbench.models.registry import ARCHITECTURES, build_model, count_parameters
from depthbench.models.config import ModelConfig
from depthbench.models.registry import canonical_arch
from depthbench.models.config import evaluate_init_std, swiglu_hidden
from depthbench.models.layers import apply_rotary

canonical_arch("pre_ln")  # registers every architecture
ARCHS = sorted(ARCHITECTURES)
NORM_FAMILY = [
    "deepnorm",
    "keel",
    "lns",
    "peri_ln",
    "post_ln",
    "pre_ln",
]  # one stream, x <- block(x)


def small(arch, **kw):
    base = dict(arch=arch, vocab_size=97, d_model=32, n_layer=3, n_head=4, max_seq_len=24)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_no_position_sees_a_later_token(arch):
    torch.manual_seed(0)
    model = build_model(small(arch)).eval()
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        a = model(idx, return_hidden=True)
        b = model(changed, return_hidden=True)
    torch.testing.assert_close(a.logits[:, :10], b.logits[:, :10], rtol=1e-5, atol=1e-5)
    for h_a, h_b in zip(a.hidden, b.hidden):
        torch.testing.assert_close(h_a[:, :10], h_b[:, :10], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a.logits[:, 10:], b.logits[:, 10:])


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_are_h0_to_hL_and_hL_feeds_the_final_norm(arch):
    torch.manual_seed(0)
    model = build_model(small(arch)).eval()
    idx = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        out = model(idx, return_hidden=True)
        assert len(out.hidden) == model.cfg.n_layer + 1
        streams = 4 if arch in ("hc", "mhc") else 1  # h_0 is the sum of n copies of the embedding
        torch.testing.assert_close(out.hidden[0], streams * model.embed_tokens(idx))
        h_last = out.hidden[-1]
        final = model.final_norm(h_last) if model.final_norm is not None else h_last
        torch.testing.assert_close(model.lm_head(final), out.logits)


@pytest.mark.parametrize("arch", NORM_FAMILY)
def test_single_stream_hidden_state_is_what_the_next_block_reads(arch):
    torch.manual_seed(0)
    model = build_model(small(arch)).eval()
    idx = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        out = model(idx, return_hidden=True)
        # h_l is what block l+1 reads
        x = out.hidden[0]
        rope = model.rope(8)
        for l, block in enumerate(model.blocks, start=1):
            x = block(x, rope)
            torch.testing.assert_close(x, out.hidden[l])


def _copy_weights(dst, src):
    dst.load_state_dict(src.state_dict(), strict=True)


def test_lns_first_layer_equals_pre_ln_and_later_layers_scale_the_norm_output():
    torch.manual_seed(0)
    pre = build_model(small("pre_ln", n_layer=1))
    lns = build_model(small("lns", n_layer=1))
    _copy_weights(lns, pre)
    idx = torch.randint(0, 97, (2, 8))
    torch.testing.assert_close(pre(idx).logits, lns(idx).logits)  # 1/sqrt(1) = 1
    deep = build_model(small("lns", n_layer=4))
    block = deep.blocks[3]
    x = torch.randn(2, 8, 32)
    rope = deep.rope(8)
    expected = x + block.attn(block.attn_norm(x) / 2.0, rope)  # 1/sqrt(4)
    expected = expected + block.ffn(block.ffn_norm(expected) / 2.0)
    torch.testing.assert_close(block(x, rope), expected)


def _written_out_logits(model, arch, idx):
    """The whole forward of an LNS or DeepNorm model from its sublayers, with the constants as
    Python floats: LNS x <- x + F(N(x) / sqrt(l)), DeepNorm x <- N(alpha x + F(x)),
    alpha = (2L)^(1/4)."""
    L = model.cfg.n_layer
    rope = model.rope(idx.shape[1])
    x = model.embed_tokens(idx)
    for l, b in enumerate(model.blocks, start=1):
        if arch == "lns":
            x = x + b.attn(b.attn_norm(x) * (1.0 / math.sqrt(l)), rope)
            x = x + b.ffn(b.ffn_norm(x) * (1.0 / math.sqrt(l)))
        else:
            alpha = (2 * L) ** 0.25
            x = b.attn_norm(alpha * x + b.attn(x, rope))
            x = b.ffn_norm(alpha * x + b.ffn(x))
    if model.final_norm is not None:
        x = model.final_norm(x)
    return model.lm_head(x)


@pytest.mark.parametrize("arch", ["lns", "deepnorm"])
def test_lns_and_deepnorm_constants_are_in_the_model_dtype(arch):
    """A float64 model (cast from the float32 one it was built as, and cast down and up again)
    equals the written-out forward with float64 constants to 1e-13: a float32 1/sqrt(l) or
    alpha cast up differs by about 1e-8. In bf16 the constant is the float rounded once."""
    torch.manual_seed(0)
    model = build_model(small(arch, n_layer=5)).double()
    idx = torch.randint(0, 97, (2, 12))
    name = "scale" if arch == "lns" else "alpha"
    with torch.no_grad():
        expected = _written_out_logits(model, arch, idx)
        torch.testing.assert_close(model(idx).logits, expected, rtol=0, atol=1e-13)
        model.float().double()
        torch.testing.assert_close(model(idx).logits, expected, rtol=0, atol=1e-13)
    exact = [1.0 / math.sqrt(l) if arch == "lns" else 10**0.25 for l in range(1, 6)]
    assert [getattr(b, name).dtype for b in model.blocks] == [torch.float64] * 5
    assert [getattr(b, name).item() for b in model.blocks] == exact
    model.to(torch.bfloat16)
    assert [getattr(b, name).item() for b in model.blocks] == [
        torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).item() for v in exact
    ]


def test_post_ln_deepnorm_keel_peri_equations():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    L = 3
    for arch in ("post_ln", "deepnorm", "keel", "peri_ln"):
        model = build_model(small(arch, n_layer=L))
        b = model.blocks[1]
        rope = model.rope(8)
        if arch == "post_ln":
            y = b.attn_norm(x + b.attn(x, rope))
            y = b.ffn_norm(y + b.ffn(y))
        elif arch == "deepnorm":
            a = (2 * L) ** 0.25
            y = b.attn_norm(a * x + b.attn(x, rope))
            y = b.ffn_norm(a * y + b.ffn(y))
        elif arch == "keel":
            a = 2 * L
            y = b.attn_norm_out(a * x + b.attn(b.attn_norm_in(x), rope))
            y = b.ffn_norm_out(a * y + b.ffn(b.ffn_norm_in(y)))
        else:
            y = x + b.attn_norm_out(b.attn(b.attn_norm_in(x), rope))
            y = y + b.ffn_norm_out(b.ffn(b.ffn_norm_in(y)))
        torch.testing.assert_close(b(x, rope), y)
    assert build_model(small("post_ln")).final_norm is None
    assert build_model(small("deepnorm")).final_norm is None
    assert build_model(small("keel")).final_norm is None
    assert build_model(small("peri_ln")).final_norm is not None


def test_peri_ln_embedding_norm_option():
    torch.manual_seed(0)
    model = build_model(small("peri_ln", arch_options={"embed_norm": True}))
    h0 = model(torch.randint(0, 97, (2, 8)), return_hidden=True).hidden[0]
    # eps = 1e-6 against mean square ~4e-4 of a std-0.02 embedding: RMS 1 within 1%
    torch.testing.assert_close(h0.pow(2).mean(-1), torch.ones(2, 8), rtol=1e-2, atol=1e-2)
    assert build_model(small("peri_ln")).embed_norm is None


def test_deepnorm_init_gains():
    torch.manual_seed(0)
    d, L = 256, 6
    model = build_model(
        ModelConfig(arch="deepnorm", vocab_size=50, d_model=d, n_layer=L, n_head=4, max_seq_len=8)
    )
    beta = (8 * L) ** -0.25
    w = model.blocks[0].attn.wqkv.weight
    q, v = w[:d], w[2 * d :]
    assert q.std().item() == pytest.approx(math.sqrt(1 / d), rel=0.05)  # xavier gain 1, fans d, d
    assert v.std().item() == pytest.approx(beta * math.sqrt(1 / d), rel=0.05)
    w2 = model.blocks[0].ffn.w2.weight
    assert w2.std().item() == pytest.approx(beta * math.sqrt(2 / (d + w2.shape[1])), rel=0.05)
    # default init elsewhere
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_deepnorm_torchscale_init_statistics(n_kv_head):
    """arch_options.init = torchscale: q, k, v Xavier-uniform gain 2^-1/2 (each projection's own
    fans), o Xavier-uniform gain 1, W1, W3, W2 PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in));
    then v, o, W1, W3, W2 divided by (8L)^(1/4). A uniform U(-a, a) has std a / sqrt(3), and no
    entry beyond a."""
    torch.manual_seed(0)
    d, L = 256, 6
    model = build_model(
        ModelConfig(
            arch="deepnorm",
            vocab_size=50,
            d_model=d,
            n_layer=L,
            n_head=4,
            n_kv_head=n_kv_head,
            max_seq_len=8,
            arch_options={"init": "torchscale"},
        )
    )
    scale = (8 * L) ** 0.25
    kv = d * n_kv_head // 4

    def check(w, bound):
        assert w.abs().max().item() <= bound
        assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03)

    for block in model.blocks:
        w = block.attn.wqkv.weight
        check(w[:d], 2**-0.5 * math.sqrt(6 / (d + d)))
        check(w[d : d + kv], 2**-0.5 * math.sqrt(6 / (d + kv)))
        check(w[d + kv :], 2**-0.5 * math.sqrt(6 / (d + kv)) / scale)
        check(block.attn.wo.weight, math.sqrt(6 / (d + d)) / scale)
        d_ff = block.ffn.d_ff
        check(block.ffn.w13.weight[:d_ff], 1 / math.sqrt(d) / scale)
        check(block.ffn.w13.weight[d_ff:], 1 / math.sqrt(d) / scale)
        check(block.ffn.w2.weight, 1 / math.sqrt(d_ff) / scale)
    assert model.embed.weight.std().item() == pytest.approx(
        0.02, rel=0.05
    )  # default init elsewhere


def test_deepnorm_init_option_default_and_bad_value():
    """deepnet is the default (the same weights as naming it); an unknown value names the field."""
    torch.manual_seed(0)
    default = build_model(small("deepnorm"))
    torch.manual_seed(0)
    named = build_model(small("deepnorm", arch_options={"init": "deepnet"}))
    assert all(
        torch.equal(a, b)
        for a, b in zip(default.state_dict().values(), named.state_dict().values())
    )
    with pytest.raises(ConfigError, match=r"model\.arch_options\.init.*deepnet.*torchscale"):
        build_model(small("deepnorm", arch_options={"init": "xavier"}))


def test_default_init_std_and_rules():
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            vocab_size=500,
            d_model=256,
            n_layer=2,
            n_head=4,
            init_std="1/sqrt(d_model)",
            max_seq_len=8,
        )
    )
    assert model.blocks[0].ffn.w13.weight.std().item() == pytest.approx(1 / 16, rel=0.03)
    assert evaluate_init_std("0.02/sqrt(2*n_layer)", 64, 8) == pytest.approx(0.005)
    with pytest.raises(ConfigError, match="model.init_std"):
        evaluate_init_std("__import__('os')", 64, 8)


def test_gqa_matches_reference_with_repeated_kv_heads():
    torch.manual_seed(0)
    model = build_model(small("pre_ln", n_head=4, n_kv_head=2))
    attn = model.blocks[0].attn
    x = torch.randn(2, 8, 32)
    rope = model.rope(8)
    q, k, v = attn.project_qkv(x, rope)
    k = k.repeat_interleave(2, dim=1)
    v = v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(attn.head_dim)
    scores = scores.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf"))
    ref = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 8, 32))
    torch.testing.assert_close(attn(x, rope), ref, rtol=1e-5, atol=1e-5)
    assert attn.wqkv.weight.shape[0] == 32 + 2 * 16


def test_rope_rotation_preserves_norm_and_relative_positions():
    torch.manual_seed(0)
    model = build_model(small("pre_ln"))
    cos, sin = model.rope(24)
    q = torch.randn(1, 1, 1, 8).expand(1, 1, 24, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 1, 24, 8)
    rq, rk = apply_rotary(q, cos[:, :4], sin[:, :4]), apply_rotary(k, cos[:, :4], sin[:, :4])
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = rq[0, 0] @ rk[0, 0].T
    torch.testing.assert_close(dots[3, 1], dots[10, 8])  # depends on offset only


def test_pre_ln_parameter_count_matches_closed_form():
    for d, L, V in ((1216, 16, 50280), (640, 70, 50280), (512, 8, 32000)):
        cfg = ModelConfig(vocab_size=V, d_model=d, n_layer=L, n_head=16)
        assert cfg.d_ff == swiglu_hidden(d)
        closed = 12 * L * d * d + 2 * V * d
        assert abs(count_parameters(cfg) - closed) / closed < 0.03
        model_params = sum(
            p.numel()
            for p in build_model(
                ModelConfig(vocab_size=V, d_model=d, n_layer=1, n_head=16)
            ).parameters()
        )
        assert model_params == count_parameters(
            ModelConfig(vocab_size=V, d_model=d, n_layer=1, n_head=16)
        )


def test_loss_is_cross_entropy_of_logits():
    torch.manual_seed(0)
    model = build_model(small("pre_ln"))
    idx, tgt = torch.randint(0, 97, (2, 8)), torch.randint(0, 97, (2, 8))
    out = model(idx, tgt)
    torch.testing.assert_close(
        out.loss, F.cross_entropy(out.logits.reshape(-1, 97), tgt.reshape(-1))
    )
    assert out.loss.item() == pytest.approx(math.log(97), abs=0.1)  # small init: near uniform


def test_invalid_heads_name_the_field():
    with pytest.raises(ConfigError, match="model.n_head"):
        ModelConfig(d_model=100, n_head=16)
    with pytest.raises(ConfigError, match="model.n_kv_head"):
        ModelConfig(d_model=64, n_head=4, n_kv_head=3)


def test_the_schema_lists_exactly_the_registered_architectures_and_their_options():
    import dataclasses

    from depthbench.spec.schema import load_schema
    from depthbench.models.registry import ALIASES

    schema = load_schema()["properties"]
    assert set(schema["architectures"]["items"]["enum"]) == set(ARCHITECTURES) | set(ALIASES)
    options = {f.name for cls in ARCHITECTURES.values() for f in dataclasses.fields(cls.Options)}
    assert set(schema["model"]["properties"]["arch_options"]["properties"]) == options


@pytest.mark.parametrize(
    "arch, options, field",
    [
        ("moda", {"variant": "both"}, "variant"),
        ("attnres_block", {"n_blocks": 0}, "n_blocks"),
        ("peri_ln", {"embed_norm": "yes"}, "embed_norm"),
    ],
)
def test_invalid_architecture_options_name_the_field(arch, options, field):
    from depthbench.util.errors import ConfigError

    with pytest.raises(ConfigError, match=f"model.arch_options.{field}"):
        build_model(small(arch, arch_options=options))


@pytest.mark.parametrize(
    "option, good, bad", [("res_init", "hc_static", "eye"), ("init", "torchscale", "xavier")]
)
def test_schema_takes_the_architecture_init_options(option, good, bad):
    """mhc's res_init and deepnorm's init are settable from a config; a bad value is a
    ConfigError naming model.arch_options.<option> and listing the valid values."""
    from pathlib import Path

    from depthbench.spec.schema import load_config

    default_config = Path(__file__).resolve().parents[2] / "config" / "config.yaml"
    config = load_config(default_config, {"model": {"arch_options": {option: good}}})
    assert config["model"]["arch_options"][option] == good
    with pytest.raises(ConfigError, match=rf"model\.arch_options\.{option}.*{good}"):
        load_config(default_config, {"model": {"arch_options": {option: bad}}})


def test_inverse_rms_reduces_in_fp32_under_bf16_autocast():
    """inverse_rms promises at least fp32: under CPU bf16 autocast its vecdot would otherwise be
    cast to bf16 (a relative error of about 3e-3 on the RMS that HC's and mHC's coefficients,
    normed_linear, divide by)."""
    from depthbench.models.layers import inverse_rms

    torch.manual_seed(0)
    x = (3 * torch.randn(16, 64)).to(torch.bfloat16)
    exact = torch.rsqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = inverse_rms(x, 1e-6)
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() / exact).max() < 1e-6
