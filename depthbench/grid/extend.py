"""The LR sweep's extensions: the runs the lr_sweep checkpoint may add past the edge of a cell's
learning rates (`lr_sweep.max_extensions`), and each cell's ladder of learning rates.

A cell (architecture, shape, sweep point) whose grid has two or more learning rates l_1 < ... <
l_m gets, below and above, the LRs l_1 / r_lo^k and l_m * r_hi^k for k = 1 .. max_extensions,
where r_lo = l_2 / l_1 and r_hi = l_m / l_(m-1) are the grid's own spacing at that edge (a log
scale). Each is rounded to 4 significant digits, so that the number a user would write when
widening the grid by hand (0.03125 for 1.25e-2 x 2.5) gives the same run id: an extension run is
an ordinary run of the grid's recipe at another learning rate and the grid's seeds, which a
widened grid reuses. Which of them train is the checkpoint's choice, round by round
(depthbench.analysis.lr_rounds); every one is a candidate run of the workflow.
"""

from __future__ import annotations

import json
from dataclasses import replace

from depthbench.grid.ids import run_id_of
from depthbench.spec.run import RunSpec


def extension_lr(lrs: list[float], side: int, k: int) -> float:
    """The k-th learning rate past the edge of the sorted `lrs` on `side` (-1 below, +1 above)."""
    lrs = sorted(lrs)
    ratio = lrs[1] / lrs[0] if side < 0 else lrs[-1] / lrs[-2]
    edge = lrs[0] if side < 0 else lrs[-1]
    return float(f"{edge * ratio ** (side * k):.4g}")


def cell_of(spec: RunSpec) -> tuple:
    """A run's cell: (arch, n_layer, d_model, knobs as runs.parquet writes them)."""
    return (
        spec.arch,
        spec.shape.n_layer,
        spec.shape.d_model,
        json.dumps(spec.knobs, sort_keys=True),
    )


def _cells(runs: dict[str, RunSpec]) -> dict[tuple, dict[float, list[str]]]:
    out: dict[tuple, dict[float, list[str]]] = {}
    for run_id, spec in runs.items():
        out.setdefault(cell_of(spec), {}).setdefault(spec.lr, []).append(run_id)
    return out


def extension_runs(runs: dict[str, RunSpec], max_extensions: int) -> dict[str, RunSpec]:
    """{run id: spec} of every extension `runs` (the grid's sweep) may get: per cell of two or
    more LRs, side and k <= max_extensions, the edge LR's runs (every sweep seed) at the new LR."""
    out: dict[str, RunSpec] = {}
    for by_lr in _cells(runs).values():
        lrs = sorted(by_lr)
        if len(lrs) < 2:
            continue
        for side, edge in ((-1, lrs[0]), (1, lrs[-1])):
            for k in range(1, max_extensions + 1):
                lr = extension_lr(lrs, side, k)
                for run_id in by_lr[edge]:
                    spec = runs[run_id]
                    ext = replace(spec, run_id="", lr=lr, train=replace(spec.train, lr=lr))
                    ext.run_id = run_id_of(ext)
                    out[ext.run_id] = ext
    return out


def ladders(runs: dict[str, RunSpec], extensions: dict[str, RunSpec]) -> list[dict]:
    """Per cell of the grid: its keys and its rungs, every learning rate it may try from the
    lowest to the highest, each {"lr", "run_ids" (one per sweep seed), "grid" (the grid's own
    LR, not an extension)}: what the lr_sweep checkpoint reads (JSON-able, a Snakemake param)."""
    grid, ext = _cells(runs), _cells(extensions)
    out = []
    for cell, by_lr in grid.items():
        more = ext.get(cell, {})
        rungs = [
            {
                "lr": lr,
                "run_ids": sorted((by_lr.get(lr) or []) + (more.get(lr) or [])),
                "grid": lr in by_lr,
            }  # fmt: skip
            for lr in sorted(set(by_lr) | set(more))
        ]
        arch, n_layer, d_model, knobs = cell
        out.append({"arch": arch, "n_layer": n_layer, "d_model": d_model, "knobs": knobs,
                    "rungs": rungs})  # fmt: skip
    return out


def extensions_at_most(exp) -> int:
    """The most extension runs the sweep can train: a cell extends on one side only, at most
    max_extensions LRs there, each at every sweep seed (half of `exp.extensions`)."""
    return len(exp.extensions) // 2
