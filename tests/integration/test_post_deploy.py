"""envs/depthbench.post-deploy.sh, which Snakemake runs in a new conda environment, run as
written with a `python` whose pip only records what it is asked to install and whose torch is a
CPU or a CUDA build: the data packages always, the CUDA backend's Triton kernels (pyproject.toml's
no-deps `gpu` list) only beside a CUDA torch, then DepthBench itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

STUB = """#!/usr/bin/env bash
if [[ "$1" == "-m" && "$2" == "pip" ]]; then echo "${@:3}" >> "$PIP_LOG"; exit 0; fi
exec "$REAL_PYTHON" "$@"
"""


def _run(tmp_path, cuda: str | None, broken: bool = False):
    """(the script's completed process, the pip calls it made)."""
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text(STUB)
    python.chmod(0o755)
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    init = "raise ImportError('torch is broken')" if broken else "from torch import version"
    (fake / "__init__.py").write_text(init + "\n")
    (fake / "version.py").write_text(f"cuda = {cuda!r}\n")
    log = tmp_path / "pip.log"
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "PYTHONPATH": str(tmp_path / "site"),
        "REAL_PYTHON": sys.executable,
        "PIP_LOG": str(log),
    }
    done = subprocess.run(
        ["bash", str(REPO / "envs" / "depthbench.post-deploy.sh")],
        env=env,
        capture_output=True,
        text=True,
    )
    return done, log.read_text().splitlines() if log.exists() else []


# the script reads pyproject.toml with tomllib: Python 3.11 or later, as the conda env pins
needs_tomllib = pytest.mark.skipif(sys.version_info < (3, 11), reason="the script needs tomllib")


@pytest.mark.slow
@needs_tomllib
@pytest.mark.parametrize("cuda", [None, "12.8"], ids=["cpu-torch", "cuda-torch"])
def test_post_deploy_installs_the_nodeps_packages_then_depthbench(tmp_path, cuda):
    import tomllib

    lists = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["depthbench"]["no-deps"]
    expected = lists["base"] + (lists["gpu"] if cuda else [])
    done, calls = _run(tmp_path, cuda)
    assert done.returncode == 0, done.stderr
    assert calls == [
        f"install --no-deps -c {REPO}/constraints.txt {' '.join(expected)}",
        f"install --no-deps -e {REPO}",
    ]


@pytest.mark.slow
@needs_tomllib
def test_post_deploy_stops_on_a_torch_that_cannot_be_imported(tmp_path):
    """A broken torch stops the script before it installs anything, naming the import."""
    done, calls = _run(tmp_path, None, broken=True)
    assert done.returncode != 0 and "torch is broken" in done.stderr and calls == []
