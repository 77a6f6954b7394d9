"""Resumable training checkpoints, sharded with torch.distributed.checkpoint (DCP): saving and
loading the folders whose layout, atomic completion and verification
depthbench.train.checkpoint_folder holds.

A checkpoint that fails its checksums is reported (name and reason) and the previous one is
used, as is one whose tensor data is not the tensors its metadata describes (checked before any
of it reaches the model). Nothing on load runs code: JSON, safetensors, DCP metadata through an
allow-list unpickler, tensor data with weights_only=True.

Asynchronous saving (`dcp.async_save`) is used when there is a process group (several ranks):
the state is copied to CPU memory (DCP's staging), then written by a background thread over a
dedicated gloo group, so it never interleaves with training collectives. With one process
`dcp.save` writes synchronously: those are the CPU runs of small models, where a save takes
milliseconds and the staging copy plus a thread would buy nothing. `save(blocking=True)` (the
requeue signal, the end of a stopped run) waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from depthbench.util.errors import CheckpointError
from depthbench.util.io import atomic_write
from depthbench.util.safetensors_file import save_safetensors
from depthbench.train.checkpoint_folder import (
    FORMAT,
    MANIFEST,
    agreed_reason,
    check_identity,
    checkpoint_path,
    complete_checkpoint,
    list_checkpoints,
    remove_strays,
)

# DCP itself (depthbench.train.dcp_io) is imported only where a checkpoint is written or read.


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
            remove_strays(self.folder)
        self._barrier()  # nobody writes into the new folder before the strays are gone
        tmp.mkdir(parents=True, exist_ok=True)
        rank_file = f"rank_{self.rank}.safetensors"
        own = {k: v.detach().to("cpu").contiguous() for k, v in (rank_tensors or {}).items()}
        atomic_write(tmp / rank_file, lambda t: save_safetensors(own, t))
        manifest = {
            "format": FORMAT,
            "run_id": run_id,
            "step": step,
            "world_size": self.world,
            "meta": meta or {},
        }
        writer = dcp_io.HashingWriter(
            tmp,
            self.rank,
            [rank_file],
            lambda: complete_checkpoint(self.folder, tmp, final, manifest, self.world, self.keep),
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

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    # ---- loading
    def _listed(self) -> list[tuple[int, Path]]:
        """The folder's checkpoints, oldest first."""
        return list_checkpoints(self.folder)

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
            reason = agreed_reason(path, self.rank, self.world, self.group)
            if reason is not None:
                rejected.append(path.name)
                self._say(
                    f"[{run_id}] skipping checkpoint {path}: {reason}; trying the previous one"
                )
                continue
            manifest = json.loads((path / MANIFEST).read_text())
            check_identity(path, manifest, run_id, step)
            try:
                with _single_process_quiet():
                    dcp.load(
                        template,
                        storage_reader=dcp_io.SafeReader(path),
                        process_group=self.group,
                        no_dist=self.world == 1,
                    )
            # DCP's CheckpointException is a BaseException
            except (Exception, CheckpointException) as exc:
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


def _cause(exc: BaseException) -> str:
    """The first rank's error inside DCP's CheckpointException (which names only the ranks)."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))
        if isinstance(exc, tuple):  # DCP keeps each failure as (exception, its traceback)
            exc = exc[0]
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process save/load that it assumes one process: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


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
