"""The conda environment for cluster users pins exactly what requirements.txt pins."""

import re

import yaml

from tests.conftest import REPO


def pins(lines):
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line).groups()
            out[name.lower()] = version
    return out


def test_conda_env_matches_requirements():
    req = pins((REPO / "requirements.txt").read_text().splitlines())
    env = yaml.safe_load((REPO / "envs" / "depthbench.yaml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pins(pip_section) == req
    assert req["torch"] == "2.13.0"


def test_installed_versions_are_the_pinned_ones():
    from importlib.metadata import version

    for name, pinned in pins((REPO / "requirements.txt").read_text().splitlines()).items():
        assert version(name).split("+")[0] == pinned, name
