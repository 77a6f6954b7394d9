"""Snakemake entry: one round of the LR sweep, the best learning rate per cell, the extensions it
calls for past an edge and, once a cell is settled, its replicates (`lr_sweep.max_extensions`,
`seeds_at_best_lr`; logic in depthbench.analysis.lr_rounds)."""

import sys
from pathlib import Path

from depthbench.analysis.lr_rounds import sweep_round
from depthbench.analysis.tables import run_rows, write_parquet
from depthbench.data.shards import unigram_floor
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
runs = run_rows(
    snakemake.input.summaries,  # noqa: F821
    unigram_floor(Path(snakemake.input.data).parent),  # noqa: F821
    snakemake.params.experiment,  # noqa: F821
    snakemake.params.budget_params,  # noqa: F821
    expected=snakemake.params.spec_hashes,  # noqa: F821
    learned_margin=snakemake.params.learned_margin,  # noqa: F821
)
table = sweep_round(
    runs,
    snakemake.params.ladders,  # noqa: F821
    int(snakemake.wildcards.round),  # noqa: F821
    snakemake.params.max_extensions,  # noqa: F821
    dict(snakemake.params.replicates),  # noqa: F821
)
write_parquet(table, snakemake.output.sweep)  # noqa: F821
shown = ["arch", "n_layer", "best_lr", "final_val_loss", "lr_at_edge", "next_run_ids"]
print(table[shown].to_string(), file=sys.stderr)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    exit_without_teardown()
