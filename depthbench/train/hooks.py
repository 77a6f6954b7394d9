"""The hooks of a training run (see depthbench.train.trainer for when each method runs; their
order in a run is depthbench.train.hook_order). Each works alone on any object with the Trainer
attributes it reads, so it can be tested alone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from depthbench.train.dynamics import measure as measure_dynamics
from depthbench.train.flops import mfu
from depthbench.train.hook_base import Hook
from depthbench.train.recipe import evaluate, truncate_metrics
from depthbench.train.trainer import (
    STATUS_DIVERGED,
    STATUS_OK,
    StepStats,
    accumulator_dtype,
    is_bad,
    read_scalars,
)


def _due(step: int, every: int, total: int) -> bool:
    """Steps at which a periodic hook acts: every `every` steps and at the last step."""
    return step % every == 0 or step == total


class DynamicsHook(Hook):
    """Norm and gradient dynamics (depthbench.train.dynamics) on the first micro-batch of every
    `every`-th step, measured on the weights before that step's update."""

    def __init__(self, every: int):
        self.every = every

    def on_step_start(self, trainer, step, record):
        if self.every and step % self.every == 0:
            x, y = trainer.batches.get(step, 0)
            x, y = x.to(trainer.device), y.to(trainer.device)
            record["dynamics"] = {
                "after_updates": step,
                **measure_dynamics(trainer.model, x, y, trainer.autocast),
            }


class TrainMetricsHook(Hook):
    """Every `log_every` steps (and the last): train loss, learning rate and gradient norm of the
    step, global tokens per second since the previous log line, and MFU per rank against the
    spec-sheet peak (`mfu`, NaN when unknown) and the matmul peak measured at start
    (`mfu_measured`); see depthbench.train.flops."""

    def __init__(
        self,
        log_every: int,
        total: int,
        tokens_per_step: int,
        flops_per_token: float,
        peak: float | None,
        measured_peak: float | None,
        world_size: int,
    ):
        self.log_every, self.total, self.tokens_per_step = log_every, total, tokens_per_step
        self.flops_per_token, self.peak, self.measured_peak, self.world_size = (
            flops_per_token,
            peak,
            measured_peak,
            world_size,
        )
        self.t_window, self.tokens_window = time.time(), 0

    def on_fit_start(self, trainer):
        self.t_window, self.tokens_window = time.time(), 0

    def on_step_end(self, trainer, step, record):
        self.tokens_window += self.tokens_per_step
        if not _due(step, self.log_every, self.total):
            return
        elapsed = time.time() - self.t_window
        tps = self.tokens_window / elapsed if elapsed > 0 else float("nan")
        s: StepStats = trainer.stats
        train_loss, grad_norm = read_scalars(s.train_loss, s.grad_norm)  # the step's one host read
        record.update(
            train_loss=train_loss,
            lr=s.lr,
            grad_norm=grad_norm,
            tokens_per_s=tps,
            mfu=mfu(tps, self.flops_per_token, self.peak, self.world_size),
            mfu_measured=mfu(tps, self.flops_per_token, self.measured_peak, self.world_size),
        )
        self.t_window, self.tokens_window = time.time(), 0


class EvalHook(Hook):
    """The validation loss every `every` steps (and at the last); kept as `trainer.last_val`."""

    def __init__(self, windows, every: int, total: int, n_batches: int, micro_batch: int):
        self.windows, self.every, self.total = windows, every, total
        self.n_batches, self.micro_batch = n_batches, micro_batch

    def on_step_end(self, trainer, step, record):
        if _due(step, self.every, self.total):
            trainer.last_val = evaluate(
                trainer.model,
                self.windows,
                self.n_batches,
                self.micro_batch,
                trainer.device,
                trainer.autocast,
            )
            record["val_loss"] = trainer.last_val


class DivergenceHook(Hook):
    """Stops the run as `diverged` when the train loss or gradient norm is NaN/inf or the train
    loss exceeds `limit` (= divergence_factor x ln(vocab)), before an update, logging an
    `event: diverged` line; or when the step's validation loss (from EvalHook) is.

    Without a host sync each step: every step's test runs on the device and is folded into a
    flag, with the (step, train loss, gradient norm, lr) of the first bad step kept beside it.
    The flag is read on the host only at check steps: steps whose number (after the update) is a
    multiple of one of `every` (log_every, eval_every and checkpoint_every: the steps that read
    numbers or write a checkpoint anyway, so that no checkpoint holds a diverged state) and the
    last step; with `every` = (1,) each step. A bad step stops the run at the next check step,
    before that step's update (at once when the bad step is itself a check step, as with
    log_every 1); the event line names the first bad step and its values. At the end of a fit
    (a process stopped on purpose) the flag is read once more."""

    def __init__(self, limit: float, every: tuple[int, ...] = (1,), total: int | None = None):
        self.limit, self.every, self.total = limit, tuple(e for e in every if e), total
        self.flag: torch.Tensor | None = None  # True once a step has been bad (device)
        self.first: torch.Tensor | None = (
            None  # (step, train loss, grad norm, lr) of the first bad step
        )

    def check_due(self, step: int) -> bool:
        """Whether the flag is read after the gradients of the update that ends at `step`."""
        return step == self.total or any(step % e == 0 for e in self.every)

    def on_gradients(self, trainer, step, stats):
        loss, norm = (
            v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            for v in (stats.train_loss, stats.grad_norm)
        )
        dtype = accumulator_dtype(loss.device)
        loss, norm = loss.to(dtype), norm.to(device=loss.device, dtype=dtype)
        # is_bad, on the device
        bad = ~torch.isfinite(loss) | (loss > self.limit) | ~torch.isfinite(norm)
        # torch.full, not torch.tensor: a fill kernel, where a host-to-device copy would wait for
        # the device
        now = torch.stack(
            [
                torch.full((), float(step), dtype=dtype, device=loss.device),
                loss,
                norm,
                torch.full((), float(stats.lr), dtype=dtype, device=loss.device),
            ]
        )
        if self.flag is None:
            self.flag, self.first = bad, now
        else:  # keep the first bad step's values once the flag is up
            self.first = torch.where(self.flag, self.first, now)
            self.flag = self.flag | bad
        if self.check_due(step + 1):
            self._check(trainer)

    def _check(self, trainer) -> None:
        flag, first_step, loss, norm, lr = torch.cat(
            [self.flag.to(self.first.dtype).reshape(1), self.first]
        ).tolist()
        if flag:
            trainer.status = STATUS_DIVERGED
            trainer.log(
                {
                    "step": int(first_step) + 1,
                    "train_loss": loss,
                    "grad_norm": norm,
                    "lr": lr,
                    "event": "diverged",
                }
            )
        self.flag = self.first = None  # checked: the next step starts a fresh flag

    def on_step_end(self, trainer, step, record):
        if "val_loss" in record and is_bad(record["val_loss"], self.limit):
            trainer.status = STATUS_DIVERGED

    def on_fit_end(self, trainer):
        if self.flag is not None and trainer.status == STATUS_OK:
            self._check(trainer)


class CheckpointHook(Hook):
    """A checkpoint every `every` steps (not at the last: the run's outputs are written then;
    asynchronous with several ranks, see depthbench.train.checkpoint), and one, complete on
    return, where the process stops early on purpose (stop_after)."""

    def __init__(self, every: int, total: int):
        self.every, self.total = every, total

    def on_step_logged(self, trainer, step):
        if step % self.every == 0 and step < self.total:
            trainer.snapshot()

    def on_fit_end(self, trainer):
        if trainer.status == STATUS_OK and trainer.step < self.total:
            trainer.snapshot(blocking=True)

    # an asynchronous save still in flight completes before the run goes on
    def close(self, trainer):
        trainer.checkpointer.wait()


class ProgressHook(Hook):
    """A tqdm bar on stderr with the latest train loss and tokens per second."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.bar = total, desc, None

    def on_fit_start(self, trainer):
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.total, initial=trainer.step, desc=self.desc, file=sys.stderr, mininterval=2.0
        )

    def on_step_end(self, trainer, step, record):
        self.bar.update(1)

    def on_log(self, trainer, record):
        if "tokens_per_s" in record and self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['train_loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}"
            )

    def close(self, trainer):
        if self.bar is not None:
            self.bar.close()


class JsonlLogger(Hook):
    """metrics.jsonl in the work dir, the source of truth for curves: one JSON object per line.
    A resumed run first drops the lines after its checkpoint (that part is redone); a fresh run
    starts the file anew."""

    def __init__(self, path: str | Path):
        self.path, self.file = Path(path), None

    def on_fit_start(self, trainer):
        if trainer.start_step:
            truncate_metrics(self.path, trainer.start_step)
        else:
            self.path.unlink(missing_ok=True)
        self.file = open(self.path, "a")

    def on_log(self, trainer, record):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self, trainer):
        if self.file is not None:
            self.file.close()
