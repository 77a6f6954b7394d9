"""The slow marker outside tests/unit (tests/conftest.py's `subprocesses_only_in_slow_tests`): a
test not marked slow cannot start a Python interpreter, so `-m "not slow"` starts no fresh
process of DepthBench's; a test marked slow can, and its output comes back."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def test_a_test_not_marked_slow_cannot_start_python(request):
    command = [sys.executable, "-c", "pass"]
    message = (
        f"{request.node.nodeid} starts {os.path.basename(sys.executable)} ({command!r:.200}) but "
        "is not marked @pytest.mark.slow"
    )
    with pytest.raises(AssertionError, match=f"^{re.escape(message)}$"):
        subprocess.run(command)


@pytest.mark.slow
def test_a_slow_test_can():
    assert (
        subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True).stdout
        == b"42\n"
    )
