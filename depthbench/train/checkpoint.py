"""Resumable training checkpoints, sharded with torch.distributed.checkpoint (DCP).

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
then its checksum, then renames the folder. A kill at any moment leaves the previous checkpoint
in use and a `.tmp` folder that the next save removes. A checkpoint counts only when its
`state.json.sha256` matches and every listed file matches its sha256; one that does not is
reported (name and reason) and the previous one is used, as is one whose tensor data is not
the tensors its metadata describes (checked before any of it reaches the model). Nothing on
load runs code: JSON, safetensors, DCP metadata through an allow-list unpickler, tensor data with weights_only=True.

Asynchronous saving (`dcp.async_save`) is used when there is a process group (several ranks):
the state is copied to CPU memory (DCP's staging), then written by a background thread over a
dedicated gloo group, so it never interleaves with training collectives. With one process
`dcp.save` writes synchronously: those are the CPU runs of small models, where a save takes
milliseconds and the staging copy plus a thread would buy nothing. `save(blocking=True)` (the
requeue signal, the end of a stopped run) waits.

Single-file checkpoints of earlier versions (`step_NNNNNNNN.pt`) are not loaded: a folder holding
only such files is refused with a message saying so (a resume would silently restart otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from depthbench.util.errors import CheckpointError
from depthbench.util.io import atomic_write, atomic_write_json
from depthbench.train import (
    listing,
)  # DCP itself (depthbench.train.dcp_io) only where a checkpoint is written or read

FORMAT = "depthbench-dcp-1"
MANIFEST = "state.json"
CHECKSUM_SUFFIX = ".sha256"
_NAME = re.compile(r"^step_(\d{8})$")
_LEGACY = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}"


def checksum_path(path: str | os.PathLike) -> Path:
    """The checksum of a checkpoint's manifest: written last, a checkpoint counts only with it."""
    return Path(path) / (MANIFEST + CHECKSUM_SUFFIX)


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every completed (renamed) checkpoint folder, oldest first (verified or not: see `verify_checkpoint`)."""
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
        return f"no checksum file {side.name} (the write was interrupted, or it was not written by DepthBench)"
    try:
        recorded = listing.read_listing(side)
    except ValueError:
        recorded = {}
    if set(recorded) != {MANIFEST}:
        return f"checksum file {side.name} is malformed (expected '<sha256>  {MANIFEST}')"
    actual = listing.file_sha256(path / MANIFEST)
    if actual != recorded[MANIFEST]:
        return f"{MANIFEST}: sha256 {actual[:12]}... does not match the recorded {recorded[MANIFEST][:12]}... (corrupt)"
    files = json.loads((path / MANIFEST).read_text()).get("files", {})
    for name in sorted(files)[share[0] :: share[1]]:
        if not (path / name).is_file():
            return f"file {name} is missing"
        actual = listing.file_sha256(path / name)
        if actual != files[name]:
            return f"file {name}: sha256 {actual[:12]}... does not match the recorded {files[name][:12]}... (the file is corrupt)"
    return None


@dataclass
class Restored:
    """What `load_latest` found besides the tensors it loaded in place."""

    path: Path
    step: int
    world_size: int
    meta: dict[str, Any]
    rank_tensors: dict[str, torch.Tensor]


class Checkpointer:
    """Saves and loads the checkpoints of one run in `folder` on every rank of `ctx` (a
    depthbench.train.distributed.DistContext; None: one process). Must be created on every rank
    at the same point of the program (it creates the gloo group of the saves)."""

    def __init__(
        self, folder: str | os.PathLike, ctx=None, keep: int = 2, asynchronous: bool | None = None
    ):
        import torch.distributed as dist

        self.folder, self.keep = Path(folder), keep
        self.rank, self.world = (
            (ctx.rank, ctx.world_size) if ctx is not None and ctx.enabled else (0, 1)
        )
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.asynchronous = (
            self.world > 1 if asynchronous is None else asynchronous and self.world > 1
        )
        self.pending = None  # (step, future) of an asynchronous save in flight
        self.last_step: int | None = None  # the step of the latest save started by this process

    # ---- saving
    def save(
        self,
        step: int,
        run_id: str,
        tensors: dict,
        meta: dict | None = None,
        rank_tensors: dict[str, torch.Tensor] | None = None,
        blocking: bool = False,
    ) -> Path:
        """Write step `step`: `tensors` (a nested dict of tensors / DTensors, the same keys on
        every rank) through DCP, `rank_tensors` (this rank's own) as safetensors, `meta`
        (JSON-able, rank 0's is kept). Returns the final path (complete once `wait` returns)."""
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file

        from depthbench.train import dcp_io

        try:  # here, not in the background thread: the caller's error, named at the call
            json.dumps(meta or {})
        except TypeError as exc:
            raise CheckpointError(
                f"checkpoint meta must be JSON (numbers, strings, lists, dicts): {exc}"
            ) from None
        self.wait()  # one save at a time: the previous one is complete before this one starts
        final, tmp = checkpoint_path(self.folder, step), self.folder / f"step_{step:08d}.tmp"
        if self.rank == 0:
            self._remove_strays()
        self._barrier()  # nobody writes into the new folder before the strays are gone
        tmp.mkdir(parents=True, exist_ok=True)
        rank_file = f"rank_{self.rank}.safetensors"
        own = {k: v.detach().to("cpu").contiguous() for k, v in (rank_tensors or {}).items()}
        atomic_write(tmp / rank_file, lambda t: save_file(own, t))
        manifest = {
            "format": FORMAT,
            "run_id": run_id,
            "step": step,
            "world_size": self.world,
            "meta": meta or {},
        }
        writer = dcp_io.HashingWriter(
            tmp, self.rank, [rank_file], lambda: self._complete(tmp, final, manifest)
        )
        self.last_step = step
        if self.asynchronous and not blocking:
            self.pending = (
                step,
                dcp.async_save(tensors, storage_writer=writer, process_group=self.group),
            )
        else:
            with _single_process_quiet():
                dcp.save(
                    tensors,
                    storage_writer=writer,
                    process_group=self.group,
                    no_dist=self.world == 1,
                )
        return final

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise its error."""
        if self.pending is not None:
            _, future = self.pending
            self.pending = None
            future.result()

    def _complete(self, tmp: Path, final: Path, manifest: dict) -> None:
        """On rank 0, once every rank's files and listing exist: manifest, checksum, rename, prune."""
        files: dict[str, str] = {}
        for r in range(self.world):
            files.update(listing.read_listing(tmp / listing.rank_listing(r)))
        files[listing.METADATA] = listing.file_sha256(tmp / listing.METADATA)
        atomic_write_json(tmp / MANIFEST, {**manifest, "files": files})
        listing.write_listing(
            tmp, checksum_path(tmp).name, [MANIFEST]
        )  # last: the checkpoint counts from here
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (a resume from an older checkpoint)
            trash = final.with_name(f".{final.name}.replaced.tmp")
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        for _, old in list_checkpoints(self.folder)[: -self.keep]:
            checksum_path(old).unlink(missing_ok=True)  # first: a half-deleted folder never counts
            shutil.rmtree(old, ignore_errors=True)

    def _remove_strays(self) -> None:
        """Folders left by a write killed before its rename (no save is in flight: `wait` ran)."""
        for stray in [*self.folder.glob("step_*.tmp"), *self.folder.glob(".step_*.tmp")]:
            shutil.rmtree(stray, ignore_errors=True) if stray.is_dir() else stray.unlink(
                missing_ok=True
            )

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    # ---- loading
    def _listed(self) -> list[tuple[int, Path]]:
        """The folder's checkpoints, oldest first; none beside a legacy checkpoint is an error."""
        found = list_checkpoints(self.folder)
        if not found:
            _refuse_legacy(self.folder)
        return found

    def has_checkpoints(self) -> bool:
        """Whether there is a checkpoint to try. A fresh run learns this without importing DCP or
        building a state-dict template."""
        return bool(self._listed())

    def load_latest(self, run_id: str, template: dict) -> Restored | None:
        """Load the newest intact checkpoint of `run_id` into `template` (the nested dict of
        tensors / DTensors of this rank's model, resharded by DCP to any rank count or strategy)
        and return the rest, or None when there is none.

        A checkpoint that fails its checksums, whose metadata is unsafe or whose tensor data is
        not what its metadata describes is reported on stderr (name and reason) and the previous
        one is tried; one that is intact but belongs to another run, disagrees with its name or
        does not fit `template` is an error."""
        found = self._listed()
        if not found:
            return None
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from depthbench.train import dcp_io

        rejected = []
        for step, path in reversed(found):
            reason = self._agreed_reason(path)
            if reason is not None:
                rejected.append(path.name)
                self._say(
                    f"[{run_id}] skipping checkpoint {path}: {reason}; trying the previous one"
                )
                continue
            manifest = json.loads((path / MANIFEST).read_text())
            _check_identity(path, manifest, run_id, step)
            try:
                with _single_process_quiet():
                    dcp.load(
                        template,
                        storage_reader=dcp_io.SafeReader(path),
                        process_group=self.group,
                        no_dist=self.world == 1,
                    )
            except (
                Exception,
                CheckpointException,
            ) as exc:  # DCP's CheckpointException is a BaseException
                raise CheckpointError(
                    f"{path}: does not fit this run's model or optimizer ({_cause(exc)})"
                ) from exc
            return Restored(
                path,
                step,
                manifest["world_size"],
                manifest["meta"],
                self._rank_tensors(path, manifest),
            )
        if rejected:
            self._say(
                f"[{run_id}] no usable checkpoint in {self.folder} ({len(rejected)} rejected: "
                f"{', '.join(rejected)}); starting at step 0"
            )
        return None

    def _agreed_reason(self, path: Path) -> str | None:
        """`verify_checkpoint`, DCP's metadata read without executing code and every tensor's
        data checked against it (dcp_io.check_tensor_data), the files and tensors split among the
        ranks, the verdict the same on all. Nothing is copied into the model before this passes."""
        from depthbench.train import dcp_io

        share = (self.rank, self.world)
        reason = verify_checkpoint(path, share)
        if reason is None:
            try:
                reason = dcp_io.check_tensor_data(path, dcp_io.read_metadata(path), share)
            except ValueError as exc:
                reason = str(exc)
        if self.group is None:
            return reason
        import torch.distributed as dist

        bad = torch.tensor([int(reason is not None)])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if reason is not None:
            print(f"rank {self.rank}: checkpoint {path}: {reason}", file=sys.stderr)
        return (
            (reason or "a file failed verification on another rank (see its log)")
            if bad.item()
            else None
        )

    def _rank_tensors(self, path: Path, manifest: dict) -> dict[str, torch.Tensor]:
        """This rank's own tensors; a rank the checkpoint did not have (resumed with more ranks)
        takes rank 0's."""
        from safetensors.torch import load_file

        own = path / f"rank_{self.rank}.safetensors"
        return load_file(
            own
            if self.rank < manifest["world_size"] and own.exists()
            else path / "rank_0.safetensors"
        )

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(text, file=sys.stderr)


def _check_identity(path: Path, manifest: dict, run_id: str, step: int) -> None:
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


def _cause(exc: BaseException) -> str:
    """The first rank's error inside DCP's CheckpointException (which names only the ranks)."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))
        if isinstance(exc, tuple):  # DCP keeps each failure as (exception, its traceback)
            exc = exc[0]
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def _refuse_legacy(folder: Path) -> None:
    legacy = sorted(n for n in os.listdir(folder) if _LEGACY.match(n)) if folder.is_dir() else []
    if legacy:
        raise CheckpointError(
            f"{folder}: {legacy[-1]} is a single-file checkpoint of an earlier DepthBench version; "
            "this version resumes only from sharded (DCP) checkpoint folders. Finish the run with "
            "the earlier version, or delete the step_*.pt files to train it again from step 0"
        )


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process save/load that it assumes one process: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    folder: str | os.PathLike,
    step: int,
    run_id: str,
    tensors: dict,
    meta: dict | None = None,
    ctx=None,
    rank_tensors: dict[str, torch.Tensor] | None = None,
    keep: int = 2,
) -> Path:
    """One blocking save (see `Checkpointer.save`); every rank of `ctx` calls it."""
    return Checkpointer(folder, ctx, keep, asynchronous=False).save(
        step, run_id, tensors, meta, rank_tensors, blocking=True
    )


def load_latest(
    folder: str | os.PathLike, run_id: str, template: dict, ctx=None
) -> Restored | None:
    """`Checkpointer.load_latest` without a Checkpointer; every rank of `ctx` calls it."""
    return Checkpointer(folder, ctx).load_latest(run_id, template)


def load_final_model(model_cfg, run_dir: str | os.PathLike):
    """The model of a finished run with its final weights (run_dir/model.safetensors), on CPU."""
    from safetensors.torch import load_file

    from depthbench.models.registry import build_model

    model = build_model(model_cfg)
    model.load_state_dict(load_file(Path(run_dir) / "model.safetensors"))
    return model
