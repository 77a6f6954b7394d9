"""Snakemake entry: per-run cost accounting into results/tables/cost.parquet."""

import sys

import pandas as pd

from depthbench.analysis.stage_tables import cost_rows
from depthbench.analysis.tables import write_parquet
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
runs, best = pd.read_parquet(snakemake.input.runs), pd.read_parquet(snakemake.input.best_lr)  # noqa: F821
table = cost_rows(
    snakemake.input.summaries,
    runs,
    best,
    expected=snakemake.params.spec_hashes,  # noqa: F821
    pretrained_paths=snakemake.input.pretrained,
    seq_len=snakemake.params.seq_len,
)  # noqa: F821
write_parquet(table, snakemake.output[0])  # noqa: F821
shown = [
    "run_id",
    "params_total",
    "train_flops_per_token",
    "prefill_flops_4096",
    "kv_cache_bytes_per_token",
]
print(table[shown].to_string() if not table.empty else "no runs", file=sys.stderr)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
