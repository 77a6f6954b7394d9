"""`depthbench rename-runs [CONFIG] [--results results] [--dry-run]`: give results trained under
the ids of whole-section option hashing the ids of today.

A run id hashes the options its architecture declares (depthbench.grid.ids.run_id_of). DepthBench
versions before that hashed the whole `model.arch_options` section into every run id, so in the
default config attnres_block's `n_blocks: 4` was part of every architecture's id. Those results
are still valid (a pre_ln model never read n_blocks); only their ids differ. This command finds,
for each run of CONFIG, the folder of its whole-section id
(depthbench.grid.config.shared_options_ids) and moves everything named by the run id to the
current one:

    runs/<id>/                 summary.json (run_id, spec, spec_hash rewritten), weights, metrics,
                               snapshots (their metadata's run_id rewritten)
    work/<id>/                 checkpoints (each manifest's run_id and its checksum rewritten),
                               training snapshots, submitit files
    probes/<id>.parquet, nll/<id>.parquet                (the run_id column rewritten)
    logs/{train,probe,nll}/<id>.log, benchmarks/{train,probe,nll}/<id>.tsv

Rewritten files keep their modification times, so that Snakemake's mtime trigger sees the
outputs as they were and reruns nothing; Snakemake keeps no record for the new paths, so its
params trigger has nothing to compare and reruns nothing either.

Safety: a summary whose spec is not the grid's run under its old id is left alone (reported as
stale: it was trained for another config). Before anything moves, every source and target is
checked: a target that already exists while its source does too is a conflict, and any conflict
refuses the whole rename with nothing changed. Each file is rewritten atomically and each path
moved with one rename; the run folder moves last, so a rename stopped half way is finished by
running the command again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from depthbench.util.errors import DataError
from depthbench.util.io import atomic_write, atomic_write_json

# Every place a grid run's id is a path component under the results folder (workflow/rules:
# train.smk, probes.smk, nll.smk). The run folder is first here and moved last.
RUN_PATHS = (
    "runs/{}",
    "work/{}",
    "probes/{}.parquet",
    "nll/{}.parquet",
    "logs/train/{}.log",
    "logs/probe/{}.log",
    "logs/nll/{}.log",
    "benchmarks/train/{}.tsv",
    "benchmarks/probe/{}.tsv",
    "benchmarks/nll/{}.tsv",
)


@dataclass
class Rename:
    old: str
    new: str
    moves: list[tuple[Path, Path]] = field(
        default_factory=list
    )  # (source, target), run folder first


@dataclass
class RenamePlan:
    renames: list[Rename] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)


def plan_renames(exp, results: str | os.PathLike = "results") -> RenamePlan:
    """What `rename_runs` would move for the grid `exp` (depthbench.grid.expand.Experiment)."""
    from depthbench.grid.config import shared_options_ids

    results = Path(results)
    plan = RenamePlan()
    for new, old in shared_options_ids(exp).items():
        if old == new:
            continue
        moves, clash = [], []
        for pattern in RUN_PATHS:
            src, dst = results / pattern.format(old), results / pattern.format(new)
            if src.exists() or src.is_symlink():
                (clash if dst.exists() or dst.is_symlink() else moves).append((src, dst))
        if clash:
            plan.conflicts += [f"{dst} exists, and so does {src}" for src, dst in clash]
            continue
        if not moves:
            continue
        run_dir = results / "runs" / old
        if run_dir.is_dir():
            why = _not_this_run(
                run_dir / "summary.json", exp.runs[new], _legacy_spec(exp, exp.runs[new], old)
            )
            if why:
                plan.stale.append(f"{run_dir}: {why}; left as it is")
                continue
        plan.renames.append(Rename(old, new, moves))
    return plan


def _legacy_spec(exp, spec, old: str):
    whole = spec.knobs.get(
        "model.arch_options", exp.config.get("model", {}).get("arch_options", {})
    )
    return replace(spec, run_id=old, model=replace(spec.model, arch_options=dict(whole)))


def _not_this_run(summary_path: Path, spec, legacy) -> str | None:
    """None when the summary (if any) is the grid's run: `legacy` (its spec under the old id, the
    whole section in its model config) or `spec` (already rewritten by an interrupted rename)."""
    from depthbench.spec.run import RunSpec

    if not summary_path.is_file():
        return None  # an unfinished run: its checkpoints move with it and resume under the new id
    try:
        s = json.loads(summary_path.read_text(encoding="utf-8"))
        recorded = RunSpec.from_dict(s["spec"]).spec_hash()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable summary.json ({exc})"
    if s.get("run_id") not in (legacy.run_id, spec.run_id):
        return f"summary.json belongs to run {s.get('run_id')!r}"
    if recorded not in (legacy.spec_hash(), spec.spec_hash()):
        return "its summary.json is of another spec (trained for another config: stale)"
    return None


def format_plan(plan: RenamePlan, dry_run: bool) -> str:
    lines = []
    verb = "would move" if dry_run else "moved"
    for r in plan.renames:
        lines.append(f"{r.old} -> {r.new}")
        lines += [f"    {verb} {src} -> {dst}" for src, dst in r.moves]
    lines += [f"stale: {line}" for line in plan.stale]
    lines += [f"conflict: {line}" for line in plan.conflicts]
    n_files = sum(len(r.moves) for r in plan.renames)
    lines.append(
        f"{len(plan.renames)} runs ({n_files} paths) {verb}, {len(plan.stale)} stale left alone, "
        f"{len(plan.conflicts)} conflicts" + (" (dry run: nothing changed)" if dry_run else "")
    )
    return "\n".join(lines)


def rename_runs(exp, results: str | os.PathLike = "results", dry_run: bool = False) -> RenamePlan:
    """Plan, refuse on any conflict (DataError listing them, nothing changed), else rewrite the
    run ids inside the files and move every path (see the module docstring)."""
    plan = plan_renames(exp, results)
    if plan.conflicts:
        raise DataError(
            "depthbench rename-runs: refused, nothing changed; each target below exists beside its "
            "source (move one of them away):\n  " + "\n  ".join(plan.conflicts)
        )
    if dry_run:
        return plan
    for r in plan.renames:
        spec = exp.runs[r.new]
        for src, _ in r.moves:
            _rewrite_ids(src, r.old, r.new, spec)
        for src, dst in reversed(r.moves):  # the run folder (first) last
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
    return plan


def _keeping_mtime(path: Path, write) -> None:
    st = path.stat()
    parent = path.parent.stat()
    write()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(path.parent, ns=(parent.st_atime_ns, parent.st_mtime_ns))


def _rewrite_ids(src: Path, old: str, new: str, spec) -> None:
    if src.name == old and src.parent.name == "runs":
        summary = src / "summary.json"
        if summary.is_file():
            _keeping_mtime(summary, lambda: _rewrite_summary(summary, new, spec))
        _rewrite_snapshots(src / "snapshots", new)
    elif src.name == old and src.parent.name == "work":
        _rewrite_checkpoints(src, new)
        _rewrite_snapshots(src / "snapshots", new)
    elif src.suffix == ".parquet":
        _keeping_mtime(src, lambda: _rewrite_parquet(src, new))


def _rewrite_summary(path: Path, new: str, spec) -> None:
    from depthbench.spec.run import RunSpec

    s = json.loads(path.read_text(encoding="utf-8"))
    s["run_id"] = new
    s["spec"]["run_id"] = new
    s["spec"]["model"]["arch_options"] = dict(spec.model.arch_options)
    s["spec_hash"] = RunSpec.from_dict(s["spec"]).spec_hash()
    if s["spec_hash"] != spec.spec_hash():
        raise DataError(
            f"{path}: its spec under {new} hashes to {s['spec_hash']}, "
            f"the grid's to {spec.spec_hash()}"
        )
    atomic_write_json(path, s)


def _rewrite_parquet(path: Path, new: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if "run_id" not in table.column_names:
        return
    i = table.column_names.index("run_id")
    column = pa.array([new] * table.num_rows, type=table.schema.field(i).type)
    atomic_write(
        path, lambda tmp: pq.write_table(table.set_column(i, table.schema.field(i), column), tmp)
    )


def _rewrite_checkpoints(work: Path, new: str) -> None:
    from depthbench.train import listing
    from depthbench.train.checkpoint_folder import MANIFEST, checksum_path, list_checkpoints

    for _, folder in list_checkpoints(work):
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file():
            continue
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("run_id") == new:
            continue
        manifest["run_id"] = new
        atomic_write_json(manifest_path, manifest)
        listing.write_listing(folder, checksum_path(folder).name, [MANIFEST])


def _rewrite_snapshots(folder: Path, new: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from depthbench.train.snapshots import META_KEY
    from depthbench.util.safetensors_file import save_safetensors

    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        meta = json.loads(metadata.get(META_KEY, "{}"))
        if meta.get("run_id") in (None, new):
            continue
        metadata[META_KEY] = json.dumps({**meta, "run_id": new}, sort_keys=True)
        tensors = load_file(str(path))
        _keeping_mtime(
            path, lambda: atomic_write(path, lambda tmp: save_safetensors(tensors, tmp, metadata))
        )
