"""The linter over the whole code base: `ruff check` with the settings of pyproject.toml
([tool.ruff]: line length 100; pyflakes, pycodestyle errors and the line-length rule)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_ruff_finds_nothing():
    ruff = pytest.importorskip("ruff.__main__").find_ruff_bin()  # the binary: no interpreter
    done = subprocess.run(
        [
            ruff,
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
