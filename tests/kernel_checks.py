"""Checks and models shared by the tests of the C++ CPU kernels (tests/unit/test_cpu_kernels.py,
tests/unit/test_hc_kernel.py, tests/integration/test_kernel_processes.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from depthbench import kernels
from depthbench.kernels.swap import swap_in
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model


def results_per_thread_count(compute: Callable[[], tuple], counts=(1, 2, 3, 4)) -> list[tuple]:
    """compute() run with each intra-op thread count in turn (the setting restored after). Counts
    past the machine's cores still split the work differently, which is what the tests need."""
    threads = torch.get_num_threads()
    try:
        results = []
        for count in counts:
            torch.set_num_threads(count)
            results.append(tuple(compute()))
    finally:
        torch.set_num_threads(threads)
    return results


def assert_independent_of_thread_count(compute: Callable[[], tuple]) -> None:
    """Every output of compute() bitwise the same for 1, 2, 3 and 4 intra-op threads."""
    first, *others = results_per_thread_count(compute)
    for count, result in zip((2, 3, 4), others):
        for i, (a, b) in enumerate(zip(first, result)):
            assert torch.equal(a, b), f"output {i} differs between 1 and {count} threads"


def assert_compiled_calls_kernels_and_matches_eager(
    monkeypatch, model, idx, targets, calls_per_step: dict
) -> None:
    """The model's loss and gradients eager and under torch.compile agree, and both call the
    kernel entry points `calls_per_step` times each (a spy on the kernel module counts them)."""
    real = kernels.cpu_kernels()
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(kernels, "cpu_kernels", lambda: Spy())
    results = []
    for net in (model, torch.compile(model)):
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = net(idx, targets).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert {name: calls.count(name) for name in calls_per_step} == calls_per_step
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def perturbed_hc(n_layer=2, d_model=32, arch="hc", **options):
    """A small model of `arch` (HC unless named) with arch_options `options`, every parameter
    moved off its initialisation (HC's and mHC's dynamic weights start at zero), with the CPU's
    implementations swapped in (depthbench.kernels.swap)."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            arch=arch,
            vocab_size=64,
            n_layer=n_layer,
            d_model=d_model,
            n_head=2,
            max_seq_len=16,
            arch_options=options,
        )
    )
    with torch.no_grad():  # move the zero-initialised dynamic weights off their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return swap_in(model, "cpu")
