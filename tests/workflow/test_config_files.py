"""A config file with a YAML syntax error is refused naming the file, line and column: by the
Snakefile for the embedded config/config.yaml (through `snakemake -n`), and by
`depthbench validate` for any file (Snakemake reads a --configfile itself, before the Snakefile)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from depthbench.commands.cli import main
from tests.conftest import REPO

BROKEN = "name: x\ntrain:\n  seq_len: [32\n  lr: 3\n"  # the flow sequence is not closed: line 4, column 5


@pytest.mark.slow
def test_snakemake_dry_run_names_the_file_line_and_column_of_a_yaml_error_in_the_embedded_config(
    tmp_path,
):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(BROKEN)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--cores",
            "1",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "DepthBench config error" in out
    assert "config/config.yaml: line 4, column 5: YAML syntax error" in out


def test_validate_names_the_file_line_and_column_of_a_yaml_error(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    assert main(["validate", str(path)]) not in (0, None)
    assert f"{path}: line 4, column 5: YAML syntax error" in capsys.readouterr().err
