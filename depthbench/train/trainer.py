"""The step loop of one run: a `Trainer` holding the model, optimizer, data and distributed
context, and a list of `Hook`s that do everything around the update (evaluation, dynamics,
metrics, logging, checkpointing, divergence; depthbench.train.hooks).

One step of `Trainer.fit` (the order is part of the numbers: it is the order of the function it
replaced, so weights and metrics.jsonl are bit-identical to it):
1. set the learning rate of step s (lr_at), start an empty record;
2. `on_step_start(trainer, s, record)`: e.g. dynamics, measured on the weights before update s;
3. forward/backward over the micro-batches, train loss averaged over ranks, gradient norm
   (clipped when train.grad_clip is set);
4. `on_gradients(trainer, s, stats)`: may set `trainer.status` to diverged, which stops the run
   before the update;
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
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from depthbench.spec import RunSpec
from depthbench.train import distributed
from depthbench.train.checkpoint import load_latest, save_checkpoint
from depthbench.train.parallelize import parallelize
from depthbench.train.recipe import RunPaths, build_optimizer, lr_at, resolve_dtype

FULL_STATE_FORMAT = "full_by_name"  # checkpoints: unsharded state dicts keyed by parameter name
STATUS_OK = "ok"
STATUS_DIVERGED = "diverged"


@dataclass
class StepStats:
    """What one update measured, before the optimizer applies it."""
    train_loss: float
    grad_norm: float
    lr: float


class Hook:
    """Something done around the update. Every method is a no-op here; override what you need."""

    def on_fit_start(self, trainer: "Trainer") -> None: ...
    def on_step_start(self, trainer: "Trainer", step: int, record: dict[str, Any]) -> None: ...
    def on_gradients(self, trainer: "Trainer", step: int, stats: StepStats) -> None: ...
    def on_step_end(self, trainer: "Trainer", step: int, record: dict[str, Any]) -> None: ...
    def on_log(self, trainer: "Trainer", record: dict[str, Any]) -> None: ...
    def on_step_logged(self, trainer: "Trainer", step: int) -> None: ...
    def on_fit_end(self, trainer: "Trainer") -> None: ...
    def close(self, trainer: "Trainer") -> None: ...


class Trainer:
    """Model, optimizer, data and context of one run, and the state of its step loop.

    Seeding, model construction, wrapping and optimizer creation happen here in the order that
    fixes the initial weights (seed, build, move, checkpointing and compile, DDP/FSDP wrap, AdamW)."""

    def __init__(self, spec: RunSpec, paths: RunPaths, model: torch.nn.Module, batches, ctx: distributed.DistContext,
                 device: torch.device, autocast):
        tc = spec.train
        self.spec, self.tc, self.paths, self.ctx = spec, tc, paths, ctx
        self.device, self.autocast, self.batches = device, autocast, batches
        self.model = model
        # checkpointing, per-block compile, then DDP wrapper / FSDP2 sharding in place (depthbench.train.parallelize)
        self.net, self.step_fn, self.checkpointing = parallelize(model, tc, ctx, device, resolve_dtype(tc.dtype, device))
        self.optimizer = build_optimizer(model, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.adam_eps, device)
        self.hooks: list[Hook] = []
        self.step = self.start_step = 0
        self.wall_before, self.t_start = 0.0, time.time()
        self.status, self.last_val = STATUS_OK, float("nan")
        self.stats: StepStats | None = None

    # ---- state on disk
    def restore(self) -> bool:
        """Load the run's latest checkpoint, if any: weights, optimizer, RNG, step, clock."""
        state = load_latest(self.paths.checkpoints, self.spec.run_id)
        if state is None:
            return False
        if state.get("state_format") == FULL_STATE_FORMAT:  # any rank count, any strategy
            distributed.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        else:  # checkpoints written before distributed training: one rank
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if self.device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.step = self.start_step = state["step"]
        self.wall_before = state["wall_seconds"]
        self.last_val = state.get("last_val", float("nan"))
        print(f"[{self.spec.run_id}] rank {self.ctx.rank}/{self.ctx.world_size} resumed from step {self.start_step}", file=sys.stderr)
        return True

    def snapshot(self) -> None:
        """Checkpoint the current step (a collective under FSDP; rank 0 writes)."""
        model_state, optim_state = distributed.full_state(self.model, self.optimizer, self.ctx)
        if self.ctx.is_main:
            tc, step = self.tc, self.step
            save_checkpoint(self.paths.checkpoints, step, {
                "run_id": self.spec.run_id, "step": step, "model": model_state,
                "optimizer": optim_state, "state_format": FULL_STATE_FORMAT, "world_size": self.ctx.world_size,
                "schedule": {"step": step, "total_steps": tc.total_steps, "warmup_steps": tc.warmup_steps},
                "data_position": {"samples_consumed": step * tc.global_batch_size},
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None},
                "wall_seconds": self.wall_seconds(), "last_val": self.last_val,
            })
        distributed.barrier(self.ctx)

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

    def forward_backward(self) -> tuple[float, float]:
        """Accumulate the gradient of step `self.step` over its micro-batches; return the train
        loss (mean over micro-batches and ranks) and the gradient norm (clipped in place)."""
        batches, tc = self.batches, self.tc
        loss_sum = 0.0
        for micro in range(batches.accum_steps):
            x, y = batches.get(self.step, micro)
            last_micro = micro == batches.accum_steps - 1
            # gradients are averaged over ranks once per step, on the last micro-batch
            with distributed.gradient_sync(self.net, self.ctx, last_micro):
                with self.autocast:
                    out = self.step_fn(x.to(self.device), y.to(self.device))
                loss = out.loss
                objective = loss if out.aux_loss is None else loss + out.aux_loss  # MoE load balancing
                (objective / batches.accum_steps).backward()
            loss_sum += loss.item()
        train_loss = distributed.all_reduce_mean(loss_sum / batches.accum_steps, self.ctx, self.device)
        max_norm = tc.grad_clip if tc.grad_clip is not None else float("inf")  # inf: measure, do not clip
        grad_norm = distributed.scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        return train_loss, grad_norm


def is_bad(value: float, limit: float) -> bool:
    """A loss that counts as divergence: NaN/inf or above `limit`."""
    return not math.isfinite(value) or value > limit

