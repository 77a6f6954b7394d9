"""The C++ CPU kernels (depthbench.kernels) give the numbers of the PyTorch code they replace."""

from __future__ import annotations

import pytest
import torch

from depthbench import kernels
from depthbench.kernels import mhc_ops

from tests.kernel_checks import assert_independent_of_thread_count

reason = kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(
    reason is not None, reason=f"CPU kernels cannot be built here: {reason}"
)


def test_the_kernels_build_where_nothing_stands_in_the_way():
    assert kernels.cpu_kernels() is not None


def _loop(m: torch.Tensor, iterations: int) -> torch.Tensor:
    """The definition: alternating row and column normalisation of (n, n, ...) matrices."""
    for _ in range(iterations):
        m = m / m.sum(1, keepdim=True)
        m = m / m.sum(0, keepdim=True)
    return m


def test_kernel_is_independent_of_thread_count():
    torch.manual_seed(0)
    u = torch.randn(2000, 24)
    g_coeff, g_post = torch.randn(2000, 5, 4), torch.randn(2000, 4)
    k = kernels.cpu_kernels()
    assert_independent_of_thread_count(
        lambda: (
            *k.mhc_coefficients_forward(u, 4, 20),
            k.mhc_coefficients_backward(u, g_coeff, g_post, 4, 20),
        )
    )


def test_the_build_command_builds_and_says_where(capsys):
    """`python -m depthbench.kernels`, which scripts/setup.sh runs, leaves the loadable build in
    the cache directory it names."""
    from depthbench.kernels.__main__ import main

    assert main() == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU kernels ready") and str(kernels.build_directory()) in out
    assert any(kernels.build_directory().glob("depthbench_cpu_kernels*.so"))


def test_the_build_command_fails_with_the_reason_when_disabled(monkeypatch, capsys):
    from depthbench.kernels.__main__ import main

    monkeypatch.setenv("DEPTHBENCH_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_state", {})  # the process's cached build forgotten
    assert main() == 1
    assert capsys.readouterr().out.strip() == "CPU kernels unavailable: DEPTHBENCH_CPU_KERNELS=0"


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("DEPTHBENCH_CPU_KERNELS", "0")
    assert not kernels.enabled() and kernels.unavailable_reason() == "DEPTHBENCH_CPU_KERNELS=0"


def _coefficients_reference(u: torch.Tensor, n: int, iterations: int):
    """mHC's definition, in PyTorch: pre = sigmoid, post = 2 sigmoid, res = Sinkhorn of exp."""
    pre = torch.sigmoid(u[:, :n])
    post = 2 * torch.sigmoid(u[:, n : 2 * n])
    logits = u[:, 2 * n :].view(-1, n, n)
    shifted = logits - logits.amax(-1, keepdim=True).detach()
    res = _loop(shifted.clamp_min(-60).exp().permute(1, 2, 0), iterations).permute(2, 0, 1)
    return torch.cat([pre.unsqueeze(1), res], dim=1), post


@pytest.mark.parametrize("n,tokens", [(4, 1), (4, 32), (4, 70), (3, 5), (2, 64), (5, 40)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mhc_coefficient_kernel_equals_the_definition(n, tokens, dtype):
    """Values and gradients (with respect to u) of the fused coefficients, including logits far
    enough below their row maximum for the clamp at -60 to cut the gradient; token counts below,
    at and across the kernel's tile of 32, n a compile-time constant (2, 3, 4) or not (5)."""
    torch.manual_seed(n + tokens)
    u = torch.randn(tokens, 2 * n + n * n, dtype=dtype)
    u[0, 2 * n] = -100.0  # 100 below its row's maximum: clamped
    k = kernels.cpu_kernels()
    coeff, post = k.mhc_coefficients_forward(u, n, 20)
    ref_coeff, ref_post = _coefficients_reference(u, n, 20)
    tol = 1e-12 if dtype == torch.float64 else 1e-5  # reciprocal-multiply vs divide: rounding
    torch.testing.assert_close(coeff, ref_coeff, rtol=tol, atol=tol / 100)
    torch.testing.assert_close(post, ref_post, rtol=tol, atol=tol / 100)
    g_coeff, g_post = torch.randn_like(coeff), torch.randn_like(post)
    x = u.clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(_coefficients_reference(x, n, 20), x, (g_coeff, g_post))
    grad = k.mhc_coefficients_backward(u, g_coeff, g_post, n, 20)
    gtol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(grad, ref_grad, rtol=gtol, atol=gtol / 100)
    assert grad[0, 2 * n] == 0


def test_mhc_coefficient_kernel_gradient_matches_finite_differences():
    torch.manual_seed(0)
    u = torch.randn(6, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mhc_ops.fused_coefficients(t, 4, 20), (u,))


def test_mhc_coefficient_kernel_rejects_a_wrong_width():
    with pytest.raises(RuntimeError, match=r"2n \+ n\^2"):
        kernels.cpu_kernels().mhc_coefficients_forward(torch.zeros(3, 20), 4, 20)


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's build lock has no timeout: a build killed while holding it would make every later
    run wait forever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    kernels._remove_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running
    old = time.time() - kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    kernels._remove_stale_lock(tmp_path)
    assert not lock.exists()


def test_build_directory_changes_with_the_sources(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = kernels.build_directory()
    assert here.parent == tmp_path / "depthbench" and "torch" in here.name
    changed = tmp_path / "changed.cpp"
    changed.write_text("// another version")
    monkeypatch.setattr(kernels, "_SOURCES", [changed])
    assert kernels.build_directory() != here


def test_mhc_coefficient_custom_op_registration():
    """Fake (shape) implementation, autograd registration and schema agree with the kernel."""
    torch.manual_seed(0)
    u = torch.randn(40, 24, requires_grad=True)
    torch.library.opcheck(mhc_ops.fused_coefficients, (u, 4, 20))


# --- mHC's fused read (mhc_read_forward / _backward) -----------------------------------------


def _read_reference(H, weight, scale, bias, eps, iterations):
    """mHC's read by its definition: flattened RMS norm, projection, u = scale * z + bias, the
    coefficients, then read (row 0) and mix (rows 1..n)."""
    N, n, d = H.shape
    h = H.reshape(N, n * d)
    z = (h @ weight.T) * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)
    coeff, post = _coefficients_reference(scale * z + bias, n, iterations)
    out = coeff @ H
    return out[:, 0], out[:, 1:], coeff, post


def _read_case(n, d, tokens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 2 * n + n * n
    H = torch.randn(tokens, n, d, dtype=dtype, generator=g)
    weight = torch.randn(width, n * d, dtype=dtype, generator=g) * 0.3
    scale = torch.rand(width, dtype=dtype, generator=g)
    bias = torch.randn(width, dtype=dtype, generator=g)
    return H, weight, scale, bias


@pytest.mark.parametrize(
    "n,d,tokens", [(4, 64, 70), (4, 16, 1), (3, 20, 5), (5, 7, 40), (2, 16, 300)]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mhc_read_kernel_equals_the_definition(n, d, tokens, dtype):
    """Outputs and the gradients of H, the weight, the scale and the bias; n = 2..5 (5: runtime
    n), d with and without a partial vector, token counts across tiles and chunks."""
    inputs = [t.clone().requires_grad_() for t in _read_case(n, d, tokens, dtype)]
    expected = _read_reference(*inputs, 1e-6, 20)
    grads_out = [torch.randn_like(t) for t in expected]
    expected_grads = torch.autograd.grad(expected, inputs, grads_out)
    k = kernels.cpu_kernels()
    plain = [t.detach() for t in inputs]
    got = k.mhc_read_forward(*plain, 1e-6, 20)
    torch.testing.assert_close(got[4], plain[0].reshape(tokens, -1) @ plain[1].T)  # the projections
    got_grads = k.mhc_read_backward(*plain, 1e-6, 20, got[2], got[4], *grads_out)
    tol = dict(rtol=1e-11, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(got[:4], expected):
        torch.testing.assert_close(a, b.detach(), **tol)
    gtol = dict(rtol=1e-10, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-4)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, **gtol)


def test_mhc_read_kernel_is_independent_of_thread_count():
    H, weight, scale, bias = _read_case(4, 32, 1000, torch.float32)
    grads = [
        torch.randn(1000, 32),
        torch.randn(1000, 4, 32),
        torch.randn(1000, 5, 4),
        torch.randn(1000, 4),
    ]
    k = kernels.cpu_kernels()

    def compute():
        out = k.mhc_read_forward(H, weight, scale, bias, 1e-6, 20)
        return (
            *out,
            *k.mhc_read_backward(H, weight, scale, bias, 1e-6, 20, out[2], out[4], *grads),
        )

    assert_independent_of_thread_count(compute)


def test_mhc_read_custom_op_registration_and_gradcheck():
    inputs = [t.requires_grad_() for t in _read_case(3, 4, 7, torch.float64)]
    torch.library.opcheck(mhc_ops.fused_read, (*inputs, 1e-6, 20))
    assert torch.autograd.gradcheck(lambda *a: mhc_ops.fused_read(*a, 1e-6, 20)[:4], inputs)
    assert torch.autograd.gradcheck(
        lambda *a: mhc_ops.read(*a, 1e-6, 20)[:4], inputs
    )  # eager: the Function


def test_mhc_read_kernel_rejects_bad_shapes():
    H, weight, scale, bias = _read_case(4, 8, 3, torch.float32)
    with pytest.raises(RuntimeError, match=r"weight \(2n \+ n\^2, n d\)"):
        kernels.cpu_kernels().mhc_read_forward(H, weight[:, :-1], scale, bias, 1e-6, 20)
    out = kernels.cpu_kernels().mhc_read_forward(H, weight, scale, bias, 1e-6, 20)
    with pytest.raises(RuntimeError, match="grad post has shape"):
        kernels.cpu_kernels().mhc_read_backward(
            H,
            weight,
            scale,
            bias,
            1e-6,
            20,
            out[2],
            out[4],
            torch.zeros(3, 8),
            torch.zeros(3, 4, 8),
            torch.zeros(3, 5, 4),
            torch.zeros(3, 5),
        )


def test_built_carries_exactly_the_mark_assume_constant_result_sets():
    """kernels.built is marked as a compile-time constant by hand (importing torch._dynamo for the
    decorator cost every job a second); the decorator must still mark a function exactly so."""
    import torch._dynamo

    from depthbench import kernels

    def plain() -> bool:
        return True

    before = dict(vars(plain))
    marked = torch.compiler.assume_constant_result(plain)
    added = {k: v for k, v in vars(marked).items() if k not in before}
    assert added == {"_dynamo_marked_constant": True}
    assert getattr(kernels.built, "_dynamo_marked_constant", None) is True
