"""`depthbench status [CONFIG]`: where each run of the grid stands, and what the next `snakemake`
run would do, computed from the files under results/ without running anything.

Runs: the grid's, the extensions past the edges of cells' LR sweeps that the sweep's rounds
(results/tables/lr_sweep/round{k}.parquet, lr_sweep.max_extensions) have called for, and with
`seeds_at_best_lr` the replicates that its last round calls for once it is current; until then
the plan counts the extensions still possible (at most) and says that the replicates follow.
Per run: `trained` (summary status ok), `at-floor` (trained, but its final
validation loss is not analysis.learned_margin nats below the unigram floor: it did not learn, and
the claims leave out its cell when it is the cell's best run), `diverged`, `probed` and `scored`
(its probe / NLL Parquet exists and is current; with `probes.runs` / `nll.runs: best_lr` only the
runs at their cell's best LR in results/tables are evaluated, `-` for the others and `later` while
that table is missing or older than a summary), `missing` (no summary; `partial` when a checkpoint
exists, so training resumes from it), `stale` (an output exists but is older than one of its
inputs) and `incomplete` (Snakemake's marker under .snakemake/incomplete/ says its train job was
interrupted: Snakemake refuses to go on without `--rerun-incomplete`, which retrains it). A summary
that is unreadable, copied from another run or edited (see depthbench.train.runcheck.read_summary)
is `invalid`: Snakemake would not retrain it (nothing it tracks changed) and the tables would
refuse it, so the fix is `snakemake --forcerun` on its summary. Final weights that do not hash to
the digest their summary records are `corrupt` (depthbench.train.runcheck): every stage refuses
them, and `snakemake --forcerun` on them retrains the run from its last checkpoint; so are weights
whose summary records no digest (`invalid`: nothing vouches for them). Checking the digests reads
every run's weights.

The plan mirrors the workflow's rules (train -> probe, nll -> tables and figures) with
Snakemake's mtime trigger as the pinned Snakemake (9) applies it by default: an input newer than
the job's oldest output redoes the job unless the input is at most 1,000,000 bytes
(`--max-checksum-file-size`) and its SHA-256 equals the one Snakemake recorded for it in the
outputs' metadata (.snakemake/metadata/), so a `touch` of such a file redoes nothing. It reads
Snakemake's records but does not call Snakemake, so it cannot see the other triggers (a changed
probe/NLL setting or script, a changed software environment). `snakemake -n` gives the exact
plan; this gives the state of each run in seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from depthbench.commands.sweep_state import best_lr_runs, chosen_extensions, chosen_replicates
from depthbench.commands.sweep_state import last_round, tabled_run_ids
from depthbench.commands.snakemake_records import file_mtime, updated_input
from depthbench.commands.train_state import at_floor, train_state
from depthbench.grid.expand import Experiment
from depthbench.grid.extend import extensions_at_most
from depthbench.spec.run import short_hash

RESULTS = "results"  # the Snakefile's RESULTS folder, relative to the working directory


@dataclass
class RunStatus:
    run_id: str
    # trained | at-floor | diverged | missing | partial | stale | invalid | corrupt | incomplete
    state: str
    # probed, scored: yes | no | stale | later | - (disabled, or not at its cell's best LR)
    probed: str = "-"
    scored: str = "-"
    reasons: list[str] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)  # what the next snakemake run does for it
    state_needs_force: bool = False  # outputs lost after the tables: only --forcerun redoes it


def _nll_sets_path(exp: Experiment, results: Path) -> Path:
    # as in workflow/rules/nll.smk: the sets file is named by the hash of the NLL settings
    settings = {
        k: v
        for k, v in exp.config["nll"].items()
        if k not in ("enabled", "runs", "tokens_per_batch")
    }
    return results / "evals" / exp.tokenizer_id / f"nll_sets_{short_hash(settings)}.parquet"


def _stage_state(
    root: Path, output: Path, inputs: list[Path], retrain: bool
) -> tuple[str, str | None]:
    if not output.exists():
        return "no", None
    if retrain:
        return "stale", f"{output} will be redone after training"
    newer = updated_input(root, [output], inputs)
    return (
        ("stale", f"{output} is older than its input {newer}")
        if newer is not None
        else ("yes", None)
    )


def _older_input(reasons: list[str]) -> bool:
    # stale by an input newer than the summary: Snakemake's mtime trigger redoes it by itself
    return any("is older than its input" in reason for reason in reasons)


def run_statuses(exp: Experiment, results: str | os.PathLike = RESULTS) -> list[RunStatus]:
    results = Path(results)
    meta = results / "data" / exp.data_id / "meta.json"
    sets = _nll_sets_path(exp, results)
    runs = {
        **exp.runs,
        **chosen_extensions(exp, results),
        **(chosen_replicates(exp, results) or {}),
    }
    tabled = tabled_run_ids(results)
    best = best_lr_runs(exp, results, list(runs))
    out = []
    for run_id, spec in runs.items():
        run = results / "runs" / run_id
        state, reasons = train_state(spec, run, results / "work" / run_id, meta)
        why = at_floor(exp, meta, run / "summary.json") if state == "trained" else None
        if why:
            state, reasons = "at-floor", [*reasons, why]
        st = RunStatus(run_id, state, reasons=reasons)
        retrain = state in (
            "missing",
            "partial",
            "stale",
            "incomplete",
            "corrupt",
        )  # corrupt: once its advice is taken
        lost = state in ("missing", "partial", "stale") and not _older_input(reasons)
        if lost and run_id in tabled:
            # Its outputs went missing after the tables read them: Snakemake reruns a job for a
            # missing output only when a consumer of that output has to run, and none does.
            st.reasons.append(
                "results/tables/runs.parquet already holds this run, so snakemake alone redoes "
                "nothing for it"
            )
            st.jobs.append(
                f"none: `snakemake --forcerun {run / 'summary.json'}` trains it again"
                + (" (from its checkpoint)" if state == "partial" else "")
            )
            st.state_needs_force = True
        elif state == "incomplete":
            st.jobs.append("train (--rerun-incomplete)")
        elif state == "corrupt":
            st.jobs.append(
                f"none: `snakemake --forcerun {run / 'model.safetensors'}` trains it again"
            )
        elif state == "invalid":
            st.jobs.append(f"none: `snakemake --forcerun {run / 'summary.json'}` trains it again")
        elif retrain:
            st.jobs.append("train (resume)" if state == "partial" else "train")
        trained_inputs = [run / "summary.json", run / "model.safetensors"]
        for stage, attr, job, output, extra in (
            ("probes", "probed", "probe", results / "probes" / f"{run_id}.parquet", [meta]),
            ("nll", "scored", "nll", results / "nll" / f"{run_id}.parquet", [sets]),
        ):
            if not exp.config[stage]["enabled"]:
                continue
            if exp.config[stage]["runs"] == "best_lr":
                if best is None:
                    setattr(st, attr, "later")
                    st.reasons.append(
                        f"{job}: chosen once every run has trained (its cell's best LR)"
                    )
                    continue
                if run_id not in best:
                    continue
            value, reason = _stage_state(results.parent, output, trained_inputs + extra, retrain)
            setattr(st, attr, value)
            if reason:
                st.reasons.append(reason)
            # corrupt: its stages fail until it is trained again; forced: they follow the force
            if value != "yes" and state != "corrupt" and not st.state_needs_force:
                st.jobs.append(job)
        out.append(st)
    return out


def plan(
    exp: Experiment, statuses: list[RunStatus], results: str | os.PathLike = RESULTS
) -> list[str]:
    """What the next `snakemake` run would do, one line per stage."""
    results = Path(results)
    lines = []
    if not (results / "data" / exp.data_id / "meta.json").exists():
        lines.append(f"tokenize: build results/data/{exp.data_id} (tokenizer and shards) first")
    if exp.extensions and last_round(exp, results) is None:
        at_most = extensions_at_most(exp) - len(chosen_extensions(exp, results))
        lines.append(
            f"train, later: up to {at_most} run(s) past the edges of cells' LR sweeps "
            f"(lr_sweep.max_extensions {exp.config['lr_sweep']['max_extensions']}), as many "
            "as the sweep's rounds call for"
        )
    if chosen_replicates(exp, results) is None:
        n = exp.config["seeds_at_best_lr"]
        lines.append(
            f"train, later: the replicates that give each cell's best LR {n} seeds "
            "(seeds_at_best_lr), once every run of the LR sweep has trained"
        )
    for job in ("train", "train (resume)", "probe", "nll"):
        ids = [s.run_id for s in statuses if job in s.jobs]
        if ids:
            lines.append(f"{job}: {len(ids)} run{'s' * (len(ids) != 1)}")
    invalid = [s.run_id for s in statuses if s.state == "invalid"]
    if invalid:
        lines.append(
            f"tables: fail on {len(invalid)} "
            f"invalid summar{'ies' if len(invalid) != 1 else 'y'} (see above)"
        )
    corrupt = [s.run_id for s in statuses if s.state == "corrupt"]
    if corrupt:
        lines.append(
            f"probe, nll, export: fail on {len(corrupt)} run{'s' * (len(corrupt) != 1)} "
            "with corrupt weights (see above)"
        )
    forced = [s.run_id for s in statuses if s.state_needs_force]
    if forced:
        lines.append(
            f"not redone without --forcerun: {len(forced)} run{'s' * (len(forced) != 1)} whose "
            "outputs are missing but already in the tables (see above)"
        )
    incomplete = [s.run_id for s in statuses if s.state == "incomplete"]
    if incomplete:
        lines.append(
            f"refused without --rerun-incomplete: {len(incomplete)} "
            f"run{'s' * (len(incomplete) != 1)} (see above)"
        )
    # the aggregate outputs every grid has (the figures' own names depend on the grid)
    finals = [
        results / "tables" / f"{name}.parquet"
        for name in ("runs", "curves", "best_lr", "dynamics", "cost")
    ]
    finals += [results / "figures" / "headline.png"]
    newest = max(
        (
            t
            for s in statuses
            for t in [file_mtime(results / "runs" / s.run_id / "summary.json")]
            if t
        ),
        default=None,
    )
    oldest = min((file_mtime(p) or 0.0 for p in finals), default=0.0)
    if lines or not oldest or (newest is not None and newest > oldest):
        lines.append("tables, figures and report: rebuilt")
    return lines or ["nothing to do: every output is up to date"]


def format_status(exp: Experiment, results: str | os.PathLike = RESULTS) -> str:
    statuses = run_statuses(exp, results)
    width = max([len(s.run_id) for s in statuses] + [6])
    lines = [f"{'run':<{width}}  {'train':<10}  {'probed':<6}  {'scored':<6}  next"]
    for s in statuses:
        lines.append(
            f"{s.run_id:<{width}}  {s.state:<10}  {s.probed:<6}  {s.scored:<6}  "
            f"{', '.join(s.jobs) or '-'}"
        )
        lines += [f"{'':<{width}}  ^ {reason}" for reason in s.reasons]
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s.state] = counts.get(s.state, 0) + 1
    lines.append("")
    lines.append(
        f"{len(statuses)} runs: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    )
    lines.append("next snakemake run (from files; `snakemake -n` for the exact plan):")
    lines += [f"  {line}" for line in plan(exp, statuses, results)]
    return "\n".join(lines)
