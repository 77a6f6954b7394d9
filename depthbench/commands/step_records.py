"""Measured training-step times on a GPU, and how `depthbench plan` prices runs with them.

A record (`benchmarks/records/<device>.json`, written by `benchmarks/gpu_check.py --record`) holds
the device as CUDA names it, the torch version, the commit and date it was measured at, the
settings (sequence length, parameter budget, compile mode, implementations), and one entry per
architecture and depth measured: n_layer, d_model, micro-batch, tokens/s, MFU, peak memory and
`step_time_vs_pre_ln`, its step time over pre_ln's at the same depth, budget, micro-batch and
sequence length, measured in the same process.

`depthbench plan` prices a run of architecture A at depth L as pre_ln's work at that shape
(tokens x pre_ln's training FLOPs per token at A's d_model and L) at the assumed MFU, times A's
measured relative step time at L: interpolated linearly in L between the two nearest measured
depths, the nearest one's outside them. An architecture the record does not hold is priced at
its own FLOPs and the assumed MFU, and marked assumed. Relative step times carry over between
GPUs of a kind better than absolute ones, so a record of one GPU prices a plan for another, and
the plan says whose record it used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from depthbench.util.errors import DataError

RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "records"
RUN_FIELDS = ("arch", "n_layer", "step_time_vs_pre_ln")


def record_name(device: str) -> str:
    """The file name of `device`'s record: "NVIDIA H200" -> "nvidia-h200.json"."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") + ".json"


@dataclass
class StepRecord:
    path: str
    device: str
    torch: str
    commit: str
    recorded: str
    runs: list[dict] = field(default_factory=list)

    def relative_step_time(self, arch: str, n_layer: int) -> float | None:
        """A's step time over pre_ln's at depth `n_layer` (module docstring), or None."""
        points = sorted(
            (r["n_layer"], r["step_time_vs_pre_ln"])
            for r in self.runs
            if r["arch"] == arch and r.get("step_time_vs_pre_ln") is not None
        )
        if arch == "pre_ln":
            return 1.0
        if not points:
            return None
        below = [p for p in points if p[0] <= n_layer]
        above = [p for p in points if p[0] >= n_layer]
        if not below:
            return above[0][1]
        if not above:
            return below[-1][1]
        (l0, r0), (l1, r1) = below[-1], above[0]
        return r0 if l1 == l0 else r0 + (r1 - r0) * (n_layer - l0) / (l1 - l0)

    def depths(self, arch: str) -> list[int]:
        return sorted({r["n_layer"] for r in self.runs if r["arch"] == arch})

    def describe(self) -> str:
        where = Path(self.path)
        try:
            where = where.resolve().relative_to(Path.cwd())
        except ValueError:
            pass
        return f"{where}: {self.device}, torch {self.torch}, commit {self.commit}, {self.recorded}"


def load_record(path: str | Path) -> StepRecord:
    """The record at `path`; a DataError naming the file and the field when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable step-time record ({exc})") from exc
    missing = [k for k in ("device", "torch", "commit", "recorded", "runs") if k not in data]
    if missing or not isinstance(data.get("runs"), list):
        raise DataError(f"{path}: a step-time record needs {missing or ['runs as a list']}")
    for i, run in enumerate(data["runs"]):
        absent = [k for k in RUN_FIELDS if k not in run]
        if absent:
            raise DataError(f"{path}: runs[{i}] lacks {absent} (each run needs {RUN_FIELDS})")
    return StepRecord(
        str(path), data["device"], data["torch"], data["commit"], data["recorded"], data["runs"]
    )


def find_record(choice: str, gpu: str, folder: Path = RECORDS) -> StepRecord | None:
    """`choice`: a record's path, `none`, or `auto`: the record whose device names `gpu`, else
    the only record in `folder` (None when there is none or several)."""
    if choice == "none":
        return None
    if choice != "auto":
        return load_record(choice)
    records = sorted(folder.glob("*.json")) if folder.is_dir() else []
    named = [p for p in records if p.name == record_name(gpu)]
    if named:
        return load_record(named[0])
    return load_record(records[0]) if len(records) == 1 else None
