"""The training recipe of one run, resolved from the config (all numbers final).

Its defaults are those of the config schema's `train` section (workflow/schemas/config.schema.yaml)
for every setting the schema carries; tests/unit/test_defaults.py holds every field to it or
names why the schema has none (lr, total_steps, experiment, snapshot_steps: set per run)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from depthbench.util.errors import ConfigError


@dataclass
class TrainConfig:
    lr: float = 3e-4
    seed: int = 0
    seq_len: int = 2048
    global_batch_size: int = 512
    micro_batch_size: int = 8
    tokens_per_param: float = 20  # the schema's integer: the run id hashes it as written
    max_steps: int | None = None
    total_steps: int = 1  # resolved: tokens_per_param * n_params / tokens per step, capped
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float | None = 1.0
    warmup_fraction: float = 0.1
    min_lr_ratio: float = 0.1
    eval_every: int = 200
    eval_batches: int = 20
    checkpoint_every: int = 500
    log_every: int = 10
    divergence_factor: float = 1.5
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 1
    compile: str | bool = (
        "none"  # none, model or block (depthbench.train.parallelize); legacy booleans
    )
    activation_checkpointing: str = (
        "auto"  # auto, none, full or selective (depthbench.train.parallelize)
    )
    kernels: str = "auto"  # auto: the device's fast implementations; reference (kernels.swap)
    loss_chunk_tokens: int = (
        4096  # LM head + loss this many tokens at a time (depthbench.models.loss); 0 = off
    )
    dynamics_every: int = 0  # measure norm and gradient dynamics every k steps; 0 = off
    parallel: str = "ddp"  # data parallelism when the launcher starts several ranks: ddp or fsdp
    loggers: list[str] = field(
        default_factory=list
    )  # experiment trackers (depthbench.train.tracking)
    experiment: str = (
        ""  # the config's `name`, set with the operational settings; trackers group by it
    )
    snapshot_steps: list[int] = field(
        default_factory=list
    )  # weights kept at these steps (probes.at_steps; depthbench.train.snapshots)

    # Settings that do not change the trained weights or the logged curves, so they are left
    # out of the run id's hash: changing them must not start new runs.
    NOT_HASHED = (
        "checkpoint_every",
        "log_every",
        "threads",
        "device",
        "compile",
        "parallel",
        "loggers",
        "experiment",
        "loss_chunk_tokens",
        "snapshot_steps",
        "activation_checkpointing",
        "kernels",
    )

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def micro_batches_per_rank(self, world: int) -> int:
        """Micro-batches each of `world` ranks runs per optimizer step (its gradients persist
        between them when more than one)."""
        return self.global_batch_size // (self.micro_batch_size * world)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup_fraction * self.total_steps))

    def check(self, world_size: int = 1) -> None:
        """The checks of the training settings that the schema cannot express, in one place:
        depthbench.grid.config.expand_grid runs them for every run of the grid with one rank (before
        anything starts), the trainer again with the run's actual rank count (known only then)."""
        if self.parallel == "fsdp" and self.dynamics_every:
            raise ConfigError(
                "train.dynamics_every",
                "training dynamics are measured with DDP or on one rank; set 0 with "
                "train.parallel: fsdp",
            )
        if self.global_batch_size % (self.micro_batch_size * world_size):
            ranks = f" x {world_size} ranks" if world_size > 1 else ""
            raise ConfigError(
                "train.micro_batch_size",
                f"global batch {self.global_batch_size} must be a multiple of micro batch "
                f"{self.micro_batch_size}{ranks}; choose a micro batch that divides "
                f"{self.global_batch_size // world_size}",
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def hashed_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in self.NOT_HASHED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
