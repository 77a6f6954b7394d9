"""The `depthbench` command line writing its output into a pipe whose reader has closed it early,
as `head` does: the command exits with status 0 and prints no BrokenPipeError traceback."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_cli_listing_into_a_closed_pipe_exits_cleanly():
    """`depthbench runs CONFIG | head -1`: the reader closes the pipe early; the command must not
    print a BrokenPipeError traceback or fail."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "depthbench", "runs", "config/presets/cpu_all.yaml"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # before the listing is written (the import alone takes seconds), as `head` may
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 0, err
    assert "Traceback" not in err
