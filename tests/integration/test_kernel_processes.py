"""The C++ CPU kernels (depthbench.kernels) where other processes take part: under torch.compile,
whose compile workers are Python processes, HC's and mHC's fused reads stay one custom-op call
per sublayer and give eager's loss and gradients; and the thread-count tests of
tests/unit/test_cpu_kernels.py and tests/unit/test_hc_kernel.py pass again in a process where MKL
splits a GEMM's inner sum between threads (MKL_CBWR=COMPATIBLE)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from depthbench import kernels

from tests.kernel_checks import assert_compiled_calls_kernels_and_matches_eager, perturbed_hc

reason = kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(
    reason is not None, reason=f"CPU kernels cannot be built here: {reason}"
)


@pytest.mark.slow  # torch.compile starts its compile workers (Python processes)
def test_compiled_hc_keeps_the_kernel_and_matches_eager(monkeypatch):
    """Under torch.compile each sublayer's read stays one custom-op call: same loss and
    gradients."""
    model = perturbed_hc(n_layer=1, d_model=16)
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    assert_compiled_calls_kernels_and_matches_eager(
        monkeypatch, model, idx, targets, {"hc_read_forward": 2, "hc_read_backward": 2}
    )


@pytest.mark.slow  # torch.compile starts its compile workers (Python processes)
def test_compiled_mhc_keeps_the_kernel_and_matches_eager(monkeypatch):
    """Under torch.compile each sublayer's read stays one custom-op call: same loss and
    gradients."""
    model = perturbed_hc(n_layer=1, d_model=16, arch="mhc")
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    # both sublayers of the layer, forward and backward, each one fused read
    assert_compiled_calls_kernels_and_matches_eager(
        monkeypatch, model, idx, targets, {"mhc_read_forward": 2, "mhc_read_backward": 2}
    )


@pytest.mark.slow
def test_kernels_are_independent_of_thread_count_under_mkl_conditional_reproducibility():
    """The thread-count tests again in a process where MKL splits a GEMM's inner sum between
    threads (MKL_CBWR=COMPATIBLE makes it do so on CPUs where it otherwise does not): a kernel
    that hands a reduction over tokens or features to BLAS fails here on any CPU."""
    here = Path(__file__).parents[1] / "unit"
    tests = [
        f"{here / 'test_cpu_kernels.py'}::test_kernel_is_independent_of_thread_count",
        f"{here / 'test_cpu_kernels.py'}::test_mhc_read_kernel_is_independent_of_thread_count",
        f"{here / 'test_hc_kernel.py'}::test_hc_read_kernel_is_independent_of_thread_count",
        f"{here / 'test_hc_kernel.py'}::test_stream_write_kernel_is_independent_of_thread_count",
    ]
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
        cwd=here.parents[1],  # the repository root: the tests import tests.kernel_checks
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"{len(tests)} passed" in done.stdout
