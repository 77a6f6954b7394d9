"""The hooks of a training run in their order (see depthbench.train.trainer for when each
method runs; the hooks are in depthbench.train.hooks).

`default_hooks` lists them in the order their records depend on: dynamics
(before the update), train metrics and throughput, evaluation, divergence (reads the validation
loss the evaluation hook put in the record), weight snapshots (probes.at_steps; before the
checkpoint of the same step, depthbench.train.snapshots), checkpointing, the requeue signal
(depthbench.train.requeue), progress bar, metrics.jsonl.
"""

from __future__ import annotations

import math

from depthbench.train.hooks import (
    CheckpointHook,
    DivergenceHook,
    DynamicsHook,
    EvalHook,
    JsonlLogger,
    ProgressHook,
    TrainMetricsHook,
)
from depthbench.train.requeue import RequeueHook
from depthbench.train.snapshots import SnapshotHook
from depthbench.train.hook_base import Hook


def default_hooks(
    trainer,
    val_windows,
    flops_per_token: float,
    peak: float | None,
    measured_peak: float | None,
    progress: bool,
    loggers: list[Hook],
    owner: str | None = None,
) -> list[Hook]:
    """The hooks of a run, in their order (see the module docstring). Output hooks (progress,
    metrics.jsonl, trackers) only on rank 0. With `owner` (depthbench.train.owner.process_identity
    of the process waiting for the run), the run stops at the first checkpoint after it ended."""
    from depthbench.train.owner import OwnerHook

    tc, spec, ctx = trainer.tc, trainer.spec, trainer.ctx
    hooks: list[Hook] = [
        DynamicsHook(tc.dynamics_every),
        TrainMetricsHook(
            tc.log_every,
            tc.total_steps,
            tc.tokens_per_step,
            flops_per_token,
            peak,
            measured_peak,
            ctx.world_size,
        ),
        EvalHook(val_windows, tc.eval_every, tc.total_steps, tc.eval_batches, tc.micro_batch_size),
        DivergenceHook(
            tc.divergence_factor * math.log(spec.model.vocab_size),
            (tc.log_every, tc.eval_every, tc.checkpoint_every),
            tc.total_steps,
        ),
        # before the checkpoint of its step
        *([SnapshotHook(tc.snapshot_steps)] if tc.snapshot_steps else []),
        CheckpointHook(tc.checkpoint_every, tc.total_steps),
        # after the checkpoint it stops at
        *([OwnerHook(owner, tc.checkpoint_every, tc.total_steps)] if owner else []),
        # after the periodic checkpoint: a step saved there is not saved twice
        RequeueHook(tc.total_steps),
    ]
    if ctx.is_main:
        if progress:
            hooks.append(ProgressHook(tc.total_steps, spec.run_id))
        hooks += [JsonlLogger(trainer.paths.metrics), *loggers]
    return hooks
