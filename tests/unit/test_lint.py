"""The linter over the whole code base: `ruff check` with the settings of pyproject.toml
([tool.ruff]: line length 100; pyflakes, pycodestyle errors and the line-length rule)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_ruff_finds_nothing():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "depthbench",
            "tests",
            "scripts",
            "benchmarks",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
