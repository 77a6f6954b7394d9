"""Snakemake entry: merge the per-run removal files into results/tables/removal.parquet and
results/tables/effective_depth.parquet."""

import sys

import pandas as pd

from depthbench.launch.process import exit_without_teardown
from depthbench.analysis.stage_tables import removal_tables
from depthbench.analysis.tables import write_parquet

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
runs = pd.read_parquet(snakemake.input.runs)  # noqa: F821
best = pd.read_parquet(snakemake.input.best_lr)  # noqa: F821
removal, depth = removal_tables(snakemake.input.removal, runs, best, snakemake.params.tolerance)  # noqa: F821
write_parquet(removal, snakemake.output.removal)  # noqa: F821
write_parquet(depth, snakemake.output.effective_depth)  # noqa: F821
print(
    f"{len(removal)} removal rows, {len(depth)} effective depths "
    f"from {removal['run_id'].nunique()} runs",
    file=sys.stderr,
)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
