"""A config file with a YAML syntax error is refused naming the file, line and column: by the
Snakefile for the embedded config/config.yaml (through `snakemake -n`), and by
`depthbench validate` and `depthbench run` for any file (Snakemake reads a --configfile itself,
before the Snakefile, and names neither line nor column)."""

from __future__ import annotations


import pytest

from depthbench.commands.cli import main
from depthbench.commands.subcommands import configfiles
from tests.workflow_runs import dry_run_in

# the flow sequence is not closed: line 4, column 5
BROKEN = "name: x\ntrain:\n  seq_len: [32\n  lr: 3\n"


@pytest.mark.slow
def test_snakemake_dry_run_names_the_file_line_and_column_of_a_yaml_error_in_the_embedded_config(
    tmp_path,
):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(BROKEN)
    done = dry_run_in(tmp_path)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "DepthBench config error" in out
    assert "config/config.yaml: line 4, column 5: YAML syntax error" in out


def test_validate_names_the_file_line_and_column_of_a_yaml_error(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    assert main(["validate", str(path)]) not in (0, None)
    assert f"{path}: line 4, column 5: YAML syntax error" in capsys.readouterr().err


def test_run_names_the_file_line_and_column_of_a_yaml_error_before_snakemake(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("name: x\n")
    bad = tmp_path / "broken.yaml"
    bad.write_text(BROKEN)
    assert main(["run", "-n", "--cores", "1", "--configfile", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: line 4, column 5: YAML syntax error" in err and str(good) not in err


@pytest.mark.slow
def test_run_passes_its_arguments_to_snakemake(capfd):
    assert main(["run", "--version"]) == 0
    import snakemake

    assert capfd.readouterr().out.strip() == snakemake.__version__


def test_configfiles_are_found_in_every_spelling():
    args = ["--cores", "2", "--configfile", "a.yaml", "b.yaml", "-n", "--configfile=c.yaml",
            "--configfiles", "d.yaml", "--profile", "slurm"]  # fmt: skip
    assert configfiles(args) == ["a.yaml", "b.yaml", "c.yaml", "d.yaml"]
