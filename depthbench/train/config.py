"""The training recipe of one run, resolved from the config (all numbers final)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class TrainConfig:
    lr: float = 3e-4
    seed: int = 0
    seq_len: int = 2048
    global_batch_size: int = 512
    micro_batch_size: int = 8
    tokens_per_param: float = 20.0
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
    compile: bool = False
    dynamics_every: int = 0  # measure norm and gradient dynamics every k steps; 0 = off
    parallel: str = "ddp"  # data parallelism when the launcher starts several ranks: ddp or fsdp

    # Settings that do not change the trained weights or the logged curves, so they are left
    # out of the run id's hash: changing them must not start new runs.
    NOT_HASHED = ("checkpoint_every", "log_every", "threads", "device", "compile", "parallel")

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup_fraction * self.total_steps))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def hashed_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in self.NOT_HASHED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
