"""Snakemake entry: build the Parquet tables from run outputs."""

import sys

from depthbench.data.shards import unigram_floor
from depthbench.pretrained.tables import pretrained_run_rows, with_pretrained
from depthbench.analysis.tables import (
    best_learning_rates,
    curve_rows,
    dynamics_rows,
    run_rows,
    write_parquet,
)
from pathlib import Path
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
# each metrics file's run, from its path results/runs/{run_id}/metrics.jsonl
run_ids = [Path(path).parent.name for path in snakemake.input.metrics]  # noqa: F821
floor = unigram_floor(Path(snakemake.input.data).parent)  # noqa: F821
runs = run_rows(
    snakemake.input.summaries,
    floor,
    snakemake.params.experiment,
    snakemake.params.budget_params,  # noqa: F821
    expected=snakemake.params.spec_hashes,
    learned_margin=snakemake.params.learned_margin,
)  # noqa: F821
runs = with_pretrained(
    runs, pretrained_run_rows(snakemake.input.pretrained, snakemake.params.experiment)
)  # noqa: F821
write_parquet(runs, snakemake.output.runs)  # noqa: F821
write_parquet(curve_rows(run_ids, snakemake.input.metrics), snakemake.output.curves)  # noqa: F821
write_parquet(best_learning_rates(runs, snakemake.params.sweep_seeds), snakemake.output.best_lr)  # noqa: F821
write_parquet(dynamics_rows(run_ids, snakemake.input.metrics), snakemake.output.dynamics)  # noqa: F821
print(runs[["run_id", "status", "final_val_loss"]].to_string(), file=sys.stderr)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
