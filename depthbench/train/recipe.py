"""The training recipe: learning-rate schedule, AdamW and its decay groups, device and dtype,
where a run writes, and the validation loss. The step loop that uses them is
depthbench.train.trainer.

Recipe: AdamW (decoupled weight decay on the weights of every Linear layer, LM head included, and
on MoE expert matrices; none on the input embedding, norm gains, pseudo-queries or HC/mHC static
weights and biases), gradient clipping, linear warmup
over `warmup_fraction` of the steps then cosine decay to `min_lr_ratio` x lr, the global batch
reached by gradient accumulation, bf16 autocast on GPU and fp32 on CPU, deterministic seeding.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from depthbench.data.loader import TokenWindows, eval_batches
from depthbench.train.optimizer import AdamW
from depthbench.util.io import atomic_write


def lr_at(step: int, base_lr: float, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to base_lr over `warmup` steps, then cosine decay to min_ratio * base_lr."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return base_lr * (min_ratio + (1.0 - min_ratio) * cosine)


def build_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    device: torch.device,
) -> torch.optim.AdamW:
    """AdamW (torch's, without its eager torch._dynamo import: depthbench.train.optimizer) over
    `param_groups`, fused (one kernel for all parameters) on CUDA and on the CPU, where the
    per-parameter loop costs several times the fused kernel's time on small models with many
    small tensors (mhc). Elsewhere (MPS) the default implementation."""
    return AdamW(
        param_groups(model, weight_decay),
        lr=lr,
        betas=betas,
        eps=eps,
        fused=device.type in ("cuda", "cpu"),
    )


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay the weights of Linear layers and MoE expert matrices; nothing else (embedding, norm
    gains, pseudo-queries, HC/mHC static weights and biases, scalar gains)."""
    decay_ids = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            decay_ids.add(id(module.weight))
        elif hasattr(module, "init_weights"):  # MoE experts
            decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if id(p) in decay_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class RunPaths:
    """Where a run writes: declared outputs in `run_dir`, resumable state in `work_dir`."""

    def __init__(self, run_dir: str | os.PathLike, work_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.work_dir = Path(work_dir)
        self.checkpoints = self.work_dir / "checkpoints"
        self.metrics = self.work_dir / "metrics.jsonl"
        self.summary = self.run_dir / "summary.json"
        self.weights = self.run_dir / "model.safetensors"
        self.curves = self.run_dir / "metrics.jsonl"


def truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines after `step`: they came from the part of the run that is being redone."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    atomic_write(path, lambda tmp: Path(tmp).write_text("".join(line + "\n" for line in kept)))


@torch.no_grad()
def evaluate(
    model, windows: TokenWindows, n_batches: int, micro_batch: int, device, autocast
) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in eval_batches(windows, n_batches, micro_batch):
        with autocast:
            loss = model(x.to(device), y.to(device)).loss
        total += loss.item() * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count
