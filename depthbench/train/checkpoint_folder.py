"""A checkpoint folder on disk: its layout, its atomic completion and its verification.

A checkpoint is the folder `step_NNNNNNNN/` in the run's work folder (never a Snakemake output,
which would be deleted when a job fails):

- `__<rank>_0.distcp`: each rank's own tensors (FSDP2 shards as shards; no rank gathers the full
  state), and DCP's `.metadata` (written by rank 0), see depthbench.train.dcp_io;
- `rank_<r>.safetensors`: that rank's own tensors outside the model (RNG states), and
  `rank_<r>.sha256`: the sha256 of each file rank r wrote, computed by rank r;
- `state.json`: the non-tensor state (run id, step, ranks, the caller's `meta`: schedule, data
  position, optimizer hyperparameters...) and the sha256 of every file; `state.json.sha256` its
  own checksum (sha256sum format).

Completion is atomic: everything is written into `step_NNNNNNNN.tmp/`; rank 0, once DCP has
gathered every rank's write results (so every part and listing exists), writes `state.json`,
then its checksum, then renames the folder (`complete_checkpoint`). A kill at any moment leaves
the previous checkpoint in use and a `.tmp` folder that the next save removes (`remove_strays`).
A checkpoint counts only when its `state.json.sha256` matches and every listed file matches its
sha256 (`verify_checkpoint`; `agreed_reason` adds the check of the tensor data against DCP's
metadata and gives every rank the same verdict), and its manifest names this format, run and step
(`check_identity`).

Saving and loading through DCP: depthbench.train.checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from depthbench.util.errors import CheckpointError
from depthbench.util.io import atomic_write_json
from depthbench.train import listing

FORMAT = "depthbench-dcp-1"
MANIFEST = "state.json"
CHECKSUM_SUFFIX = ".sha256"
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}"


def checksum_path(path: str | os.PathLike) -> Path:
    """The checksum of a checkpoint's manifest: written last, a checkpoint counts only with it."""
    return Path(path) / (MANIFEST + CHECKSUM_SUFFIX)


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every completed (renamed) checkpoint folder, oldest first (verified or not: see
    `verify_checkpoint`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        (int(m.group(1)), folder / n)
        for n in os.listdir(folder)
        if (m := _NAME.match(n)) and (folder / n).is_dir()
    )


def verify_checkpoint(path: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> str | None:
    """None when the checkpoint at `path` is complete and intact, else the reason it is not.
    `share` = (i, n) checks only every n-th listed file from the i-th (ranks split the reading)."""
    path = Path(path)
    side = checksum_path(path)
    if not side.is_file():
        return (
            f"no checksum file {side.name} "
            "(the write was interrupted, or it was not written by DepthBench)"
        )
    try:
        recorded = listing.read_listing(side)
    except ValueError:
        recorded = {}
    if set(recorded) != {MANIFEST}:
        return f"checksum file {side.name} is malformed (expected '<sha256>  {MANIFEST}')"
    actual = listing.file_sha256(path / MANIFEST)
    if actual != recorded[MANIFEST]:
        return (
            f"{MANIFEST}: sha256 {actual[:12]}... does not match the recorded "
            f"{recorded[MANIFEST][:12]}... (corrupt)"
        )
    files = json.loads((path / MANIFEST).read_text()).get("files", {})
    for name in sorted(files)[share[0] :: share[1]]:
        if not (path / name).is_file():
            return f"file {name} is missing"
        actual = listing.file_sha256(path / name)
        if actual != files[name]:
            return (
                f"file {name}: sha256 {actual[:12]}... does not match the recorded "
                f"{files[name][:12]}... (the file is corrupt)"
            )
    return None


def agreed_reason(path: Path, rank: int, world_size: int, group=None) -> str | None:
    """Why the checkpoint at `path` is unusable, or None: `verify_checkpoint`, DCP's metadata
    read without executing code and every tensor's data checked against it
    (dcp_io.check_tensor_data), the files and tensors split among the `world_size` ranks of
    `group` (None: one process), the verdict the same on all. Nothing is copied into the model
    before this passes."""
    from depthbench.train import dcp_io

    share = (rank, world_size)
    reason = verify_checkpoint(path, share)
    if reason is None:
        try:
            reason = dcp_io.check_tensor_data(path, dcp_io.read_metadata(path), share)
        except ValueError as exc:
            reason = str(exc)
    if group is None:
        return reason
    import torch
    import torch.distributed as dist

    bad = torch.tensor([int(reason is not None)])
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if reason is not None:
        print(f"rank {rank}: checkpoint {path}: {reason}", file=sys.stderr)
    return (
        (reason or "a file failed verification on another rank (see its log)")
        if bad.item()
        else None
    )


def complete_checkpoint(
    folder: Path, tmp: Path, final: Path, manifest: dict, world_size: int, keep: int
) -> None:
    """On rank 0, once every rank's files and listing exist: manifest, checksum, rename, then
    prune `folder` to its newest `keep` checkpoints."""
    files: dict[str, str] = {}
    for r in range(world_size):
        files.update(listing.read_listing(tmp / listing.rank_listing(r)))
    files[listing.METADATA] = listing.file_sha256(tmp / listing.METADATA)
    atomic_write_json(tmp / MANIFEST, {**manifest, "files": files})
    # last: the checkpoint counts from here
    listing.write_listing(tmp, checksum_path(tmp).name, [MANIFEST])
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (a resume from an older checkpoint)
        trash = final.with_name(f".{final.name}.replaced.tmp")
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    for _, old in list_checkpoints(folder)[:-keep]:
        checksum_path(old).unlink(missing_ok=True)  # first: a half-deleted folder never counts
        shutil.rmtree(old, ignore_errors=True)


def remove_strays(folder: Path) -> None:
    """Folders left by a write killed before its rename (no save is in flight: `wait` ran)."""
    for stray in [*folder.glob("step_*.tmp"), *folder.glob(".step_*.tmp")]:
        shutil.rmtree(stray, ignore_errors=True) if stray.is_dir() else stray.unlink(
            missing_ok=True
        )


def check_identity(path: Path, manifest: dict, run_id: str, step: int) -> None:
    """An intact checkpoint's manifest names this format, `run_id` and the step of its folder."""
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r}, this version reads {FORMAT!r}"
        )
    if manifest.get("run_id") != run_id:
        raise CheckpointError(
            f"{path} belongs to run {manifest.get('run_id')!r}, not {run_id!r}; move it away"
        )
    if manifest.get("step") != step:
        raise CheckpointError(
            f"{path}: folder name says step {step}, content says {manifest.get('step')}"
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
