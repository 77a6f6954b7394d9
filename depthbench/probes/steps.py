"""Probes over training: every snapshot a run kept (probes.at_steps; depthbench.train.snapshots)
goes through the same probes as the final model (`probe_model`, full), on the same sample.

Rows are in the probe stage's tidy form with stage "snapshot" and `step` = the number of updates
the weights had; the final model's rows keep stage "trained" (step = the run's last step) and the
init rows stage "init" (step 0), so every reader of the final-model rows is unchanged. The final
step is itself a snapshot (the same weights as model.safetensors), so a curve over steps ends on
the final model's value: tests check that the two probes agree.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from depthbench.util.errors import DataError
from depthbench.models.registry import build_model
from depthbench.kernels.swap import swap_in
from depthbench.probes.measure import probe_model
from depthbench.spec.run import RunSpec
from depthbench.train.snapshots import FOLDER, META_KEY, list_snapshots

SNAPSHOT_STAGE = "snapshot"


def load_snapshot(spec: RunSpec, path: Path) -> torch.nn.Module:
    """The model of `spec` with a snapshot's weights, on CPU, in eval mode; DataError naming the
    file when it belongs to another run."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
    if meta.get("run_id") != spec.run_id:
        raise DataError(
            f"{path}: a snapshot of run {meta.get('run_id')!r}, not {spec.run_id!r} "
            "(a misplaced folder?)"
        )
    model = build_model(spec.model)
    model.load_state_dict(load_file(path))
    return swap_in(model.eval())


def snapshot_rows(
    spec: RunSpec, run_dir: str | Path, idx: torch.Tensor, settings: dict
) -> list[dict]:
    """Tidy rows of every probe at every snapshot in run_dir/snapshots, with `step`."""

    rows: list[dict] = []
    for step, path in list_snapshots(Path(run_dir) / FOLDER):
        start = time.time()
        # on the sample's device, with that device's implementations
        model = swap_in(load_snapshot(spec, path).to(idx.device))
        for row in probe_model(model, idx, SNAPSHOT_STAGE, settings, full=True):
            rows.append({**row, "step": step})
        print(
            f"[{spec.run_id}] probed the snapshot of step {step} in {time.time() - start:.1f} s",
            file=sys.stderr,
        )
    return rows
