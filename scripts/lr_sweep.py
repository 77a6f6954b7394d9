"""Snakemake entry: the LR sweep's best learning rate per cell and the replicates it calls for
(`seeds_at_best_lr`; logic in depthbench.analysis.tables)."""

import sys
from pathlib import Path

from depthbench.analysis.tables import best_learning_rates, best_lr_run_ids, replicate_run_ids
from depthbench.analysis.tables import run_rows
from depthbench.analysis.tables import write_parquet
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
best = best_learning_rates(runs)
replicates = dict(snakemake.params.replicates)  # noqa: F821
keys = ["arch", "n_layer", "d_model", "knobs"]
# the sweep's finished runs at each cell's best LR: with the replicates, what best_lr evaluation
# probes and scores (evaluated_runs, common.smk), known here before the replicates train
best["sweep_run_ids"] = [
    best_lr_run_ids(runs, best.iloc[[i]], runs["run_id"]) for i in range(len(best))
]
best["replicate_run_ids"] = [
    replicate_run_ids(runs, best.iloc[[i]], replicates) for i in range(len(best))
]
write_parquet(best, snakemake.output.sweep)  # noqa: F821
print(best[keys + ["best_lr", "final_val_loss", "replicate_run_ids"]].to_string(), file=sys.stderr)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    exit_without_teardown()
