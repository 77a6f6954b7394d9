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


def _run(tmp_path, cuda: str | None) -> list[str]:
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text(STUB)
    python.chmod(0o755)
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("from torch import version\n")
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
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("cuda", [None, "12.8"], ids=["cpu-torch", "cuda-torch"])
def test_post_deploy_installs_the_nodeps_packages_then_depthbench(tmp_path, cuda):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli
        from pip._vendor import tomli as tomllib

    lists = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["depthbench"]["no-deps"]
    expected = lists["base"] + (lists["gpu"] if cuda else [])
    calls = _run(tmp_path, cuda)
    assert calls == [
        f"install --no-deps -c {REPO}/constraints.txt {' '.join(expected)}",
        f"install --no-deps -e {REPO}",
    ]
