"""The suite's markers mean what they say: a test not marked slow cannot start a Python
interpreter or Snakemake (tests/conftest.py's `subprocesses_only_in_slow_tests`), so
`-m "not slow"` starts no fresh process of DepthBench's."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_a_test_not_marked_slow_cannot_start_python_but_may_run_a_system_command(request):
    with pytest.raises(
        AssertionError, match=f"{request.node.name} starts python.*not marked @pytest.mark.slow"
    ):
        subprocess.run([sys.executable, "-c", "pass"])
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.slow
def test_a_slow_test_can():
    assert (
        subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True).stdout
        == b"42\n"
    )
