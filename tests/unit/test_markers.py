"""The suite's markers and folders mean what they say (tests/conftest.py's
`subprocesses_only_in_slow_tests`): a test not marked slow cannot start a Python interpreter or
Snakemake, so `-m "not slow"` starts no fresh process of DepthBench's; and a test in tests/unit
never can, slow or not, so `-m unit` runs in-process only. Both may run a system command."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def test_a_test_not_marked_slow_cannot_start_python_but_may_run_a_system_command(request):
    command = [sys.executable, "-c", "pass"]
    message = (
        f"{request.node.nodeid} starts {os.path.basename(sys.executable)} ({command!r:.200}) but "
        "is in tests/unit, whose tests run in-process (move it to tests/integration or "
        "tests/workflow)"
    )
    with pytest.raises(AssertionError, match=f"^{re.escape(message)}$"):
        subprocess.run(command)
    assert subprocess.run(["true"]).returncode == 0


def _square(x):
    return x * x


@pytest.mark.slow
def test_a_unit_test_cannot_spawn_ranks_even_when_marked_slow(request):
    """multiprocessing's spawn (torch.multiprocessing.spawn's ranks, a process pool) starts fresh
    interpreters too: refused here before any starts."""
    import multiprocessing

    with pytest.raises(
        AssertionError, match=f"^{re.escape(request.node.nodeid)} spawns .* but is in tests/unit"
    ):
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            pool.map(_square, [2])
