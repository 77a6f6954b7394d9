"""Model snapshots at chosen training steps (`probes.at_steps`), for the probes over training.

A snapshot is the model weights only (safetensors; metadata `depthbench_snapshot`: run_id and
step) after `s` updates, the state the probes of step `s` read; it is not a resumable checkpoint
(no optimizer, RNG or schedule: depthbench.train.checkpoint keeps those) and never replaces one.

Where they live, and why:
- while training, in the run's work folder (`work/{run_id}/snapshots/step_NNNNNNNN.safetensors`),
  which is not a Snakemake output, so a failed or killed job keeps them for its resumption;
- when the run ends (ok or diverged), `publish` puts them in the run folder's declared output
  `runs/{run_id}/snapshots/`, before summary.json (whose presence means the run is done).

Exactly once, identical to an uninterrupted run: the snapshot of step s is written after step
s's line is logged and before the checkpoint of that step (SnapshotHook sits before the
CheckpointHook), so every checkpoint at step c has all snapshots <= c beside it. A resumed run
first deletes the snapshots after its checkpoint (that part is redone, as metrics.jsonl is
truncated), then writes them again from the same weights; a run resumed from a checkpoint that
lacks an earlier snapshot (e.g. `at_steps` added after it was trained) trains again from step 0
(`needs_restart`), since no other state can give the weights of that step.

Step choice (`resolve_steps`, documented in docs/design/probes.md): a list of steps, or
`{log_spaced: n}`, n steps rounded from a geometric sequence 1 .. total_steps; the final step is
always included (it anchors the curves to the final model's probes) and step 0 never (the log
step axis cannot show it; the init probes cover it); listed steps beyond a run's total_steps are
dropped for that run, since the runs of one grid have different lengths.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from depthbench.util.errors import ConfigError
from depthbench.util.safetensors_file import save_safetensors
from depthbench.util.io import atomic_folder, atomic_write
from depthbench.train.hook_base import Hook

FOLDER = "snapshots"
META_KEY = "depthbench_snapshot"  # JSON {"run_id", "step"}
_NAME = re.compile(r"^step_(\d{8})\.safetensors$")


def resolve_steps(at_steps, total_steps: int) -> list[int]:
    """The snapshot steps of a run of `total_steps` steps for `probes.at_steps` (a list of steps
    >= 1, or {log_spaced: n}); [] when at_steps is empty. See the module docstring."""
    if not at_steps:
        return []
    if isinstance(at_steps, dict):
        n = at_steps.get("log_spaced")
        if (
            set(at_steps) != {"log_spaced"}
            or not isinstance(n, int)
            or isinstance(n, bool)
            or n < 1
        ):
            raise ConfigError(
                "probes.at_steps",
                f"{at_steps!r}: expected a list of steps >= 1 or {{log_spaced: n}} with n >= 1",
            )
        # s_k = total^(k / (n-1)), k = 0..n-1: 1 ... total, equal ratios between neighbours
        steps = {int(round(total_steps ** (k / (n - 1)))) for k in range(n)} if n > 1 else set()
    elif isinstance(at_steps, (list, tuple)):
        bad = [s for s in at_steps if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ConfigError(
                "probes.at_steps",
                f"steps must be integers >= 1 (step 0 is the init probe); got {bad}",
            )
        steps = {s for s in at_steps if s <= total_steps}
    else:
        raise ConfigError(
            "probes.at_steps", f"{at_steps!r}: expected a list of steps or {{log_spaced: n}}"
        )
    return sorted(steps | {total_steps})


def snapshot_path(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}.safetensors"


def list_snapshots(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every snapshot in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        (int(m.group(1)), folder / name) for name in os.listdir(folder) if (m := _NAME.match(name))
    )


def work_folder(paths) -> Path:
    return Path(paths.work_dir) / FOLDER


def run_folder(paths) -> Path:
    return Path(paths.run_dir) / FOLDER


def needs_restart(paths, steps: list[int], resumed_step: int) -> list[int]:
    """Snapshot steps <= `resumed_step` that are missing beside the checkpoint: a run resumed
    there could never write them."""
    have = {s for s, _ in list_snapshots(work_folder(paths))}
    return [s for s in steps if s <= resumed_step and s not in have]


class SnapshotHook(Hook):
    """Writes the model weights after update s for every s in `steps` (module docstring)."""

    def __init__(self, steps: list[int]):
        self.steps = set(steps)

    def on_fit_start(self, trainer):
        if trainer.ctx.is_main:  # the part after the checkpoint is redone: its snapshots too
            for step, path in list_snapshots(work_folder(trainer.paths)):
                if step > trainer.step or step not in self.steps:
                    path.unlink()

    def on_step_logged(self, trainer, step):
        if step in self.steps:
            write_snapshot(trainer, step)


def write_snapshot(trainer, step: int) -> Path:
    """The full model state (a collective under FSDP) written by rank 0, atomically."""
    from depthbench.train import distributed

    full = distributed.full_model_state(trainer.model, trainer.ctx)
    path = snapshot_path(work_folder(trainer.paths), step)
    if trainer.ctx.is_main:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in full.items()}
        meta = {META_KEY: json.dumps({"run_id": trainer.spec.run_id, "step": step}, sort_keys=True)}
        atomic_write(path, lambda tmp: save_safetensors(tensors, tmp, meta))
    distributed.barrier(trainer.ctx)
    return path


def publish(paths, run_id: str) -> int:
    """Put the work folder's snapshots into the run folder's `snapshots/` (replacing it whole:
    built beside it, then renamed). Files are hard-linked where the file system allows (they are
    never modified in place, only replaced), else copied. Returns how many."""
    found = list_snapshots(work_folder(paths))
    target = run_folder(paths)
    with atomic_folder(target) as tmp:
        for _, src in found:
            try:
                os.link(src, tmp / src.name)
            except OSError:
                shutil.copy2(src, tmp / src.name)
    print(f"[{run_id}] {len(found)} snapshots in {target}", file=sys.stderr)
    return len(found)
