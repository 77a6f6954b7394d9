"""HC's fused read kernel (depthbench/kernels/hc.cpp) gives the numbers of HC's definition."""

from __future__ import annotations

import copy

import pytest
import torch

from depthbench import kernels
from depthbench.kernels import hc_ops, stream_ops
from depthbench.kernels.swap import swap_out, swapped

from tests.kernel_checks import assert_independent_of_thread_count, perturbed_hc

reason = kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(
    reason is not None, reason=f"CPU kernels cannot be built here: {reason}"
)


def _read_reference(H, weight, static, scale, eps):
    """The definition in PyTorch: per-stream RMS, projection, static + scale_j * tanh (one scale
    per coefficient column j), read, mix."""
    n = H.shape[1]
    inv_rms = torch.rsqrt((H * H).mean(-1, keepdim=True) + eps)
    coeff = static + scale * torch.tanh((H @ weight.T) * inv_rms)
    out = coeff[..., : n + 1].mT @ H  # row 0 reads, rows 1..n mix
    return out[:, 0], out[:, 1:], coeff


def _case(n, d, tokens, dtype, weight_scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(tokens, n, d, dtype=dtype, generator=g)
    weight = torch.randn(n + 2, d, dtype=dtype, generator=g) * weight_scale
    static = torch.randn(n, n + 2, dtype=dtype, generator=g)
    scale = torch.rand(n + 2, dtype=dtype, generator=g) + 0.25  # a different scale per column
    return H, weight, static, scale


@pytest.mark.parametrize(
    "n,d,tokens", [(4, 64, 70), (4, 64, 1), (3, 20, 5), (5, 37, 130), (1, 8, 3), (2, 16, 257)]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_hc_read_kernel_equals_the_definition(n, d, tokens, dtype):
    """Outputs and the gradients of H, the weight, the static weights and the per-column scales;
    n = 1..5 (5: the runtime-n path), d with and without a partial vector, token counts across a
    weight chunk."""
    H, weight, static, scale = _case(n, d, tokens, dtype)
    inputs = [t.clone().requires_grad_() for t in (H, weight, static, scale)]
    expected = _read_reference(*inputs, 1e-6)
    grads_out = [torch.randn_like(t) for t in expected]
    expected_grads = torch.autograd.grad(expected, inputs, grads_out)
    k = kernels.cpu_kernels()
    got = k.hc_read_forward(H, weight, static, scale, 1e-6)
    got_grads = k.hc_read_backward(H, weight, static, scale, 1e-6, *grads_out)
    assert len(got_grads) == 4
    tol = dict(rtol=1e-11, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b.detach(), **tol)
    gtol = dict(rtol=1e-10, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-4)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, **gtol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_kernels_tanh_is_accurate_over_its_whole_range(dtype):
    """The vectorised tanh of hc.cpp against torch.tanh, for |p| from 1e-9 to beyond its clamp
    at 20, both signs. One stream with d = 2 and H_t = (cos a_t, sin a_t): RMS normalisation
    gives p_t = sqrt(2) s cos(a_t) for a weight row (s, 0), static 0 and scales 1, so the first
    coefficient is tanh(p_t)."""
    angles = torch.linspace(0, torch.pi, 2001, dtype=torch.float64)
    H = torch.stack([angles.cos(), angles.sin()], dim=-1).view(-1, 1, 2).to(dtype)
    for s in (1e-9, 1e-4, 0.1, 1.0, 5.0, 30.0):
        weight = torch.tensor([[s, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=dtype)
        _, _, coeff = kernels.cpu_kernels().hc_read_forward(
            H, weight, torch.zeros(1, 3, dtype=dtype), torch.ones(3, dtype=dtype), 0.0
        )
        p = (H[:, 0, 0] * s) * torch.rsqrt((H * H).mean(-1)[:, 0])  # as the kernel rounds it
        tol = (
            dict(rtol=1e-14, atol=1e-300) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-30)
        )
        torch.testing.assert_close(coeff[:, 0, 0], torch.tanh(p), **tol)


def test_hc_read_kernel_is_independent_of_thread_count():
    H, weight, static, scale = _case(4, 64, 1000, torch.float32)
    grads = [torch.randn(1000, 64), torch.randn(1000, 4, 64), torch.randn(1000, 4, 6)]
    k = kernels.cpu_kernels()
    assert_independent_of_thread_count(
        lambda: (
            *k.hc_read_forward(H, weight, static, scale, 1e-6),
            *k.hc_read_backward(H, weight, static, scale, 1e-6, *grads),
        )
    )


def test_stream_write_kernel_is_independent_of_thread_count():
    g = torch.Generator().manual_seed(0)
    grad, weights, out = (
        torch.randn(*shape, generator=g) for shape in [(1000, 4, 64), (1000, 4), (1000, 64)]
    )
    k = kernels.cpu_kernels()
    assert_independent_of_thread_count(lambda: k.stream_write_backward(grad, weights, out))


def test_every_kernel_entry_point_has_a_thread_count_test():
    """Every kernel the extension exports is called by one of the thread-count tests (their
    names in this file's and test_cpu_kernels.py's source). The counting allocator it exports
    too computes nothing (tests/unit/test_measured_memory.py)."""
    from pathlib import Path

    here = Path(__file__).parent
    source = "".join(
        (here / name).read_text() for name in ("test_hc_kernel.py", "test_cpu_kernels.py")
    )
    tests = [
        part
        for part in source.split("\ndef ")
        if part.split("(")[0].endswith("independent_of_thread_count")
    ]
    exported = [
        name
        for name in dir(kernels.cpu_kernels())
        if not name.startswith(("_", "counting_allocator_"))
    ]
    assert len(exported) == 7, exported
    untested = [name for name in exported if not any(f"k.{name}(" in test for test in tests)]
    assert not untested, f"no thread-count test calls {untested}"


def test_hc_read_custom_op_registration_and_gradcheck():
    inputs = [t.requires_grad_() for t in _case(3, 12, 9, torch.float64)]
    torch.library.opcheck(hc_ops.fused_read, (*inputs, 1e-6))
    assert torch.autograd.gradcheck(lambda *a: hc_ops.fused_read(*a, 1e-6), inputs)
    assert torch.autograd.gradcheck(lambda *a: hc_ops.read(*a, 1e-6), inputs)  # eager: the Function


def test_hc_read_kernel_rejects_bad_shapes():
    H, weight, static, scale = _case(4, 16, 3, torch.float32)
    with pytest.raises(RuntimeError, match=r"weight \(n \+ 2, d\)"):
        kernels.cpu_kernels().hc_read_forward(H, weight[:5], static, scale, 1e-6)
    with pytest.raises(RuntimeError, match=r"scales \(n \+ 2\)"):
        kernels.cpu_kernels().hc_read_forward(H, weight, static, scale[:1], 1e-6)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        kernels.cpu_kernels().hc_read_forward(
            H.half(), weight.half(), static.half(), scale.half(), 1e-6
        )


@pytest.mark.parametrize("arch,n_streams", [("hc", 4), ("hc", 3), ("mhc", 4), ("mhc", 3)])
def test_training_step_is_the_same_with_and_without_the_kernels(arch, n_streams):
    """HC and mHC: loss, every parameter gradient and the recorded stream-mixing matrices agree
    between the C++ kernels (the CPU's implementation, swapped in) and the definition."""
    kernel = perturbed_hc(arch=arch, n_streams=n_streams)
    assert swapped(kernel)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    results = {}
    for name, model in [("kernel", kernel), ("pytorch", swap_out(copy.deepcopy(kernel)))]:
        loss = model(idx, targets).loss
        loss.backward()
        with torch.no_grad():
            internals = model(idx, return_internals=True).internals
        results[name] = (
            loss.detach(),
            [p.grad.clone() for p in model.parameters()],
            internals["stream_mixing"],
        )
    torch.testing.assert_close(results["kernel"][0], results["pytorch"][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(results["kernel"][1], results["pytorch"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(results["kernel"][2], results["pytorch"][2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,d,tokens", [(4, 64, 70), (3, 13, 5), (5, 8, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stream_write_backward_equals_autograd_through_addcmul(n, d, tokens, dtype):
    """HC's and mHC's write H = mixed + w^T out: the C++ backward against autograd."""
    g = torch.Generator().manual_seed(1)
    mixed, w, out = (
        torch.randn(*shape, dtype=dtype, generator=g, requires_grad=True)
        for shape in ((tokens, n, d), (tokens, n), (tokens, d))
    )
    H = torch.addcmul(mixed, w.unsqueeze(-1), out.unsqueeze(-2))
    grad = torch.randn_like(H)
    expected = torch.autograd.grad(H, (mixed, w, out), grad)
    fused = stream_ops.fused_write(mixed, w, out)
    torch.testing.assert_close(fused, H)
    got = torch.autograd.grad(fused, (mixed, w, out), grad)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **tol)


def test_stream_write_custom_op_registration():
    g = torch.Generator().manual_seed(2)
    args = [
        torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
        for shape in ((5, 3, 4), (5, 3), (5, 4))
    ]
    torch.library.opcheck(stream_ops.fused_write, args)
    assert torch.autograd.gradcheck(stream_ops.fused_write, args)
    # eager: the in-place Function (on a copy of mixed, as the read's fresh output would be)
    assert torch.autograd.gradcheck(
        lambda m, w, o: stream_ops._EagerWrite.apply(m.clone(), w, o), args
    )
