"""The step loop of one run: a `Trainer` holding the model, optimizer, data and distributed
context, and a list of `Hook`s that do everything around the update (evaluation, dynamics,
metrics, logging, checkpointing, divergence; depthbench.train.hooks).

One step of `Trainer.fit` (the order is part of the numbers: weights and metrics.jsonl depend on
it, and the tests hold resumed and interrupted runs to it bit for bit):
1. set the learning rate of step s (lr_at), start an empty record;
2. `on_step_start(trainer, s, record)`: e.g. dynamics, measured on the weights before update s;
3. forward/backward over the micro-batches, train loss averaged over ranks, gradient norm
   (clipped when train.grad_clip is set), both kept as device tensors: no host sync in steps
   1-6 except where a hook reads a number (log, eval, checkpoint steps; see hooks);
4. `on_gradients(trainer, s, stats)`: may set `trainer.status` to diverged, which stops the run
   before the update (the divergence hook checks at its check steps, see DivergenceHook);
5. optimizer step; `trainer.step` becomes s + 1;
6. `on_step_end(trainer, s + 1, record)`: hooks add their entries to the record;
7. a non-empty record is logged as {"step", "tokens", **record} through every hook's `on_log`;
8. a diverged status stops the run here; else `on_step_logged(trainer, s + 1)` (checkpoints:
   after the step's line, so that a resumed run keeps it).
`on_fit_start` runs before the first step, `on_fit_end` after a loop that ended without an
exception, `close` always. A new logger is a Hook with an `on_log` method: nothing here changes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from depthbench.spec.run import RunSpec
from depthbench.train import distributed, resume
from depthbench.train.checkpoint import Checkpointer
from depthbench.train.hook_base import Hook
from depthbench.train.parallelize import parallelize
from depthbench.train.recipe import RunPaths, build_optimizer, lr_at, resolve_dtype

STATUS_OK = "ok"
STATUS_DIVERGED = "diverged"


@dataclass
class StepStats:
    """What one update measured, before the optimizer applies it. The loss and the norm are 0-d
    device tensors in a run (read on the host only where a hook needs the number, see
    `read_scalars`); plain floats are accepted too."""

    train_loss: torch.Tensor | float
    grad_norm: torch.Tensor | float
    lr: float


class Trainer:
    """Model, optimizer, data and context of one run, and the state of its step loop.

    Seeding, model construction, wrapping and optimizer creation happen here in the order that
    fixes the initial weights (seed, build, move, checkpointing and compile, DDP/FSDP wrap,
    AdamW)."""

    def __init__(
        self,
        spec: RunSpec,
        paths: RunPaths,
        model: torch.nn.Module,
        batches,
        ctx: distributed.DistContext,
        device: torch.device,
        autocast,
    ):
        tc = spec.train
        self.spec, self.tc, self.paths, self.ctx = spec, tc, paths, ctx
        self.device, self.autocast, self.batches = device, autocast, batches
        self.model = model
        # training's loss in chunks (depthbench.models.loss)
        model.loss_chunk_tokens = tc.loss_chunk_tokens
        # checkpointing, per-block compile, then DDP wrapper / FSDP2 sharding in place
        # (depthbench.train.parallelize)
        self.net, self.step_fn, self.checkpointing = parallelize(
            model, tc, ctx, device, resolve_dtype(tc.dtype, device)
        )
        self.optimizer = build_optimizer(
            model, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.adam_eps, device
        )
        self.hooks: list[Hook] = []
        self.step = self.start_step = 0
        self.wall_before, self.t_start = 0.0, time.time()
        self.status, self.last_val = STATUS_OK, float("nan")
        self.stats: StepStats | None = None
        # on every rank: creates the saves' gloo group
        self.checkpointer = Checkpointer(paths.checkpoints, ctx)

    # ---- state on disk
    def restore(self) -> bool:
        """Load the run's latest checkpoint, if any: weights, optimizer, RNG, step, clock."""
        return resume.restore(self)

    def snapshot(self, blocking: bool = False) -> None:
        """Checkpoint the current step (every rank writes its part; see depthbench.train.resume)."""
        resume.snapshot(self, blocking)

    def wall_seconds(self) -> float:
        """Training wall time of the run so far, earlier processes included."""
        return self.wall_before + (time.time() - self.t_start)

    # ---- the loop
    def _call(self, name: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, name)(self, *args)

    def log(self, record: dict[str, Any]) -> None:
        """Hand a metrics record to every hook's `on_log` (metrics.jsonl, trackers, progress)."""
        self._call("on_log", record)

    def fit(self, stop_after: int | None = None) -> None:
        """Run steps until total_steps, divergence, or `stop_after` steps of this process."""
        tc = self.tc
        self._call("on_fit_start")
        self.t_start = time.time()
        self.model.train()
        try:
            while self.step < tc.total_steps:
                if stop_after is not None and self.step - self.start_step >= stop_after:
                    break
                if not self._one_step():
                    break
            self._call("on_fit_end")
        finally:
            self._call("close")

    def _one_step(self) -> bool:
        """Steps 1-8 of the module docstring; False when the run must stop."""
        s, tc = self.step, self.tc
        lr = lr_at(s, tc.lr, tc.total_steps, tc.warmup_steps, tc.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        record: dict[str, Any] = {}
        self._call("on_step_start", s, record)
        self.stats = StepStats(*self.forward_backward(), lr)
        self._call("on_gradients", s, self.stats)
        if self.status == STATUS_DIVERGED:
            return False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = s + 1
        self._call("on_step_end", self.step, record)
        if record:
            self.log({"step": self.step, "tokens": self.step * tc.tokens_per_step, **record})
        if self.status == STATUS_DIVERGED:
            return False
        self._call("on_step_logged", self.step)
        return True

    def forward_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate the gradient of step `self.step` over its micro-batches; return the train
        loss (mean over micro-batches and ranks) and the gradient norm (clipped in place).

        Both stay 0-d tensors on the device: nothing here reads a value on the host, so the
        host queues the next micro-batch's kernels while the device still runs this one. The
        hooks read them only at log steps and divergence checks (depthbench.train.hooks).
        The loss is summed in float64 in micro-batch order, the very additions of a Python
        float sum (`loss_sum += loss.item()`), so the logged losses are bit-identical to
        one, without its host read per micro-batch."""
        batches, tc = self.batches, self.tc
        loss_sum = torch.zeros((), dtype=accumulator_dtype(self.device), device=self.device)
        for micro in range(batches.accum_steps):
            x, y = batches.get(self.step, micro)
            last_micro = micro == batches.accum_steps - 1
            # gradients are averaged over ranks once per step, on the last micro-batch
            with distributed.gradient_sync(self.net, self.ctx, last_micro):
                with self.autocast:
                    out = self.step_fn(to_device(x, self.device), to_device(y, self.device))
                loss = out.loss
                # MoE load balancing
                objective = loss if out.aux_loss is None else loss + out.aux_loss
                (objective / batches.accum_steps).backward()
            loss_sum = loss_sum + loss.detach().to(loss_sum.dtype)
        train_loss = distributed.all_reduce_mean_tensor(loss_sum / batches.accum_steps, self.ctx)
        # inf: measure, do not clip
        max_norm = tc.grad_clip if tc.grad_clip is not None else float("inf")
        grad_norm = distributed.local_tensor(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        )
        return train_loss, grad_norm


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on `device` without waiting for it: on CUDA a copy from pageable memory blocks
    the host until the device has run everything queued (the previous micro-batch's backward);
    from pinned memory, non_blocking, it is queued behind that work instead."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def accumulator_dtype(device: torch.device) -> torch.dtype:
    """float64 for the loss sum (the additions of Python floats), float32 where the device has
    no float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def read_scalars(*values) -> list[float]:
    """Python floats of 0-d tensors (or floats) with one host read: the tensors are stacked on
    their device and copied once, instead of one blocking `.item()` each."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    dev = tensors[0].device
    dtype = accumulator_dtype(dev)
    stacked = torch.stack(
        [
            v.reshape(()).to(device=dev, dtype=dtype)
            if isinstance(v, torch.Tensor)
            else torch.full((), float(v), dtype=dtype, device=dev)
            for v in values
        ]
    )
    return stacked.tolist()


def is_bad(value: float, limit: float) -> bool:
    """A loss that counts as divergence: NaN/inf or above `limit`."""
    return not math.isfinite(value) or value > limit
