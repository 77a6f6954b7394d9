"""What results/tables says about the runs, as `depthbench status` needs it: which runs the tables
already hold, and which the workflow's checkpoints have chosen: the replicates
`seeds_at_best_lr` adds at each cell's best LR (the lr_sweep checkpoint's table) and the runs
`probes.runs` / `nll.runs: best_lr` evaluate (the tables checkpoint's best_lr table). Each is
None while its table is missing or older than a run it reads: the workflow would choose again."""

from __future__ import annotations

from pathlib import Path

from depthbench.commands.snakemake_records import newer_input
from depthbench.grid.expand import Experiment
from depthbench.spec.run import RunSpec


def _current(table: Path, summaries: list[Path]) -> bool:
    return (
        table.exists()
        and all(path.exists() for path in summaries)
        and newer_input(table, summaries) is None
    )


def chosen_replicates(exp: Experiment, results: Path) -> dict[str, RunSpec] | None:
    """{run id: spec} of the replicates that results/tables/lr_sweep.parquet calls for, in the
    grid's order; {} when the grid adds none; None while the LR sweep's table is missing or
    older than a sweep run's summary."""
    if not exp.replicates:
        return {}
    table = results / "tables" / "lr_sweep.parquet"
    if not _current(table, [results / "runs" / run_id / "summary.json" for run_id in exp.runs]):
        return None
    from depthbench.analysis.tables import lr_sweep_run_ids

    chosen = lr_sweep_run_ids(table, ["replicate_run_ids"])
    return {run_id: spec for run_id, spec in exp.candidate_runs.items() if run_id in chosen}


def best_lr_runs(exp: Experiment, results: Path, run_ids: list[str]) -> set[str] | None:
    """The runs at their cell's best LR per results/tables, or None while the tables are missing
    or older than the summary of one of `run_ids` (the runs the tables merge), or one has none.
    With `seeds_at_best_lr` the LR sweep's table names them (the sweep's runs at the best LR and
    the replicates), as for the workflow, which evaluates them beside the replicates' training."""
    if exp.replicates:
        table = results / "tables" / "lr_sweep.parquet"
        sweep = [results / "runs" / run_id / "summary.json" for run_id in exp.runs]
        if not _current(table, sweep):
            return None
        from depthbench.analysis.tables import lr_sweep_run_ids

        return lr_sweep_run_ids(table, ["sweep_run_ids", "replicate_run_ids"])
    runs, best = results / "tables" / "runs.parquet", results / "tables" / "best_lr.parquet"
    summaries = [results / "runs" / run_id / "summary.json" for run_id in run_ids]
    if not (runs.exists() and _current(best, summaries)):
        return None
    import pandas as pd

    from depthbench.analysis.tables import best_lr_run_ids

    return set(best_lr_run_ids(pd.read_parquet(runs), pd.read_parquet(best), exp.candidate_runs))


def tabled_run_ids(results: Path) -> set[str]:
    """The run ids results/tables/runs.parquet holds (none while it is missing or unreadable)."""
    table = results / "tables" / "runs.parquet"
    if not table.exists():
        return set()
    import pandas as pd

    try:
        return set(pd.read_parquet(table, columns=["run_id"])["run_id"])
    except (OSError, ValueError, KeyError):
        return set()
