"""MoDA's CUDA layer with its causal chunk in fla-core's Triton attention
(depthbench/kernels/moda_triton.py) against the chunked pair it replaces and the explicit score
matrices of the definition, forward and every gradient.

The kernels run on CPU tensors in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported on a machine without a GPU; `on_cpu()` lets CPU tensors take them),
which computes float32 as float32: to 1e-5, float16 within its rounding. On a GPU, where fla's
products run float32 in TF32 and bfloat16 is what training uses,
tests/integration/test_gpu.py::test_moda_pairs_on_cuda_against_float64 checks the pair."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("fla", reason="the Triton MoDA pair needs fla-core (setup: test)")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU, tests/integration/test_gpu.py checks the pair"
)

from depthbench.kernels import moda_fused as mf  # noqa: E402
from depthbench.kernels import moda_triton as mt  # noqa: E402
from depthbench.kernels import triton_streams as ts  # noqa: E402
from depthbench.kernels.swap import implementations, swap_in  # noqa: E402
from depthbench.models.archs.moda import MoDABlock, joint_depth_attention  # noqa: E402
from depthbench.models.archs.moda_depth_keys import DepthKeys  # noqa: E402
from depthbench.models.config import ModelConfig  # noqa: E402
from depthbench.models.registry import build_model  # noqa: E402

DEVICE = "cpu"  # the interpreter's
TOL = dict(rtol=1e-5, atol=1e-5)


def cfg(**kw):
    base = dict(arch="moda", vocab_size=61, n_head=4, max_seq_len=16, init_std=0.1)
    return ModelConfig(**{**base, **kw})


@pytest.fixture(autouse=True)
def kernels_in_the_interpreter():
    with ts.on_cpu():
        yield


def causal_reference(q, k, v, scale):
    """Softmax attention with its log-sum-exp, written out (float64)."""
    q, k, v = (t.double() for t in (q, k, v))
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, s.logsumexp(-1)


@pytest.mark.parametrize("hd", [16, 24])
@pytest.mark.parametrize("T", [7, 160])
def test_pair_equals_causal_attention_its_lse_and_gradients(T, hd):
    """Forward: y and the natural lse. Backward from the output and lse it is handed: the
    gradients of causal attention. Float32; T = 160 spans more than one of the kernels' blocks of
    queries (128 forward, 64 backward) and of keys; hd 24 is not a power of two."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, hd, device=DEVICE) for _ in range(3))
    scale = hd**-0.5
    y, lse = mt.triton_attention_forward(q, k, v, 0.0, True, scale=scale)
    y_ref, lse_ref = causal_reference(q, k, v, scale)
    assert y.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (2, 3, T)
    torch.testing.assert_close(y.double(), y_ref, **TOL)
    torch.testing.assert_close(lse.double(), lse_ref, **TOL)
    dy = torch.randn_like(y)
    grads = mt.triton_attention_backward(dy, q, k, v, y, lse, 0.0, True, scale=scale)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, _ = causal_reference(*leaves, scale)
    for g, ref in zip(grads, torch.autograd.grad(out, leaves, dy.double())):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), ref, **TOL)


def test_pair_equals_the_chunked_pair_in_float16():
    """The two pairs in float16 agree within its rounding; the backward handed the same output
    and lse (as the joint attention hands it the joint ones)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    yt, lt = mt.triton_attention_forward(q, k, v, 0.0, True, scale=0.25)
    yc, lc = mf.chunked_attention_forward(q, k, v, 0.0, True, scale=0.25)
    torch.testing.assert_close(yt, yc, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lt, lc.float(), rtol=1e-3, atol=1e-3)
    dy = torch.randn_like(yc)
    for a, b in zip(
        mt.triton_attention_backward(dy, q, k, v, yc, lc, 0.0, True, scale=0.25),
        mf.chunked_attention_backward(dy, q, k, v, yc, lc, 0.0, True, scale=0.25),
    ):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3)


def test_joint_attention_gradients_per_input_with_gqa():
    """The joint attention over the Triton pair (6 query heads over 3 KV heads, 3 depth slots):
    output and the gradient of q, k, v and every depth source equal autograd through the explicit
    score matrices."""
    torch.manual_seed(0)
    B, Hk, G, T, hd, D = 2, 3, 2, 9, 16, 3
    q = torch.randn(B, Hk * G, T, hd, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, Hk, T, hd, device=DEVICE, requires_grad=True) for _ in range(2))
    sources = [torch.randn(B, Hk, T, hd, device=DEVICE, requires_grad=True) for _ in range(2 * D)]
    keys = DepthKeys()
    for i in range(D):
        keys.append((sources[2 * i], sources[2 * i + 1]))
    out = mf.joint_attention_with(mt.TRITON, q, k, v, keys.buffer(), D)
    rep = lambda t: t.repeat_interleave(G, dim=1)  # noqa: E731
    dk, dv = torch.stack(sources[0::2], dim=3), torch.stack(sources[1::2], dim=3)
    ref = joint_depth_attention(q, rep(k), rep(v), rep(dk), rep(dv))
    torch.testing.assert_close(out, ref, **TOL)
    inputs = (q, k, v, *sources)
    dy = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, inputs, dy), torch.autograd.grad(ref, inputs, dy)):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("n_kv_head, variant", [(4, "reuse_kv"), (2, "ffn_kv")])
def test_moda_on_the_triton_pair_equals_the_definition_in_loss_and_every_gradient(
    n_kv_head, variant
):
    """A whole model with the cuda backend's swap (every MoDA layer after the first on the
    Triton pair) against the definition: loss and every parameter's gradient, and the logits
    without autograd (what the probes read), float32."""
    kw = dict(n_layer=3, n_kv_head=n_kv_head, d_model=64, arch_options={"variant": variant})
    torch.manual_seed(0)
    fast = build_model(cfg(**kw)).to(DEVICE)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(0.05 * torch.randn_like(p))
    definition = build_model(cfg(**kw)).to(DEVICE)
    definition.load_state_dict(fast.state_dict())
    swap_in(fast, "cuda")
    blocks = [m for m in fast.modules() if isinstance(m, MoDABlock)]
    assert blocks and all(type(m) is mt.TritonMoDABlock for m in blocks)
    calls = []
    forward = mt.triton_attention_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    pair = (counted, mt.triton_attention_backward)
    for m in blocks:  # the instances' pair, counted: the Triton kernels did run
        chosen = type(m).kernel_pair
        m.kernel_pair = lambda q, k, m=m: pair if chosen(m, q, k) is mt.TRITON else None
    gen = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 61, (2, 12), generator=gen).to(DEVICE) for _ in range(2))
    a, b = fast(idx, targets).loss, definition(idx, targets).loss
    assert len(calls) == len(blocks) - 1  # layer 1 has no depth keys
    torch.testing.assert_close(a, b, **TOL)
    a.backward()
    b.backward()
    for (name, pa), pb in zip(fast.named_parameters(), definition.parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, **TOL, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():  # and without autograd (the probes, removal, evaluation)
        torch.testing.assert_close(fast(idx).logits, definition(idx).logits, **TOL)
    assert len(calls) == 2 * (len(blocks) - 1)


def test_kernel_choice():
    """The Triton pair where the kernel takes the tensors; the chunked pair on meta (the memory
    trace), for float64 and for heads wider than 256; the explicit path with a decoding offset."""
    block = mt.TritonMoDABlock.__new__(mt.TritonMoDABlock)
    x = torch.zeros(1, 1, 3, 16, device=DEVICE)
    assert block.kernel_pair(x, x) is mt.TRITON
    assert block.kernel_pair(x.double(), x.double()) is mf.CHUNKED
    wide = torch.zeros(1, 1, 3, 264, device=DEVICE)
    assert block.kernel_pair(wide, wide) is mf.CHUNKED
    meta = torch.zeros(1, 1, 3, 16, device="meta")
    assert block.kernel_pair(meta, meta) is mf.CHUNKED
    assert block.kernel_pair(x, torch.zeros(1, 1, 5, 16, device=DEVICE)) is None
    assert block.kernel_pair(x.half(), x.half()) is mt.TRITON
    assert block.kernel_pair(x.bfloat16(), x.bfloat16()) is mf.CHUNKED  # the interpreter's bf16
    with pytest.MonkeyPatch.context() as mp:  # outside on_cpu(), no CPU tensor takes the kernels
        mp.setattr(ts, "_ON_CPU", False)
        assert block.kernel_pair(x, x) is mf.CHUNKED


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_custom_ops_pass_opcheck(layout):
    """opcheck (the fake implementations' shapes, dtypes and strides among its checks), also on
    views that are not contiguous."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    if layout == "strided":
        q, k, v = (torch.randn(1, 8, 2, 16, device=DEVICE).transpose(1, 2) for _ in range(3))
    torch.library.opcheck(mt.causal_attention, (q, k, v, 0.25))
    y, lse = mt.causal_attention(q, k, v, 0.25)
    dy = torch.randn_like(y)
    torch.library.opcheck(mt.causal_attention_backward, (dy, q, k, v, y, lse, 0.25))


def test_a_changed_fla_internal_fails_loudly():
    """fla-core's functions are internals: a signature other than the one the adapter passes is
    refused with the version it follows, and another installed version is left out of the swap
    with the reason."""

    def fwd(q, k, v, g_cumsum, sink_bias, scale):
        pass

    def bwd(q, k, v, o, lse, do, scale=None):  # g_cumsum dropped
        pass

    changed = types.SimpleNamespace(parallel_attn_fwd=fwd, parallel_attn_bwd=bwd)
    with pytest.raises(RuntimeError, match=r"parallel_attn_bwd.*0\.6\.0"):
        mt._check_internals(changed)
    from fla.ops.attn import parallel

    mt._check_internals(parallel)  # the installed one passes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "kept_off_reason", lambda: None)
        mp.setattr(mt.metadata, "version", lambda name: "0.7.0")
        assert "fla-core 0.7.0" in mt.unavailable_reason()
        assert implementations("cuda")[MoDABlock] is mf.ChunkedMoDABlock
        mp.undo()
        mp.setattr(mt, "kept_off_reason", lambda: None)
        assert mt.unavailable_reason() is None
        assert implementations("cuda")[MoDABlock] is mt.TritonMoDABlock


@pytest.mark.parametrize(
    "capability, triton, kept_off",
    [((9, 0), "3.6.0", True), ((9, 0), "3.3.1", False), ((8, 0), "3.6.0", False)],
)
def test_hopper_with_a_recent_triton_keeps_to_the_chunked_pair(capability, triton, kept_off):
    """Where fla-core routes its own attention off Triton (Hopper, Triton 3.4 or later), the
    swap leaves MoDA on the chunked pair, with the reason."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        mp.setattr(mt, "_triton_version", lambda: tuple(map(int, triton.split(".")[:2])))
        reason = mt.unavailable_reason()
        assert (reason is not None) == kept_off
        if kept_off:
            assert "Hopper" in reason and "3.6" in reason
            assert implementations("cuda")[MoDABlock] is mf.ChunkedMoDABlock


def test_units_compile_with_fullgraph_on_the_triton_pair():
    """MoDA's units with the Triton pair compile as training compiles them, without a graph
    break (the pair's custom ops are opaque to Dynamo), and train as eager."""
    import copy

    from torch._dynamo.utils import counters

    from depthbench.train.parallelize import wrap_units
    from tests.parallel_models import VOCAB, assert_same, tiny

    model = swap_in(tiny("moda", n_layer=2, arch_options={}).to(DEVICE), "cuda")
    assert {type(m) for m in model.modules() if isinstance(m, MoDABlock)} == {mt.TritonMoDABlock}
    reference = copy.deepcopy(model)
    counters.clear()
    wrap_units(model, "none", "block", backend="aot_eager", fullgraph=True)
    idx = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    assert_same(model, reference, idx.to(DEVICE), atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2  # one per depth-key count
