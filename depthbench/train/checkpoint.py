"""Resumable training state: model, optimizer, schedule position, RNG and data position.

Checkpoints live in the run's work folder (never a Snakemake output, which would be deleted when
a job fails). Each is written to a temporary file and renamed, so a kill at any moment leaves
either the previous checkpoint or the new one, never a partial file taken for complete.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from depthbench.errors import CheckpointError
from depthbench.io import atomic_write

_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}.pt"


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), folder / name) for name in os.listdir(folder) if (m := _NAME.match(name))]
    return sorted(found)


def save_checkpoint(folder: str | os.PathLike, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    path = checkpoint_path(folder, step)
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    for _, old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_latest(folder: str | os.PathLike, run_id: str) -> dict[str, Any] | None:
    """The newest readable checkpoint of `run_id`, or None. A corrupt newest file falls back."""
    for step, path in reversed(list_checkpoints(folder)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception:
            continue
        if state.get("run_id") != run_id:
            raise CheckpointError(f"{path} belongs to run {state.get('run_id')!r}, not {run_id!r}; move it away")
        if state.get("step") != step:
            raise CheckpointError(f"{path}: file name says step {step}, content says {state.get('step')}")
        return state
    return None


def load_final_model(model_cfg, run_dir: str | os.PathLike):
    """The model of a finished run with its final weights (run_dir/model.safetensors), on CPU."""
    from safetensors.torch import load_file

    from depthbench.models import build_model

    model = build_model(model_cfg)
    model.load_state_dict(load_file(Path(run_dir) / "model.safetensors"))
    return model
