"""Resumable training state: model, optimizer, schedule position, RNG and data position.

Checkpoints live in the run's work folder (never a Snakemake output, which would be deleted when
a job fails). Each is written to a temporary file and renamed, so a kill at any moment leaves
either the previous checkpoint or the new one, never a partial file taken for complete.

A checkpoint cannot run code and cannot be silently wrong:

- it is read with ``torch.load(weights_only=True)``: the unpickler only rebuilds tensors,
  numbers, strings and containers, so a crafted ``step_*.pt`` cannot execute a call;
- each ``step_NNNNNNNN.pt`` gets a sidecar ``step_NNNNNNNN.pt.sha256`` (``sha256sum`` format,
  so ``sha256sum -c`` checks it by hand), written atomically *after* the data file. A checkpoint
  counts only when its sidecar is present and matches: a kill between the two writes, a flipped
  bit or bytes overwritten inside the file all make it rejected, by name and reason on stderr,
  and the previous good one is used. When none is good the log says so before step 0.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from depthbench.errors import CheckpointError
from depthbench.io import atomic_write, atomic_write_text

_NAME = re.compile(r"^step_(\d{8})\.pt$")
CHECKSUM_SUFFIX = ".sha256"


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}.pt"


def checksum_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every checkpoint data file on disk, oldest first (verified or not: see `load_latest`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), folder / name) for name in os.listdir(folder) if (m := _NAME.match(name))]
    return sorted(found)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_checksum(path: Path, digest: str) -> None:
    atomic_write_text(checksum_path(path), f"{digest}  {path.name}\n")


def save_checkpoint(folder: str | os.PathLike, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as step_{step}.pt, then its checksum; keep the newest `keep` checkpoints."""
    path = checkpoint_path(folder, step)
    digest: list[str] = []

    def write(tmp: str) -> None:
        torch.save(state, tmp)
        digest.append(file_sha256(tmp))  # hashed before the rename: the bytes that were written

    atomic_write(path, write)
    _write_checksum(path, digest[0])  # last: a checkpoint counts only once this exists
    for _, old in list_checkpoints(folder)[:-keep]:
        checksum_path(old).unlink(missing_ok=True)  # the sidecar first: never a stale "good" pair
        old.unlink(missing_ok=True)
    for stray in Path(folder).glob(".step_*.tmp"):  # left by a write killed before its rename
        stray.unlink(missing_ok=True)  # (one writer per run: no other write is in progress)
    return path


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None when `path` matches its checksum sidecar, else the reason it does not."""
    path = Path(path)
    side = checksum_path(path)
    if not side.is_file():
        return f"no checksum file {side.name} (the write was interrupted, or it was not written by DepthBench)"
    fields = side.read_text(errors="replace").split()
    if len(fields) != 2 or fields[1] != path.name or not re.fullmatch(r"[0-9a-f]{64}", fields[0]):
        return f"checksum file {side.name} is malformed (expected '<sha256>  {path.name}')"
    actual = file_sha256(path)
    if actual != fields[0]:
        return f"sha256 {actual[:12]}... does not match the recorded {fields[0][:12]}... (the file is corrupt)"
    return None


def _read(path: Path) -> dict[str, Any]:
    """Verify, then unpickle without code execution; CheckpointError with the reason."""
    reason = verify_checkpoint(path)
    if reason is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # an unpickling error: not plain tensors and containers
            reason = f"not loadable without executing code ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        else:
            if isinstance(state, dict):
                return state
            reason = f"holds a {type(state).__name__}, not a state dict"
    raise CheckpointError(f"{path}: {reason}")


def load_latest(folder: str | os.PathLike, run_id: str) -> dict[str, Any] | None:
    """The newest verified checkpoint of `run_id`, or None.

    A checkpoint that fails its checksum or cannot be read is reported on stderr (name and
    reason) and the previous one is tried; one that verifies but belongs to another run, or whose
    content disagrees with its name, is an error (a misplaced folder, not a fault to skip)."""
    rejected = []
    for step, path in reversed(list_checkpoints(folder)):
        try:
            state = _read(path)
        except CheckpointError as exc:
            rejected.append(path.name)
            print(f"[{run_id}] skipping checkpoint {exc}; trying the previous one", file=sys.stderr)
            continue
        if state.get("run_id") != run_id:
            raise CheckpointError(f"{path} belongs to run {state.get('run_id')!r}, not {run_id!r}; move it away")
        if state.get("step") != step:
            raise CheckpointError(f"{path}: file name says step {step}, content says {state.get('step')}")
        return state
    if rejected:
        print(f"[{run_id}] no usable checkpoint in {folder} ({len(rejected)} rejected: {', '.join(rejected)}); "
              "starting at step 0", file=sys.stderr)
    return None


def load_final_model(model_cfg, run_dir: str | os.PathLike):
    """The model of a finished run with its final weights (run_dir/model.safetensors), on CPU."""
    from safetensors.torch import load_file

    from depthbench.models import build_model

    model = build_model(model_cfg)
    model.load_state_dict(load_file(Path(run_dir) / "model.safetensors"))
    return model
