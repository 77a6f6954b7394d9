"""What results/tables says about the runs, as `depthbench status` needs it: which runs the tables
already hold, and which the workflow's checkpoints have chosen: the extensions past the edges of
the LR sweep and the replicates `seeds_at_best_lr` adds at each cell's best LR (the lr_sweep
checkpoint's rounds, results/tables/lr_sweep/round{k}.parquet) and the runs `probes.runs` /
`nll.runs: best_lr` evaluate (the tables checkpoint's best_lr table). Each is None while a table
it needs is missing or older than a run it reads: the workflow would choose again."""

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


def _rounds(exp: Experiment, results: Path) -> list[Path]:
    """The LR sweep's current rounds' tables in order, up to its last one or the first that is
    missing or older than a summary it read."""
    from depthbench.analysis.lr_rounds import calls, round_path
    from depthbench.analysis.tables import lr_sweep_run_ids

    folder, out = results / "tables" / "lr_sweep", []
    max_extensions = exp.config.get("lr_sweep", {}).get("max_extensions", 0)
    for k in range(max_extensions + 1):
        table = round_path(folder, k)
        read = list(exp.runs) if k == 0 else None
        if table.exists() and read is None:
            read = lr_sweep_run_ids(table, ["tried_run_ids"])
        if not _current(
            table, [results / "runs" / run_id / "summary.json" for run_id in read or []]
        ):
            return out
        out.append(table)
        if not calls(table):
            break
    return out


def last_round(exp: Experiment, results: Path) -> Path | None:
    """The LR sweep's last round's table, or None while the sweep has rounds to go (or its
    tables are missing or out of date)."""
    from depthbench.analysis.lr_rounds import calls

    rounds = _rounds(exp, results)
    max_extensions = exp.config.get("lr_sweep", {}).get("max_extensions", 0)
    done = rounds and (len(rounds) == max_extensions + 1 or not calls(rounds[-1]))
    return rounds[-1] if done else None


def chosen_extensions(exp: Experiment, results: Path) -> dict[str, RunSpec]:
    """{run id: spec} of the extensions the LR sweep's current rounds have called for."""
    from depthbench.analysis.tables import lr_sweep_run_ids

    called = set()
    for table in _rounds(exp, results):
        called |= lr_sweep_run_ids(table, ["tried_run_ids", "next_run_ids"])
    return {run_id: spec for run_id, spec in exp.extensions.items() if run_id in called}


def chosen_replicates(exp: Experiment, results: Path) -> dict[str, RunSpec] | None:
    """{run id: spec} of the replicates that the LR sweep's last round calls for, in the grid's
    order; {} when the grid adds none; None while the sweep has rounds to go."""
    if not exp.replicates:
        return {}
    table = last_round(exp, results)
    if table is None:
        return None
    from depthbench.analysis.tables import lr_sweep_run_ids

    chosen = lr_sweep_run_ids(table, ["replicate_run_ids"])
    return {run_id: spec for run_id, spec in exp.candidate_runs.items() if run_id in chosen}


def best_lr_runs(exp: Experiment, results: Path, run_ids: list[str]) -> set[str] | None:
    """The runs at their cell's best LR per results/tables, or None while the tables are missing
    or older than the summary of one of `run_ids` (the runs the tables merge), or one has none.
    Where the LR sweep has rounds its last round names them (the sweep's runs at the best LR and
    the replicates), as for the workflow, which evaluates them beside the replicates' training."""
    if exp.replicates or exp.extensions:
        table = last_round(exp, results)
        if table is None:
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
