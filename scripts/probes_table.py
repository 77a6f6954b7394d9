"""Snakemake entry: merge the per-run probe files into results/tables/probes.parquet, and the
logit lens's rows into results/tables/logit_lens.parquet."""

import sys

import pandas as pd

from depthbench.analysis.stage_tables import lens_table, probe_rows
from depthbench.analysis.tables import write_parquet
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
runs = pd.read_parquet(snakemake.input.runs)  # noqa: F821
best = pd.read_parquet(snakemake.input.best_lr)  # noqa: F821
table = probe_rows(snakemake.input.probes, runs, best)  # noqa: F821
write_parquet(table, snakemake.output.probes)  # noqa: F821
write_parquet(lens_table(table), snakemake.output.lens)  # noqa: F821
print(f"{len(table)} probe rows from {table['run_id'].nunique()} runs", file=sys.stderr)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
