"""The training of one run: `train` sets it up, depthbench.train.trainer runs the steps with the
hooks of depthbench.train.hooks (evaluation, dynamics, metrics, checkpoints, divergence, logs and
trackers), `finish` writes the outputs. The recipe (schedule, optimizer, device, dtype) is in
depthbench.train.recipe; its names are importable from here too.

A run resumes from its latest checkpoint and ends with exactly the weights of an uninterrupted run
on the same device and thread count (the data position is the step; see depthbench.data.loader),
and with the same weight snapshots (probes.at_steps; depthbench.train.snapshots).
A run whose loss turns NaN/inf or exceeds divergence_factor x ln(vocab) stops with status
`diverged`; its summary is still written so that the workflow goes on.
"""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from depthbench.data.loader import TokenWindows, TrainBatches
from depthbench.data.shards import read_meta, split_files
from depthbench.util.io import atomic_write, atomic_write_json
from depthbench.util.safetensors_file import save_safetensors
from depthbench.models.registry import build_model
from depthbench.spec.run import RunSpec
from depthbench.train.runcheck import WEIGHTS_DIGEST
from depthbench.train.listing import file_sha256
from depthbench.train import distributed, snapshots
from depthbench.train.flops import device_peak_flops, measured_peak_flops, train_flops_per_token
from depthbench.train.hook_order import default_hooks
from depthbench.train.recipe import (
    RunPaths,
    resolve_device,
    resolve_dtype,
)
from depthbench.train.tracking import build_loggers, check_loggers
from depthbench.train.trainer import STATUS_OK, Trainer


def _data(
    spec: RunSpec, data_dir, ctx: distributed.DistContext
) -> tuple[TrainBatches, TokenWindows]:
    """The run's training batches (this rank's share) and validation windows."""
    tc = spec.train
    meta = read_meta(data_dir)
    if meta["vocab_size"] != spec.model.vocab_size:
        raise ValueError(
            f"{data_dir}: shards have vocab {meta['vocab_size']}, "
            f"model expects {spec.model.vocab_size}"
        )
    train_windows = TokenWindows(split_files(data_dir, meta, "train"), meta["dtype"], tc.seq_len)
    val_windows = TokenWindows(split_files(data_dir, meta, "val"), meta["dtype"], tc.seq_len)
    batches = TrainBatches(
        train_windows, tc.seed, tc.global_batch_size, tc.micro_batch_size, ctx.rank, ctx.world_size
    )
    return batches, val_windows


def _fresh_model(spec: RunSpec, device: torch.device):
    """The run's initial model and its training FLOPs per token: one function for the fresh start
    and for the restart from step 0 below, so the two cannot drift apart."""
    torch.manual_seed(spec.train.seed)
    model = build_model(spec.model).to(device)
    return model, train_flops_per_token(model, spec.train.seq_len)


def train(
    spec: RunSpec,
    data_dir: str | os.PathLike,
    paths: RunPaths,
    progress: bool = True,
    stop_after: int | None = None,
    owner: str | None = None,
) -> dict[str, Any]:
    """Train `spec` to completion (or divergence) and write its outputs; return the summary.

    `stop_after` ends the process-level loop early after that many steps (tests use it to
    simulate an interruption); it is not part of the run's identity. With `owner` the run stops
    at its next checkpoint once that process has ended (depthbench.train.owner.OwnerHook).
    """
    tc = spec.train
    check_loggers(tc.loggers)  # a missing tracker package fails before anything starts
    torch.set_num_threads(tc.threads)
    ctx, device_name = distributed.setup(tc.parallel, tc.device)
    tc.check(ctx.world_size)
    device = resolve_device(device_name)
    if device.type == "cuda":  # TF32 for the few fp32 matmuls left outside bf16 autocast
        torch.set_float32_matmul_precision("high")
    dtype = resolve_dtype(tc.dtype, device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    if ctx.is_main:
        paths.checkpoints.mkdir(parents=True, exist_ok=True)
    batches, val_windows = _data(spec, data_dir, ctx)

    model, flops_per_token = _fresh_model(spec, device)
    n_params = model.num_parameters()
    trainer = Trainer(spec, paths, model, batches, ctx, device, autocast)
    # metrics.jsonl is truncated to the checkpoint, or started anew, by its hook; snapshots likewise
    if trainer.restore() and (
        missing := snapshots.needs_restart(paths, tc.snapshot_steps, trainer.step)
    ):
        print(
            f"[{spec.run_id}] the checkpoint at step {trainer.step} "
            f"lacks the snapshots of steps {missing} "
            "(probes.at_steps): training again from step 0",
            file=sys.stderr,
        )
        model, flops_per_token = _fresh_model(spec, device)  # exactly the fresh start above
        trainer = Trainer(spec, paths, model, batches, ctx, device, autocast)
    distributed.barrier(ctx)

    peak, measured = device_peak_flops(device, dtype), measured_peak_flops(device, dtype)
    loggers = build_loggers(tc.loggers, paths.work_dir) if ctx.is_main else []
    trainer.hooks = default_hooks(
        trainer, val_windows, flops_per_token, peak, measured, progress, loggers, owner
    )
    trainer.fit(stop_after)

    # interrupted on purpose (stop_after)
    if trainer.status == STATUS_OK and trainer.step < tc.total_steps:
        distributed.teardown(ctx)
        return {"run_id": spec.run_id, "status": "interrupted", "step": trainer.step}
    if tc.snapshot_steps and ctx.is_main:  # before summary.json, whose presence means done
        snapshots.publish(paths, spec.run_id)
    summary = finish(
        spec,
        paths,
        model,
        trainer.status,
        trainer.step,
        trainer.wall_seconds(),
        trainer.last_val,
        n_params,
        device,
        ctx,
    )
    distributed.teardown(ctx)
    return summary


def finish(
    spec: RunSpec,
    paths: RunPaths,
    model,
    status: str,
    step: int,
    wall: float,
    last_val: float,
    n_params: int,
    device,
    ctx: distributed.DistContext | None = None,
) -> dict[str, Any]:
    """Write final weights, the metrics log and the summary (last: its presence means done).
    Under torch.distributed every rank gathers the full weights; rank 0 writes."""
    ctx = ctx or distributed.DistContext()
    tc = spec.train
    full = distributed.full_model_state(model, ctx)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in full.items()}
    if not ctx.is_main:
        return {"run_id": spec.run_id, "status": status, "rank": ctx.rank}
    digest: list[str] = []

    # hashed before the rename, so the digest is of the published file
    def write_weights(tmp: str) -> None:
        save_safetensors(tensors, tmp, {"run_id": spec.run_id, "step": str(step)})
        digest.append(file_sha256(tmp))

    atomic_write(paths.weights, write_weights)
    text = paths.metrics.read_text() if paths.metrics.exists() else ""
    atomic_write(paths.curves, lambda tmp: Path(tmp).write_text(text))
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    tps = [
        r["tokens_per_s"]
        for r in records
        if "tokens_per_s" in r and math.isfinite(r["tokens_per_s"])
    ]
    if device.type == "cuda":
        peak_mem, peak_kind = torch.cuda.max_memory_allocated(device), "cuda_allocator"
    else:  # the process's high-water mark (Linux reports KiB); includes Python and the data
        import resource

        peak_mem, peak_kind = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "process_max_rss",
        )
    summary = {
        "run_id": spec.run_id,
        "status": status,
        "steps": step,
        "total_steps": tc.total_steps,
        "tokens_seen": step * tc.tokens_per_step,
        "final_val_loss": last_val if status == STATUS_OK else float("nan"),
        "wall_seconds": round(wall, 3),
        "tokens_per_s": sum(tps) / len(tps) if tps else float("nan"),
        "n_params": n_params,
        "peak_memory_bytes": peak_mem,
        "peak_memory_kind": peak_kind,
        "device": str(device),
        "world_size": ctx.world_size,
        "parallel": ctx.strategy,
        "spec": spec.to_dict(),
        # checked by the tables against the grid (depthbench.analysis.tables)
        "spec_hash": spec.spec_hash(),
        # checked by every stage that reads the weights (depthbench.train.runcheck)
        WEIGHTS_DIGEST: digest[0],
    }
    atomic_write_json(paths.summary, summary)
    return summary
