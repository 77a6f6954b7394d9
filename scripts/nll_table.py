"""Snakemake entry: merge the runs' NLL rows into results/tables/nll.parquet."""

import sys

import pandas as pd

from depthbench.analysis.stage_tables import nll_rows
from depthbench.analysis.tables import write_parquet
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
runs, best = pd.read_parquet(snakemake.input.runs), pd.read_parquet(snakemake.input.best_lr)  # noqa: F821
table = nll_rows(snakemake.input.nll, runs, best)  # noqa: F821
write_parquet(table, snakemake.output[0])  # noqa: F821
print(
    table[table["level"] == "domain"][
        ["run_id", "domain", "nats_per_token", "bits_per_byte"]
    ].to_string(),
    file=sys.stderr,
)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
