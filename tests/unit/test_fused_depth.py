"""The fused depth computations equal the definitions they are swapped in for
(depthbench.kernels.swap): MoDA's fused joint attention (depthbench/kernels/moda_fused.py) against
the explicit score matrices of `joint_depth_attention`, and AttnRes's batched depth mix
(depthbench/kernels/attnres_groups.py) against the per-source multiply-adds, in forward and
gradients."""

import math

import pytest
import torch

from depthbench.kernels import moda_fused as mf
from depthbench.kernels.moda_fused import fused_joint_attention
from depthbench.kernels.swap import swap_in, swapped
from depthbench.models.archs.moda import joint_depth_attention
from depthbench.models.archs.moda_depth_keys import DepthBuffer, DepthKeys
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model

TOL = dict(rtol=1e-5, atol=1e-5)


def cfg(arch, **kw):
    base = dict(
        arch=arch, vocab_size=61, d_model=32, n_layer=3, n_head=4, max_seq_len=16, init_std=0.1
    )
    base.update(kw)
    return ModelConfig(**base)


def twin_models(arch, backend, **kw):
    """Two models with the same weights: `backend`'s implementations swapped in, and the
    definition."""
    torch.manual_seed(0)
    a = build_model(cfg(arch, **kw))
    with torch.no_grad():
        # perturb the zero-initialised parts (AttnRes pseudo-queries), as after training
        for p in a.parameters():
            p.add_(0.05 * torch.randn_like(p))
    b = build_model(cfg(arch, **kw))
    b.load_state_dict(a.state_dict())
    swap_in(a, backend)
    assert swapped(a), f"{backend} swaps nothing in {arch}"
    return a, b


def assert_same_loss_and_gradients(a, b, idx, targets):
    la, lb = a(idx, targets).loss, b(idx, targets).loss
    torch.testing.assert_close(la, lb, **TOL)
    la.backward()
    lb.backward()
    compared = 0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, **TOL, msg=lambda m: f"{name}: {m}")
            compared += 1
    assert compared > 10


def moda_twins(**kw):
    return twin_models("moda", "cpu", **kw)


@pytest.mark.parametrize(
    "n_layer, n_kv_head, variant",
    [
        (2, 4, "reuse_kv"),
        (3, 2, "reuse_kv"),
        (5, 1, "reuse_kv"),
        (3, 4, "ffn_kv"),
        (4, 2, "ffn_kv"),
    ],
)
def test_moda_fused_equals_explicit_in_loss_and_every_gradient(n_layer, n_kv_head, variant):
    fused, explicit = moda_twins(
        n_layer=n_layer, n_kv_head=n_kv_head, arch_options={"variant": variant}
    )
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    assert_same_loss_and_gradients(fused, explicit, idx, targets)
    with torch.no_grad():  # and without autograd (probes, evaluation)
        torch.testing.assert_close(fused(idx).logits, explicit(idx).logits, **TOL)


@pytest.mark.parametrize("group", [16, 2], ids=["one-group", "groups-of-2"])
def test_moda_fused_function_gradients_match_the_explicit_path_per_input(group, monkeypatch):
    """The fused call's gradients w.r.t. q, k, v and every depth source (GQA: 6 query heads over
    3 KV heads) equal autograd through the explicit score matrices; float64 gradcheck too. With
    the depth slots taken 2 at a time (3 slots: a group of 2 and one of 1) as with all at once."""
    monkeypatch.setattr(mf, "DEPTH_GROUP", group)
    torch.manual_seed(0)
    B, Hk, G, T, hd, D = 2, 3, 2, 7, 4, 3
    q = torch.randn(B, Hk * G, T, hd, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hk, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sources = [
        torch.randn(B, Hk, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(2 * D)
    ]

    def fused(q, k, v, *sources):
        keys = DepthKeys()
        for i in range(D):
            keys.append((sources[2 * i], sources[2 * i + 1]))
        return fused_joint_attention(q, k, v, keys.buffer(), D)

    def explicit(q, k, v, *sources):
        rep = lambda t: t.repeat_interleave(G, dim=1)  # noqa: E731
        dk, dv = torch.stack(sources[0::2], dim=3), torch.stack(sources[1::2], dim=3)
        return joint_depth_attention(q, rep(k), rep(v), rep(dk), rep(dv))

    inputs = (q, k, v, *sources)
    out_f, out_e = fused(*inputs), explicit(*inputs)
    torch.testing.assert_close(out_f, out_e)
    dy = torch.randn_like(out_f)
    for gf, ge in zip(
        torch.autograd.grad(out_f, inputs, dy), torch.autograd.grad(out_e, inputs, dy)
    ):
        torch.testing.assert_close(gf, ge)
    small = [
        t.detach()[:1, :, :3, :2].clone().requires_grad_() for t in inputs
    ]  # gradcheck: few inputs
    assert torch.autograd.gradcheck(fused, tuple(small))


def test_moda_depth_keys_live_in_one_buffer_per_forward():
    """No layer re-stacks the keys before it: every layer appends into the same preallocated
    storage (the one read by the last layer holds every layer's keys, written once)."""
    torch.manual_seed(0)
    model = swap_in(build_model(cfg("moda", n_layer=4, arch_options={"variant": "ffn_kv"})), "cpu")
    seen = []
    original = DepthKeys.buffer

    def spy(self):
        buf = original(self)
        seen.append((buf.k.data_ptr(), buf.k.shape[0], len(buf.sources)))
        return buf

    DepthKeys.buffer = spy
    try:
        model(torch.randint(0, 61, (2, 9))).loss
    finally:
        DepthKeys.buffer = original
    assert len({ptr for ptr, _, _ in seen}) == 1  # one storage for the whole forward
    assert [n for _, _, n in seen] == [2, 4, 6]  # layers 2..4 read 2 (l - 1) pairs
    assert seen[0][1] == 8  # sized for every layer's pairs up front


def test_moda_forks_and_edited_pairs_rebuild_the_buffer_from_the_pairs():
    """A fork resumed from an earlier state, or pairs edited from outside, never read another
    state's slots: the buffer is rebuilt from the state's own pairs."""
    torch.manual_seed(0)
    pairs = [(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)) for _ in range(3)]
    keys = DepthKeys(capacity=3, buffered=True)
    keys.append(pairs[0])
    fork = keys.fork()
    keys.append(pairs[1])
    fork.append(pairs[2])  # slot 1 is taken by keys' pair: the fork must not overwrite it
    assert torch.equal(keys.buffer().k[1], pairs[1][0])
    assert torch.equal(fork.buffer().k[1], pairs[2][0]) and torch.equal(
        fork.buffer().v[0], pairs[0][1]
    )
    assert torch.equal(keys.buffer().k[1], pairs[1][0])
    del keys.pairs[1:]
    keys.append(pairs[2])
    assert torch.equal(keys.buffer().k[:2], torch.stack([pairs[0][0], pairs[2][0]]))
    grown = DepthBuffer(pairs[0][0], 1)
    for pair in pairs:
        grown.push(pair)
    assert grown.k.shape[0] == 4 and torch.equal(grown.v[2], pairs[2][1])


def test_moda_decoding_offset_falls_back_to_the_explicit_path():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 2, 4)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    keys = DepthKeys()
    keys.append((torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)))
    assert fused_joint_attention(q, k, v, keys.buffer(), 1) is None


def test_the_definition_of_moda_makes_no_buffer():
    """The explicit path stacks the pairs it is handed; only a fused attention asks for the
    depth K/V buffer."""
    torch.manual_seed(0)
    model = build_model(cfg("moda", n_layer=3))
    state = model.begin(torch.randint(0, 61, (2, 7)))
    for layer in range(1, 4):
        state = model.step(state, layer)
    assert state.value[1]._buffer is None and len(state.value[1]) == 3


@pytest.mark.parametrize(
    "arch, n_layer, options",
    [
        ("attnres_full", 2, {}),
        ("attnres_full", 4, {}),
        ("attnres_block", 4, {"n_blocks": 2}),
        ("attnres_block", 5, {"n_blocks": 3}),
        ("attnres_block", 3, {"n_blocks": 8}),
    ],
)
def test_attnres_batched_mix_equals_the_per_source_loop(arch, n_layer, options):
    batched, loop = twin_models(arch, "cuda", n_layer=n_layer, arch_options=options)
    idx = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(2))
    assert_same_loss_and_gradients(batched, loop, idx, targets)
    with torch.no_grad():
        a, b = (
            batched(idx, return_internals=True, return_hidden=True),
            loop(idx, return_internals=True, return_hidden=True),
        )
    for x, y in zip(
        a.internals["depth_weights"] + a.hidden, b.internals["depth_weights"] + b.hidden
    ):
        torch.testing.assert_close(x, y, **TOL)


def test_attnres_sources_live_in_one_buffer_per_forward():
    """Full AttnRes's sublayer outputs go into one buffer, sized once for all 2L of them, v_0
    apart; Block AttnRes's block sums likewise (attnres_groups.py)."""
    torch.manual_seed(0)
    definition = build_model(cfg("attnres_full")).begin(torch.zeros(1, 3, dtype=torch.long))
    assert not hasattr(definition.value, "buffer")  # the definition: one multiply-add per source
    model = swap_in(build_model(cfg("attnres_full", n_layer=3)), "cuda")
    state = model.step(model.begin(torch.randint(0, 61, (2, 7))), 1)
    buffer = state.value.buffer
    assert buffer.values.shape[2] == 6  # 2L outputs, allocated once
    for layer in range(2, 4):
        state = model.step(state, layer)
    assert state.value.buffer is buffer and buffer.holds(state.value.values[1:])
    assert len(buffer.sources) == 6
    blocks = swap_in(
        build_model(cfg("attnres_block", n_layer=4, arch_options={"n_blocks": 2})), "cuda"
    )
    state = blocks.begin(torch.randint(0, 61, (2, 7)))
    for layer in range(1, 5):
        state = blocks.step(state, layer)
    buffer = state.value.buffer
    assert buffer.values.shape[2] == 2 and len(buffer.sources) == 2  # two block sums


# --- the chunked kernel pair (what MoDA's fused path runs off the CPU) --------------------------


@pytest.mark.parametrize("T, chunk", [(7, 3), (12, 4), (9, 256)])
def test_chunked_pair_equals_causal_attention_and_its_lse(T, chunk, monkeypatch):
    """Forward (output, lse) equals causal softmax attention written out; backward from a given
    lse and output equals autograd's gradient of that attention (the lse and output being its
    own), for blocks that split T unevenly, evenly and not at all; float64."""
    monkeypatch.setattr(mf, "QUERY_CHUNK", chunk)
    torch.manual_seed(0)
    B, H, hd = 2, 3, 5
    q, k, v = (torch.randn(B, H, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scale = 1 / math.sqrt(hd)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y_ref, lse_ref = torch.softmax(s, -1) @ v, s.logsumexp(-1)
    y, lse = mf.chunked_attention_forward(
        q.detach(), k.detach(), v.detach(), 0.0, True, scale=scale
    )
    torch.testing.assert_close(y, y_ref.detach())
    torch.testing.assert_close(lse, lse_ref.detach())
    dy = torch.randn_like(y)
    grads = mf.chunked_attention_backward(
        dy, q.detach(), k.detach(), v.detach(), y, lse, 0.0, True, scale=scale
    )
    for g, ref in zip(grads, torch.autograd.grad(y_ref, (q, k, v), dy)):
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-6)


def test_chunked_pair_equals_the_cpu_flash_pair():
    """The two pairs agree, forward and backward (float32, blocks of 4 over T = 10): on the CPU
    one can stand for the other."""
    flash = mf._kernel_for(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    if flash is mf.CHUNKED:
        pytest.skip("this torch has no CPU flash pair")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    yc, lc = mf.chunked_attention_forward(q, k, v, 0.0, True, scale=0.3)
    yf, lf = flash[0](q, k, v, 0.0, True, scale=0.3)
    torch.testing.assert_close(yc, yf, **TOL)
    torch.testing.assert_close(lc, lf.reshape(lc.shape), **TOL)
    dy = torch.randn_like(yc)
    lse = torch.empty_like(lf).copy_(lc.view(lf.shape))
    for a, b in zip(
        mf.chunked_attention_backward(dy, q, k, v, yc, lc, 0.0, True, scale=0.3),
        flash[1](dy, q, k, v, yf, lse, 0.0, True, scale=0.3),
    ):
        torch.testing.assert_close(a, b, **TOL)


def test_kernel_choice_by_device_and_backend():
    cpu = torch.zeros(1, 1, 3, 2)
    assert mf._kernel_for(cpu, cpu, "chunked") is mf.CHUNKED
    meta = torch.zeros(1, 1, 3, 2, device="meta")  # any device but the CPU: the chunked pair
    assert mf._kernel_for(meta, meta) is mf.CHUNKED
    assert mf._kernel_for(cpu, torch.zeros(1, 1, 5, 2)) is None  # decoding offset: explicit


@pytest.mark.parametrize("n_layer, n_kv_head, variant", [(3, 2, "reuse_kv"), (4, 2, "ffn_kv")])
def test_moda_chunked_equals_explicit_in_loss_and_every_gradient(
    n_layer, n_kv_head, variant, monkeypatch
):
    """The cuda backend's MoDA (the chunked pair, here on CPU tensors) against the explicit score
    matrices in a whole model, blocks of 5 queries over 12 positions."""
    monkeypatch.setattr(mf, "QUERY_CHUNK", 5)
    chunked, explicit = twin_models(
        "moda", "cuda", n_layer=n_layer, n_kv_head=n_kv_head, arch_options={"variant": variant}
    )
    # without fla-core ChunkedMoDABlock, with it its subclass TritonMoDABlock, which hands CPU
    # tensors outside the interpreter's region to the chunked pair
    assert set(swapped(chunked).values()) <= {"FusedMoDA", "ChunkedMoDABlock", "TritonMoDABlock"}
    blocks = [m for m in chunked.modules() if isinstance(m, mf.ChunkedMoDABlock)]
    q = torch.zeros(1, 1, 3, 8)
    assert len(blocks) == n_layer and all(m.kernel_pair(q, q) is mf.CHUNKED for m in blocks)
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    assert_same_loss_and_gradients(chunked, explicit, idx, targets)
