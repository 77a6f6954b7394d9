"""`depthbench rehearse CONFIG --out DIR`: every architecture of a preset at its real size on this
machine, before a cluster sees it.

For each architecture, its widest shape (largest d_model) and its deepest (largest n_layer), as
the shape solver resolves them for the workflow (depthbench.grid.config.expand_grid):

1. **Memory guard.** The analytic estimate (depthbench.train.memory, fp32 on CPU, micro-batch 1 x
   `tokens`) gives the rehearsal's footprint: the larger of the training step (weights, gradients,
   AdamW's two moments, saved activations and the larger working set, the loss's or a block's
   backward with the held buffers' gradients) and the resume (weights and AdamW state, with the
   loaded checkpoint's 12 bytes per parameter next to them), plus depthbench.train.memory.HEADROOM.
   When that exceeds the machine's available memory, `mode="real"` refuses the shape (a row with
   status "refused" saying how much it needs); `mode="auto"` checks it on the meta device instead
   (step 5).
2. **Two optimizer steps** through depthbench.train.trainer.Trainer (the training loop's own
   forward/backward, clipping, AdamW and schedule), in fp32 on the CPU, on one micro-batch of
   1 x `tokens` random token ids drawn uniformly from the preset's vocabulary (seeded): the
   corpus is not needed, and the loss of random tokens is about ln(vocab), which is what step 0
   of a real run sees too. Peak memory: the process's RSS high-water mark from just before the
   model is built to the end of the second step (depthbench.commands.rehearse.rss), next to the
   estimate.
3. **Checkpoint and resume** through `save_state` / `resume_state` (roundtrip.py), the two narrow
   calls into the trainer's checkpointing: the state is fingerprinted (SHA-256 of every tensor's
   bytes: weights, AdamW moments and steps, the torch RNG state, the step), saved, the live state is
   overwritten (weights and moments zeroed, RNG reseeded, step 0), resumed, and fingerprinted again:
   every entry must be equal.
4. **Probes**: depthbench.probes.run.probe_model with the schema's settings (probe_settings) on
   2 random sequences of `probe_tokens` + 1 tokens, every family that applies to the
   architecture. The intervention families (causal, permutation, usefulness) cost about L^2/2,
   L^3/3 and L^2/2 layer passes (about 1,600 full forwards for the permutation matrix at L = 70),
   so each is evaluated on its first `probe_passes` items only (the setting `max_passes` of
   probe_model, which depthbench.probes.interventions takes; the longest passes: they resume
   at layer 1), the rest of its matrix left NaN (and with it the causal and permutation shares,
   which summarise the matrices' last quarters); `probe_passes=0` runs them in full.
5. **Meta mode** (automatic when the estimate does not fit, or `mode="meta"`): the model is built
   on the meta device (no memory), its parameters are counted against the solver's, its FSDP2
   units must be its blocks, and the per-GPU estimate at the preset's micro-batch and sequence
   length (bf16, FSDP2 sharding over the launcher's ranks) is reported with and without full
   activation checkpointing.
"""

from __future__ import annotations

import gc
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from depthbench.launch.executors import ranks_per_run
from depthbench.models.registry import build_model
from depthbench.commands.plan import CHECKPOINT_BYTES_PER_PARAM
from depthbench.commands.rehearse.roundtrip import checkpoint_roundtrip
from depthbench.commands.rehearse.rss import PeakRSS
from depthbench.spec.run import RunSpec
from depthbench.train.distributed import DistContext
from depthbench.train.memory import HEADROOM, estimate_memory
from depthbench.train.working_sets import FP32
from depthbench.train.recipe import RunPaths

GIB = 2**30
MODES = ("auto", "real", "meta")
STEPS = 2
PROBE_SEQUENCES = 2


@dataclass
class Target:
    arch: str
    which: str  # "widest", "deepest", or "widest+deepest" for a one-shape preset
    spec: RunSpec


def rehearsal_targets(
    exp, archs: list[str] | None = None, which: tuple[str, ...] = ("widest", "deepest")
) -> list[Target]:
    """Per architecture of the grid (in the order of `archs`, default the config's), its widest
    and its deepest shape (first learning rate, seed and sweep point: they do not change the
    model's size); `which` keeps only the widest or only the deepest; "both" stands for the
    two."""
    which = tuple(
        w for part in which for w in (("widest", "deepest") if part == "both" else (part,))
    )
    shapes: dict[str, dict] = {}
    for spec in exp.runs.values():
        shapes.setdefault(spec.arch, {}).setdefault(spec.shape, spec)
    if not which or set(which) - {"widest", "deepest"}:
        raise ValueError(f"--shapes {list(which)}: valid: widest, deepest, both or widest,deepest")
    unknown = sorted(set(archs or []) - set(shapes))
    if unknown:
        raise ValueError(
            f"--archs {unknown}: not architectures of this config; valid: {list(shapes)}"
        )
    targets = []
    for arch in archs or list(shapes):  # the order asked for: the most telling architectures first
        by_shape = shapes[arch]
        widest = max(by_shape.values(), key=lambda s: (s.shape.d_model, -s.shape.n_layer))
        deepest = max(by_shape.values(), key=lambda s: (s.shape.n_layer, -s.shape.d_model))
        if widest is deepest:
            targets.append(Target(arch, "widest+deepest", widest))
        else:
            targets += [
                Target(arch, w, s)
                for w, s in (("widest", widest), ("deepest", deepest))
                if w in which
            ]
    return targets


# ---- the narrow calls into checkpointing (see the module docstring, step 3)
class _OneBatch:
    """The trainer's batch source: the same 1 x T micro-batch at every step."""

    accum_steps = 1

    def __init__(self, ids: torch.Tensor):
        self.x, self.y = ids[:, :-1], ids[:, 1:]

    def get(self, step: int, micro: int):
        return self.x, self.y


def run_probe_families(model, vocab: int, probe_tokens: int, passes: int, seed: int) -> dict:
    from depthbench.probes.measure import probe_model
    from depthbench.probes.run import probe_settings

    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab, (PROBE_SEQUENCES, probe_tokens + 1), generator=g)
    t0 = time.time()
    # the intervention families on their first `passes` items (see the module docstring, step 4)
    settings = probe_settings({"max_passes": passes if passes > 0 else None})
    rows = probe_model(model.eval(), idx, "trained", settings, full=True)
    # a share summarises the last quarters of its matrix, which limited passes leave NaN at depth
    partial = {"causal_share", "permutation_share"} if passes > 0 else set()
    nonfinite = sorted(
        {r["probe"] for r in rows if r["probe"] not in partial and not math.isfinite(r["value"])}
    )
    return {
        "probe_families": sorted({r["probe"] for r in rows}),
        "probe_rows": len(rows),
        "probe_finite": not nonfinite,
        "probe_nonfinite": nonfinite,
        "probe_s": round(time.time() - t0, 1),
    }


def cpu_footprint(est, n_params: int) -> float:
    """Bytes the rehearsal needs at its peak, headroom included (see step 1)."""
    # weights + AdamW, and the loaded checkpoint
    resume = (3 * FP32 + CHECKPOINT_BYTES_PER_PARAM) * n_params
    return max(est.total(False), resume) * (1 + HEADROOM)


def _estimate_columns(est) -> dict:
    # what the step adds to weights, gradients and AdamW: saved activations and the working set
    acts = est.total(False) - est.weights - est.gradients - est.optimizer
    return {
        "est_weights_gib": est.weights / GIB,
        "est_grads_gib": est.gradients / GIB,
        "est_adamw_gib": est.optimizer / GIB,
        "est_acts_gib": acts / GIB,
        "est_gib": est.total(False) / GIB,
    }


def rehearse_real(
    target: Target, out: Path, tokens: int, probe_tokens: int, probe_passes: int, est=None
) -> dict:
    """Steps 2-4 of the module docstring; `est`: the estimate of step 1, if already traced."""
    from depthbench.train.trainer import Trainer

    spec = target.spec
    spec = replace(
        spec,
        train=replace(
            spec.train,
            seq_len=tokens,
            micro_batch_size=1,
            global_batch_size=1,
            compile="none",
            device="cpu",
            dtype="float32",
        ),
    )
    work = out / "work" / f"{target.arch}_{spec.shape.tag}"
    shutil.rmtree(work, ignore_errors=True)
    ids = torch.randint(
        0,
        spec.model.vocab_size,
        (1, tokens + 1),
        generator=torch.Generator().manual_seed(spec.train.seed),
    )
    est = est or estimate_memory(
        spec.model,
        1,
        tokens,
        bf16=False,
        device="cpu",
        loss_chunk_tokens=spec.train.loss_chunk_tokens,
    )
    all_mem, step_mem = PeakRSS().begin(), PeakRSS().begin()  # begun together: one high-water reset
    t0 = time.time()
    try:
        torch.manual_seed(spec.train.seed)
        model = build_model(spec.model)
        trainer = Trainer(
            spec,
            RunPaths(work, work),
            model,
            _OneBatch(ids),
            DistContext(),
            torch.device("cpu"),
            nullcontext(),
        )
        trainer.fit(stop_after=STEPS)
        step_mem.end()
        step_s = time.time() - t0
        # the step's statistics stay device tensors in the loop (no host sync); read them here
        row = {
            "steps": trainer.step,
            "loss": float(trainer.stats.train_loss),
            "grad_norm": float(trainer.stats.grad_norm),
        }
        row.update(checkpoint_roundtrip(trainer))
        row.update(
            run_probe_families(
                model, spec.model.vocab_size, probe_tokens, probe_passes, spec.train.seed
            )
        )
    finally:
        step_mem.end()
        all_mem.end()
        shutil.rmtree(work, ignore_errors=True)
    row.update(
        params=model.num_parameters(),
        step_s=round(step_s, 1),
        measured_gib=step_mem.peak / GIB,
        rss_method=step_mem.method,
        total_peak_gib=all_mem.peak / GIB,
        **_estimate_columns(est),
    )
    row["ratio"] = row["measured_gib"] / row["est_gib"]
    ok = (
        row["resume_equal"]
        and row["probe_finite"]
        and math.isfinite(row["loss"])
        and row["steps"] == STEPS
    )
    row["status"] = "ok" if ok else "FAILED"
    del trainer, model
    gc.collect()
    return row


def rehearse_meta(target: Target, launcher: dict, gpu_memory: float) -> dict:
    """Step 5 of the module docstring: no tensor of the model has storage."""
    spec, tc = target.spec, target.spec.train
    world = ranks_per_run(launcher)
    with PeakRSS() as mem:
        with torch.device("meta"):
            model = build_model(spec.model, initialize=False)
        params = list(model.parameters())
        units = model.fsdp_units()
        unit_params = [sum(p.numel() for p in u.parameters()) for u in units]
        est = estimate_memory(
            spec.model,
            tc.micro_batch_size,
            tc.seq_len,
            bf16=True,
            world=world,
            fsdp=tc.parallel == "fsdp",
            loss_chunk_tokens=tc.loss_chunk_tokens,
            accumulating=tc.micro_batches_per_rank(world) > 1,
        )
    all_meta = all(p.is_meta for p in params) and all(b.is_meta for b in model.buffers())
    units_are_blocks = [id(u) for u in units] == [id(b) for b in model.blocks]
    row = {
        "params": sum(p.numel() for p in params),
        "all_meta": all_meta,
        "fsdp_units": len(units),
        "units_are_blocks": units_are_blocks,
        "largest_unit_params": max(unit_params),
        "root_params": sum(p.numel() for p in params) - sum(unit_params),
        "world": world,
        "parallel": tc.parallel,
        "micro_batch": tc.micro_batch_size,
        "seq_len": tc.seq_len,
        "meta_rss_gib": mem.peak / GIB,
        "gpu_gib": est.total(False) * (1 + HEADROOM) / GIB,
        "gpu_gib_ac": est.total(True) * (1 + HEADROOM) / GIB,
        "needs_ac": est.needs_checkpointing(gpu_memory),
        "fits_with_ac": est.fits(gpu_memory),
    }
    row["status"] = "ok" if all_meta and units_are_blocks else "FAILED"
    return row
