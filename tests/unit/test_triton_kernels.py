"""The Triton kernels the CUDA backend swaps in (depthbench/kernels/triton_streams.py, over
Liger-Kernel's mHC kernels) against the definitions they replace, forward and every gradient.

Without a GPU they run on CPU tensors in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported; `on_cpu()` lets CPU tensors take them): float32
to 1e-5 relative, float16 within its rounding. bfloat16 cannot be checked here (the interpreter
multiplies bf16 bit patterns); tests/integration/test_gpu.py checks it on a GPU, where these tests
run on the GPU itself. The interpreter is serial: atomics' races, TF32 and speed are the GPU's
to show. Each case is a few tokens wide: an interpreted kernel costs about the same per program
whatever the GPU would make of it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("liger_kernel", reason="the Triton kernels need liger-kernel (setup: test)")

from depthbench.kernels import triton_streams as ts  # noqa: E402
from depthbench.kernels.swap import swap_in, swapped  # noqa: E402
from depthbench.models.config import ModelConfig  # noqa: E402
from depthbench.models.registry import build_model  # noqa: E402
from depthbench.models.sinkhorn import sinkhorn_knopp  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, n, d = 5, 4, 16  # tokens, streams, width
ITERATIONS = 20


@pytest.fixture(autouse=True)
def kernels_on_this_device():
    """The kernels on CPU tensors (the interpreter) where there is no GPU. Liger's backward
    divides in rows the kernels mask and never store, which numpy reports as an invalid value."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        if DEVICE == "cpu":
            with ts.on_cpu():
                yield
        else:
            yield


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_matches(fn, reference, inputs, tol=1e-5):
    """fn(*inputs) against reference(*inputs), and the gradients of every input (under a random
    upstream gradient per output), each within `tol` relative (norm-wise)."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out, ref = fn(*inputs), reference(*inputs)
    out, ref = (out,) if torch.is_tensor(out) else out, (ref,) if torch.is_tensor(ref) else ref
    g = torch.Generator(DEVICE).manual_seed(3)
    ups = [torch.randn(r.shape, device=DEVICE, generator=g, dtype=r.dtype) for r in ref]
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert rel(o, r) <= tol, rel(o, r)
    diff = [t for t in inputs if t.requires_grad]
    got = torch.autograd.grad(sum((o * u).sum() for o, u in zip(out, ups)), diff)
    want = torch.autograd.grad(sum((r * u).sum() for r, u in zip(ref, ups)), diff)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel(a, b) <= tol, (i, rel(a, b))


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(
        DEVICE
    )


def ref_projection(x, phi, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) @ phi.float()


def ref_coefficients(mix, bias, gains, iterations):
    pre = torch.sigmoid(gains[0] * mix[:, :n] + bias[:n])
    post = 2 * torch.sigmoid(gains[1] * mix[:, n : 2 * n] + bias[n : 2 * n])
    logits = gains[2] * mix[:, 2 * n :].view(-1, n, n) + bias[2 * n :].view(n, n)
    return pre, post, sinkhorn_knopp(logits, iterations)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_normed_projection(dtype, tol):
    """(x / rms(x)) phi: mHC's flattened streams, fp32 accumulation from fp16 too."""
    x, phi = randn(N, n * d, dtype=dtype), 0.1 * randn(n * d, 2 * n + n * n, dtype=dtype, seed=1)
    assert_matches(
        lambda x, phi: ts.normed_projection(x, phi, 1e-6)[0],
        lambda x, phi: ref_projection(x, phi, 1e-6),
        [x, phi],
        tol,
    )


def test_mhc_coefficients_with_the_definitions_sinkhorn():
    """H_pre, H_post and H_res (20 Sinkhorn iterations) and the gradients of the projection, the
    biases and the three gains."""
    mix = randn(N, 2 * n + n * n)
    bias = 0.5 * randn(2 * n + n * n, seed=1)
    gains = torch.tensor([0.3, -0.2, 0.5], device=DEVICE)
    assert_matches(
        lambda m, b, g: ts.mhc_coefficients(m, b, g, ITERATIONS),
        lambda m, b, g: ref_coefficients(m, b, g, ITERATIONS),
        [mix, bias, gains],
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_stream_read(dtype, tol):
    H, w = randn(N, n, d, dtype=dtype), randn(N, n, seed=1)
    assert_matches(ts.stream_read, lambda H, w: (w[..., None] * H).sum(1).to(H.dtype), [H, w], tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_stream_write(dtype, tol):
    H, out = randn(N, n, d, dtype=dtype), randn(N, d, dtype=dtype, seed=1)
    post, mix = randn(N, n, seed=2), randn(N, n, n, seed=3)

    def reference(H, out, post, mix):
        new = mix @ H.float() + post[..., None] * out.float()[:, None]
        return new.to(H.dtype)

    assert_matches(ts.stream_write, reference, [H, out, post, mix], tol)


def test_every_custom_op_passes_opcheck():
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of each op."""
    ops = torch.ops.depthbench
    x, phi = randn(3, 2 * 8), 0.1 * randn(2 * 8, 8, seed=1)
    mix = randn(3, 2 * 2 + 4, seed=2)
    cases = [
        (ops.triton_normed_projection, (x.requires_grad_(), phi, 1e-6)),
        (ops.triton_mhc_coefficients, (mix, randn(8, seed=3), torch.rand(3, device=DEVICE), 3)),
        (ops.triton_stream_read, (randn(3, 2, 8), randn(3, 2, seed=4))),
        (
            ops.triton_stream_write,
            (randn(3, 2, 8), randn(3, 8, seed=5), randn(3, 2, seed=6), randn(3, 2, 2, seed=7)),
        ),
    ]
    for op, args in cases:
        args = tuple(a.requires_grad_() if torch.is_tensor(a) else a for a in args)
        torch.library.opcheck(op, args)


def stream_model(arch, **options):
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            arch=arch,
            vocab_size=32,
            d_model=d,
            n_layer=2,
            n_head=2,
            max_seq_len=8,
            arch_options=options,
        )
    ).to(DEVICE)
    with torch.no_grad():  # off the zero-initialised dynamic weights
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    "arch, options", [("hc", {}), ("mhc", {"sinkhorn_iterations": 4})], ids=["hc", "mhc"]
)
def test_swapped_model_equals_the_definition(arch, options, monkeypatch):
    """A whole model with the CUDA backend's HC / mHC swapped in: the loss, the recorded stream
    mixing and every gradient as the definition's (fp32; the gradients norm-wise over the model,
    some parameters' own being near zero)."""
    calls = []
    liger = ts._liger
    monkeypatch.setattr(ts, "_liger", lambda: calls.append(1) or liger())
    definition = stream_model(arch, **options)
    fast = swap_in(copy.deepcopy(definition), "cuda")
    assert len(swapped(fast)) == 4  # two sublayers in each of two layers
    idx = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    runs = []
    for model in (fast, definition):
        out = model(idx[:, :-1], idx[:, 1:], return_internals=True)
        out.loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        runs.append((out.loss.detach(), out.internals["stream_mixing"], grads))
    (loss, mixing, grads), (ref_loss, ref_mixing, ref_grads) = runs
    assert rel(loss, ref_loss) <= 1e-5
    for a, b in zip(mixing, ref_mixing):
        assert rel(a, b) <= 1e-5
    assert rel(grads, ref_grads) <= 1e-5
    # per sublayer: projection, read, write forward; their backwards (and mHC's coefficients)
    assert len(calls) >= 4 * 6


def test_streams_not_a_power_of_two_take_the_definition(monkeypatch):
    """Liger's kernels index the streams with tl.arange: with n = 3 the definition runs."""
    model = swap_in(stream_model("hc", n_streams=3), "cuda")
    monkeypatch.setattr(ts, "_liger", lambda: pytest.fail("a kernel ran for n = 3"))
    model(torch.zeros(1, 4, dtype=torch.long, device=DEVICE)).logits.sum()
