"""The training state of one run of the grid, read from its files: whether it trained, diverged,
did not learn (at the unigram floor), was interrupted, or has a summary or weights that nothing
vouches for. depthbench.commands.status builds its table and plan on these; its docstring lists
the states and what each one asks of the user.
"""

from __future__ import annotations

from pathlib import Path

from depthbench.commands.snakemake_records import incomplete_outputs, updated_input
from depthbench.grid.expand import Experiment
from depthbench.train.checkpoint_folder import list_checkpoints, verify_checkpoint
from depthbench.util.errors import DataError


def train_state(spec, run: Path, work: Path, meta: Path) -> tuple[str, list[str]]:
    """The train state of one run (see depthbench.commands.status) and why: its summary,
    weights and checkpoints under `run` and `work`, Snakemake's records of its train job, and
    the shards' `meta` its summary depends on."""
    from depthbench.train.runcheck import WEIGHTS, CorruptWeights, verify_weights
    from depthbench.train.runcheck import read_summary

    summary = run / "summary.json"
    root = run.parent.parent.parent  # Snakemake's working directory, which holds results/
    outputs = [summary, run / WEIGHTS, run / "metrics.jsonl"]  # the train rule's
    marked = incomplete_outputs(root, outputs)
    if marked:
        return "incomplete", [
            f"{', '.join(map(str, marked))}: marked incomplete by Snakemake "
            "(its train job was interrupted); "
            "`snakemake --rerun-incomplete` trains the run again (the slurm profile sets it)"
        ]
    if not summary.exists():
        good = [
            s for s, p in list_checkpoints(work / "checkpoints") if verify_checkpoint(p) is None
        ]
        return ("partial", [f"checkpoint at step {good[-1]}"]) if good else ("missing", [])
    try:
        s = read_summary(summary, {spec.run_id: spec.spec_hash()})
    except DataError as exc:  # Snakemake sees nothing to redo here: the tables would fail on it
        return "invalid", [f"{exc}; snakemake would fail at the tables"]
    missing = [name for name in (WEIGHTS, "metrics.jsonl") if not (run / name).exists()]
    if missing:
        return "stale", [f"{', '.join(missing)} missing beside the summary"]
    try:
        verify_weights(run, s)
    except CorruptWeights as exc:
        return "corrupt", [str(exc)]
    except DataError as exc:  # no digest recorded: nothing vouches for the weights
        return "invalid", [str(exc)]
    reasons = []
    newer = updated_input(root, outputs, [meta])
    if newer is not None:
        return "stale", [f"{summary} is older than its input {newer}"]
    return ("trained" if s["status"] == "ok" else "diverged"), reasons


def at_floor(exp: Experiment, meta: Path, summary: Path) -> str | None:
    """Why a trained run did not learn (depthbench.analysis.readers.learned), or None: it did,
    or the shards' meta.json records no unigram floor."""
    import json

    from depthbench.analysis.readers import learned
    from depthbench.spec.schema import with_defaults

    try:
        floor = float(json.loads(meta.read_text())["unigram_val_loss"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    loss = json.loads(summary.read_text())["final_val_loss"]
    margin = with_defaults("analysis", exp.config.get("analysis", {}))["learned_margin"]
    if floor != floor or learned(loss, floor, margin):
        return None
    return (
        f"did not learn: final validation loss {loss:.3f} is not {margin:g} nats below the "
        f"unigram floor {floor:.3f} (analysis.learned_margin); the claims leave out its cell "
        "when it is the cell's best run"
    )
