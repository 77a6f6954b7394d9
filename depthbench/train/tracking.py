"""Experiment trackers for `train.loggers: [tensorboard, wandb]` (optional packages: the tracking
extra, `bash scripts/setup.sh tracking`). metrics.jsonl stays the source of truth: a tracker
receives the same records, flattened to scalars (`flatten`), on rank 0 only.

What a run shows in either tracker: every metrics record (train/loss, train/lr, train/grad_norm,
perf/tokens_per_s, perf/mfu, perf/mfu_measured, val/loss, and the dynamics records as
dynamics/<quantity>/<layer or module>) against the training step; the run's full spec as its
config; its experiment name (the config's `name`) and tags arch, shape, lr and seed.
- TensorBoard: one event directory per run, `<work_dir>/tensorboard`; tags and experiment in
  the HParams dashboard (filter and group by them), the spec as the text summary `config`. A
  resumed run purges the events after its checkpoint step (SummaryWriter(purge_step)), as
  metrics.jsonl drops those lines.
- wandb: offline unless WANDB_MODE says otherwise (no network, no login prompt in a batch job);
  the run folder is `<work_dir>/wandb/offline-run-*` (upload later with `wandb sync`); project
  WANDB_PROJECT or "depthbench", group = experiment name, name = run id, and an id derived from
  the run id so that a resumed run continues the same wandb run. The step is logged as the
  metric `step` and declared as every metric's x-axis, so redone steps after a resume do not
  clash with wandb's own monotonic step counter.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from depthbench.util.errors import ConfigError
from depthbench.train.hook_base import Hook

SCALAR_NAMES = {
    "train_loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "val_loss": "val/loss",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "mfu_measured": "perf/mfu_measured",
}


def check_loggers(names: list[str]) -> None:
    """Fail before training when a logger is unknown or its package is not installed."""
    for name in names:
        if name not in LOGGERS:
            raise ConfigError("train.loggers", f"unknown logger {name!r}; valid: {sorted(LOGGERS)}")
        kind = LOGGERS[name]
        if kind.module and importlib.util.find_spec(kind.module) is None:
            raise ConfigError(
                "train.loggers",
                f"{name!r} needs the package {kind.module!r}: "
                f"bash scripts/setup.sh tracking (or pip install {kind.requirement})",
            )


def flatten(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record under tracker names; dynamics lists by index, dicts by
    key."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in SCALAR_NAMES:
            out[SCALAR_NAMES[key]] = float(value)
    for quantity, values in record.get("dynamics", {}).items():
        if quantity == "after_updates":
            out["dynamics/after_updates"] = float(values)
        elif isinstance(values, dict):
            out.update({f"dynamics/{quantity}/{name}": float(v) for name, v in values.items()})
        else:
            out.update({f"dynamics/{quantity}/{i}": float(v) for i, v in enumerate(values)})
    return out


def run_tags(spec, experiment: str) -> dict[str, Any]:
    """What a run is grouped and filtered by in a tracker."""
    return {
        "experiment": experiment,
        "arch": spec.arch,
        "shape": spec.shape.tag,
        "lr": spec.lr,
        "seed": spec.seed,
    }


class TensorBoardLogger(Hook):
    """Scalars, hparams and the config of one run in `<work_dir>/tensorboard`."""

    def __init__(self, log_dir: str | Path):
        self.log_dir, self.writer = Path(log_dir), None

    def on_fit_start(self, trainer):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        resumed = trainer.start_step > 0
        if not resumed and self.log_dir.exists():  # a fresh run must not show an earlier attempt
            shutil.rmtree(self.log_dir)
        self.writer = SummaryWriter(
            str(self.log_dir), purge_step=trainer.start_step + 1 if resumed else None
        )
        if not resumed:
            tags = run_tags(trainer.spec, trainer.tc.experiment)
            # hparams into this run's own directory (add_hparams would open a sub-run)
            for summary in hparams(tags, {"val/loss": float("nan")}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text(
                "config", "```\n" + json.dumps(trainer.spec.to_dict(), indent=1) + "\n```", 0
            )

    def on_log(self, trainer, record):
        for tag, value in flatten(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self, trainer):
        if self.writer is not None:
            self.writer.close()


class WandbLogger(Hook):
    """One wandb run per DepthBench run, offline by default, under `<work_dir>/wandb`."""

    def __init__(self, work_dir: str | Path):
        self.work_dir, self.run = Path(work_dir), None

    def on_fit_start(self, trainer):
        import wandb

        spec, experiment = trainer.spec, trainer.tc.experiment
        tags = run_tags(spec, experiment)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "depthbench"),
            group=experiment or None,
            job_type="train",
            name=spec.run_id,
            id=wandb_id(spec.run_id),
            resume="allow",
            dir=str(self.work_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config={**spec.to_dict(), "experiment": experiment},
            tags=[
                str(tags["arch"]),
                str(tags["shape"]),
                f"lr{tags['lr']:g}",
                f"seed{tags['seed']}",
            ],
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def on_log(self, trainer, record):
        self.run.log({"step": record["step"], **flatten(record)})

    def close(self, trainer):
        if self.run is not None:
            self.run.finish()


def wandb_id(run_id: str) -> str:
    """A wandb run id for `run_id`: stable across restarts, only [a-z0-9], at most 32 characters."""
    return hashlib.sha256(run_id.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class LoggerKind:
    """A tracker: how to make its hook from the run's work dir, and the package it needs."""

    make: Callable[[Path], Hook]
    module: str | None = None
    requirement: str | None = None


# train.loggers name -> tracker. A new tracker is one entry here (and in the schema's enum).
LOGGERS: dict[str, LoggerKind] = {
    "tensorboard": LoggerKind(
        lambda work_dir: TensorBoardLogger(work_dir / "tensorboard"),
        "tensorboard",
        "tensorboard==2.21.0",
    ),
    "wandb": LoggerKind(WandbLogger, "wandb", "wandb==0.31.0"),
}


def build_loggers(names: list[str], work_dir: str | Path) -> list[Hook]:
    """The tracker hooks named in train.loggers, after check_loggers."""
    check_loggers(names)
    return [LOGGERS[name].make(Path(work_dir)) for name in names]
