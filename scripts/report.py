"""Snakemake entry: results/report.html from the figures and the claims, best-LR and runs tables."""

import sys
from pathlib import Path

from depthbench.analysis.readers import read_tables
from depthbench.analysis.report import build_report
from depthbench.util.io import atomic_write_text
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
tables = read_tables(
    {
        k: snakemake.input[k]
        for k in ("claims", "best_lr", "runs", "probes", "effective_depth")  # noqa: F821
        if k in snakemake.input.keys()
    }
)  # noqa: F821
figure_dir = (
    Path(snakemake.input.figures[0]).parent if snakemake.input.figures else Path("results/figures")
)  # noqa: F821
atomic_write_text(
    snakemake.output[0],
    build_report(snakemake.params.names, figure_dir, tables, snakemake.params.settings),
)  # noqa: F821

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
