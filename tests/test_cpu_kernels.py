"""The C++ CPU kernels (depthbench.kernels) give the numbers of the PyTorch code they replace."""

from __future__ import annotations

import pytest
import torch

from depthbench import kernels
from depthbench.models import ModelConfig, build_model
from depthbench.models.archs import mhc as mhc_module
from depthbench.models.archs.mhc import sinkhorn_knopp

reason = kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"CPU kernels cannot be built here: {reason}")


def test_the_kernels_build_where_nothing_stands_in_the_way():
    assert kernels.cpu_kernels() is not None


def _loop(m: torch.Tensor, iterations: int) -> torch.Tensor:
    """The definition: alternating row and column normalisation of (n, n, ...) matrices."""
    for _ in range(iterations):
        m = m / m.sum(1, keepdim=True)
        m = m / m.sum(0, keepdim=True)
    return m


@pytest.mark.parametrize("n,tokens", [(4, 1), (4, 33), (3, 100), (2, 64), (5, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_backward_equal_the_unrolled_loop(n, tokens, dtype):
    """Token counts below, at and across the kernel's tile of 32, several n, both dtypes."""
    torch.manual_seed(n * 1000 + tokens)
    m = (torch.randn(n, n, tokens, dtype=dtype) * 0.7 + 3 * torch.eye(n, dtype=dtype)[..., None]).exp()
    grad = torch.randn(n, n, tokens, dtype=dtype)
    k = kernels.cpu_kernels()
    out = k.sinkhorn_forward(m, 20)
    ref = _loop(m, 20)
    # the same operations; PyTorch may add n > 4 slices in another order: equal to rounding
    torch.testing.assert_close(out, ref, rtol=16 * torch.finfo(dtype).eps, atol=0)
    x = m.clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(_loop(x, 20), x, grad)
    tol = 1e-4 if dtype == torch.float32 else 1e-11
    torch.testing.assert_close(k.sinkhorn_backward(m, grad, 20), ref_grad, rtol=tol, atol=tol)


def test_kernel_gradient_matches_finite_differences():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, 4, dtype=torch.float64, requires_grad=True)
    assert mhc_module._fused_kernel_applies(x.detach())
    assert torch.autograd.gradcheck(lambda t: sinkhorn_knopp(t, 20), (x,))


def test_kernel_is_independent_of_thread_count():
    torch.manual_seed(0)
    m = (torch.randn(4, 4, 2000) * 0.5).exp()
    grad = torch.randn(4, 4, 2000)
    threads = torch.get_num_threads()
    k = kernels.cpu_kernels()
    try:
        torch.set_num_threads(1)
        one = (k.sinkhorn_forward(m, 20), k.sinkhorn_backward(m, grad, 20))
        torch.set_num_threads(2)
        two = (k.sinkhorn_forward(m, 20), k.sinkhorn_backward(m, grad, 20))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_sinkhorn_knopp_with_and_without_the_kernel(monkeypatch):
    """The public function: same matrices and gradients through the kernel and the PyTorch
    Function, with and without autograd, and the kernel is what runs on the CPU."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50, 4, 4) * 0.5 + torch.eye(4)
    weight = torch.randn(4, 4)
    calls = []
    real = kernels.cpu_kernels()

    class Spy:
        def sinkhorn_forward(self, m, it):
            calls.append("forward")
            return real.sinkhorn_forward(m, it)

        def sinkhorn_backward(self, m, g, it):
            calls.append("backward")
            return real.sinkhorn_backward(m, g, it)

    results = {}
    for name, module in [("kernel", Spy()), ("pytorch", None)]:
        monkeypatch.setattr(kernels, "cpu_kernels", lambda module=module: module)
        x = logits.clone().requires_grad_()
        out = sinkhorn_knopp(x, 20)
        (g,) = torch.autograd.grad((out * weight).sum(), x)
        with torch.no_grad():
            inferred = sinkhorn_knopp(logits, 20)
        results[name] = (out.detach(), g, inferred)
    assert calls == ["forward", "backward", "forward"]
    kernel, pytorch = results["kernel"], results["pytorch"]
    torch.testing.assert_close(kernel[0], pytorch[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kernel[1], pytorch[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(kernel[2], pytorch[2], rtol=1e-6, atol=1e-7)


def test_mhc_training_step_is_the_same_with_and_without_the_kernel(monkeypatch):
    """Loss and every parameter gradient of an mHC model agree between the two paths."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="mhc", vocab_size=64, n_layer=2, d_model=32, n_head=2, max_seq_len=16))
    with torch.no_grad():  # move the zero-initialised projections off their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    grads = {}
    for name, module in [("kernel", kernels.cpu_kernels()), ("pytorch", None)]:
        monkeypatch.setattr(kernels, "cpu_kernels", lambda module=module: module)
        model.zero_grad(set_to_none=True)
        loss = model(idx, targets).loss
        loss.backward()
        grads[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(grads["kernel"][0], grads["pytorch"][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads["kernel"][1], grads["pytorch"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


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


@pytest.mark.parametrize("n,tokens", [(4, 70), (3, 5), (5, 40)])
def test_mhc_coefficient_kernel_equals_the_definition(n, tokens):
    """Values and gradients (with respect to u) of the fused coefficients, including logits far
    enough below their row maximum for the clamp at -60 to cut the gradient."""
    torch.manual_seed(n + tokens)
    u = torch.randn(tokens, 2 * n + n * n, dtype=torch.float64)
    u[0, 2 * n] = -100.0  # 100 below its row's maximum: clamped
    k = kernels.cpu_kernels()
    coeff, post = k.mhc_coefficients_forward(u, n, 20)
    ref_coeff, ref_post = _coefficients_reference(u, n, 20)
    torch.testing.assert_close(coeff, ref_coeff, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(post, ref_post, rtol=1e-12, atol=1e-14)
    g_coeff, g_post = torch.randn_like(coeff), torch.randn_like(post)
    x = u.clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(_coefficients_reference(x, n, 20), x, (g_coeff, g_post))
    grad = k.mhc_coefficients_backward(u, g_coeff, g_post, n, 20)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert grad[0, 2 * n] == 0


def test_mhc_coefficient_kernel_gradient_matches_finite_differences():
    torch.manual_seed(0)
    u = torch.randn(6, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mhc_module.fused_coefficients(t, 4, 20), (u,))


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
    torch.library.opcheck(mhc_module.fused_coefficients, (u, 4, 20))


def test_compiled_mhc_keeps_the_kernel_and_matches_eager(monkeypatch):
    """Under torch.compile the coefficients stay one custom-op call: same loss and gradients."""
    real = kernels.cpu_kernels()
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(kernels, "cpu_kernels", lambda: Spy())
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="mhc", vocab_size=64, n_layer=1, d_model=16, n_head=2, max_seq_len=8))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    results = []
    for net in (model, torch.compile(model)):
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = net(idx, targets).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        # both sublayers of the layer, forward and backward
        assert calls.count("mhc_coefficients_forward") == 2 and calls.count("mhc_coefficients_backward") == 2
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
