"""Pretrained transformers models through the model adapter (depthbench.pretrained).

Every family is a tiny randomly initialised model saved with `save_pretrained` and loaded back
offline; the adapter's fold is checked against transformers' own forward pass, which shares no
code with it beyond the decoder layers themselves.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from depthbench.util.errors import ConfigError  # noqa: E402
from depthbench.models.adapter import final_state, hidden_states, trunk_states  # noqa: E402
from depthbench.models.base import GENERIC_PROBES  # noqa: E402
from depthbench.pretrained.adapter import PretrainedAdapter  # noqa: E402
from depthbench.pretrained.loading import load_model  # noqa: E402

V, D, L, T = 96, 32, 3, 10
COMMON = dict(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=64,
    num_hidden_layers=L,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.2,
    tie_word_embeddings=False,
)

# family -> (config class, model class, config extras, output projections of a decoder layer)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=2),
        ("self_attn.o_proj", "mlp.down_proj"),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=2),
        ("self_attn.o_proj", "mlp.down_proj"),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_key_value_heads=2, head_dim=8),
        ("self_attn.o_proj", "mlp.down_proj"),
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(num_key_value_heads=2),
        ("self_attn.o_proj", "mlp.down_proj"),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(rotary_pct=0.5, use_parallel_residual=True),
        ("attention.dense", "mlp.dense_4h_to_h"),
    ),
    # sliding window 4 < T: the sliding-window layers get their own masks
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=5.0,
            query_pre_attn_scalar=8,
        ),
        ("self_attn.o_proj", "mlp.down_proj"),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        ("self_attn.o_proj", "mlp.down_proj"),
    ),
}


def tiny_model(family: str, seed: int = 0):
    config_cls, model_cls, extra, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    return getattr(transformers, model_cls)(config).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, folder) of a tiny model written by save_pretrained."""
    folder = tmp_path_factory.mktemp(request.param)
    tiny_model(request.param).save_pretrained(folder)
    return request.param, folder


def _sample(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def _final_norm_input(model, idx: torch.Tensor) -> tuple[torch.Tensor, object]:
    adapter_family = PretrainedAdapter(model).family
    norm = adapter_family.parts(model)[2]
    seen = []
    handle = norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            out = model(input_ids=idx, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    return seen[-1], out


@torch.no_grad()
def test_fold_equals_transformers_forward(saved):
    family, folder = saved
    model = load_model(str(folder))
    adapter = PretrainedAdapter(model)
    assert adapter.arch_name == family and adapter.n_layer == L and adapter.d_model == D
    assert adapter.probes == GENERIC_PROBES - {"prefix_average"} and adapter.figures == frozenset()
    idx = _sample()
    norm_input, out = _final_norm_input(model, idx)
    hs = hidden_states(adapter, idx)
    assert len(hs) == L + 1 == len(out.hidden_states)
    for l in range(L):  # h_0 .. h_(L-1): transformers' entries (h_0 with Gemma's sqrt(d) scale)
        torch.testing.assert_close(hs[l], out.hidden_states[l], rtol=0, atol=1e-5)
    torch.testing.assert_close(hs[L], norm_input, rtol=0, atol=1e-5)  # h_L: the final norm's input
    assert (hs[L] - out.hidden_states[L]).abs().max() > 1e-3  # transformers' last entry is normed
    logits = adapter.logits(trunk_states(adapter, idx)[-1])
    assert (logits - out.logits).abs().max() <= 1e-5
    assert (adapter(idx).logits - out.logits).abs().max() <= 1e-5


@torch.no_grad()
def test_softcapping_applies_for_gemma():
    model = tiny_model("gemma2")
    adapter = PretrainedAdapter(model)
    logits = adapter.logits(trunk_states(adapter, _sample())[-1])
    assert logits.abs().max() < 3.0  # c tanh(z / c) with c = 3
    assert logits.abs().max() > 1.0  # and not vanishing: the cap is what bounds it


def test_unknown_class_is_named():
    config = transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=4, n_positions=32)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel") as err:
        PretrainedAdapter(transformers.GPT2LMHeadModel(config))
    assert "LlamaForCausalLM" in str(err.value)  # lists what is supported


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_skip_of_an_identity_layer_is_the_model_without_it(family):
    """Layer 2 with its output projections zeroed adds nothing to the residual stream (for
    OLMo 2 and Gemma the post-sublayer norm of zero is zero): transformers' own forward then
    equals the adapter's pass with layer 2 skipped. A layer that does something is not skipped
    for free."""
    model = tiny_model(family)
    adapter = PretrainedAdapter(model)
    idx = _sample()
    states = trunk_states(adapter, idx)
    skipped = final_state(adapter, adapter.skip(states[1], 2), 3)
    assert (adapter.logits(skipped) - adapter.logits(states[-1])).abs().max() > 1e-3
    layer = adapter.layers[1]
    for name, p in layer.named_parameters():
        if any(name.startswith(prefix) for prefix in FAMILIES[family][3]):
            p.zero_()
    states = trunk_states(adapter, idx)
    torch.testing.assert_close(
        states[2].hidden, states[1].hidden, rtol=0, atol=1e-6
    )  # identity-like
    skipped = final_state(adapter, adapter.skip(states[1], 2), 3)
    assert adapter.skip(states[1], 2).hidden is states[1].hidden
    assert (
        adapter.logits(skipped) - model(input_ids=idx, use_cache=False).logits
    ).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gemma3"])
@torch.no_grad()
def test_swap_exchanges_layers_and_restores_them(family):
    """Inside `swapped(1, 3)` the adapter's pass equals transformers' forward on a copy whose
    state dict has layers 1 and 3 renamed into each other; on exit every weight is back."""
    model = tiny_model(family)
    adapter = PretrainedAdapter(model)
    idx = _sample()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prefix = adapter.family.base + "." + adapter.family.layers + "."
    renamed = {}
    for k, v in before.items():
        for a, b in ((0, 2), (2, 0)):
            if k.startswith(f"{prefix}{a}."):
                k = f"{prefix}{b}." + k[len(f"{prefix}{a}.") :]
                break
        renamed[k] = v
    reference = copy.deepcopy(model)
    reference.load_state_dict(renamed)
    expected = reference(input_ids=idx, use_cache=False).logits
    with adapter.swapped(1, 3):
        got = adapter.logits(trunk_states(adapter, idx)[-1])
    assert (got - expected).abs().max() <= 1e-5
    assert (expected - model(input_ids=idx, use_cache=False).logits).abs().max() > 1e-3
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@torch.no_grad()
def test_layer_io_replace_and_states_are_values():
    model = tiny_model("qwen3")
    adapter = PretrainedAdapter(model)
    idx = _sample()
    state = adapter.begin(idx)
    h0 = state.hidden.clone()
    x, y, after = adapter.layer_io(state, 1)
    assert torch.equal(state.hidden, h0)  # stepping never changes the state it is given
    assert torch.equal(x, h0) and torch.equal(y, after.hidden)
    torch.testing.assert_close(after.hidden, adapter.step(state, 1).hidden, rtol=0, atol=0)
    assert torch.equal(
        adapter.replace(state, 1, y.reshape(-1, D)).hidden, y
    )  # given outputs, reshaped
    replaced = final_state(
        adapter, adapter.replace(state, 1, x), 2
    )  # the layer's input as its output
    torch.testing.assert_close(
        replaced.hidden, final_state(adapter, adapter.skip(state, 1), 2).hidden, rtol=0, atol=0
    )
    assert adapter.records(idx) == {} and adapter.extra_flops_per_token(T) == 0.0
