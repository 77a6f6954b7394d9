"""What the guides show is what the code does: the sample config error of docs/configs.md is the
real message, and the one-node SLURM command of docs/slurm-and-scale.md (nested `--config`
values, which Snakemake hands over as strings) validates and plans as written."""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError
from depthbench.spec.schema import coerce_command_line, validate_schema
from tests.conftest import REPO

CONFIGS_GUIDE = (REPO / "docs" / "configs.md").read_text()
SLURM_GUIDE = (REPO / "docs" / "slurm-and-scale.md").read_text()
SNAKEFILE_PREFIX = "DepthBench config error: "  # what the Snakefile puts before a ConfigError


def _guide_error() -> str:
    (line,) = [line for line in CONFIGS_GUIDE.splitlines() if line.startswith(SNAKEFILE_PREFIX)]
    return line


def _guide_error_config() -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["shapes"] = yaml.safe_load(
        re.search(r"default config with `shapes: (\[.*?\])`", CONFIGS_GUIDE).group(1)
    )
    return config


def _guide_slurm_command() -> list[str]:
    (line,) = [
        line
        for line in SLURM_GUIDE.splitlines()
        if line.startswith("snakemake --profile slurm --config ")
    ]
    return shlex.split(line)


def test_guide_sample_config_error_is_the_real_message():
    assert f'f"{SNAKEFILE_PREFIX}{{exc}}"' in (REPO / "Snakefile").read_text()
    with pytest.raises(ConfigError) as err:
        expand_grid(load_config(_guide_error_config()))
    assert SNAKEFILE_PREFIX + str(err.value) == _guide_error()


def _as_snakemake_reads(args: list[str]) -> tuple[dict, dict]:
    """(merged config, overrides) as the Snakefile sees them for `args` over the default config."""
    from snakemake.cli import parse_config
    from snakemake.utils import update_config

    overrides = parse_config([args[args.index("--config") + 1]])
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    update_config(config, copy.deepcopy(overrides))
    return config, overrides


def test_guide_slurm_override_reads_by_the_schemas_types():
    config, overrides = _as_snakemake_reads(_guide_slurm_command())
    assert overrides["launcher"]["slurm"]["cpus_per_task"] == "1"  # what Snakemake hands over
    validate_schema(coerce_command_line(config, overrides))
    want = {"gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 2, "time_min": 60}
    assert {k: config["launcher"]["slurm"][k] for k in want} == want


@pytest.mark.parametrize(
    "value, field",
    [("two", "cpus_per_task"), ("1.5", "cpus_per_task"), ("yes please", "gpus_per_node")],
)
def test_override_that_is_not_of_the_fields_type_is_refused_naming_it(value, field):
    config, overrides = _as_snakemake_reads(
        ["--config", f"launcher={{backend: slurm, slurm: {{{field}: {value}}}}}"]
    )
    with pytest.raises(
        ConfigError, match=re.escape(f"'launcher.slurm.{field}'") + ".*is not of type 'integer'"
    ):
        validate_schema(coerce_command_line(config, overrides))


@pytest.mark.slow
def test_guide_commands_run_as_written(tmp_path):
    """The one-node SLURM command, as a dry run in a copy of the workflow, plans the default
    grid's training through SLURM; the sample error is what Snakemake prints."""
    for name in ("Snakefile", "workflow", "scripts", "config", "slurm", "envs"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    args = _guide_slurm_command()
    assert args[0] == "snakemake"
    proc = subprocess.run(
        [sys.executable, "-m", *args, "-n"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"^train\s+54$", proc.stdout, re.M), proc.stdout[-2000:]
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(_guide_error_config()))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0 and _guide_error() in proc.stdout + proc.stderr
