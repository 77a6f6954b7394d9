"""The training loop of one run.

Recipe: AdamW (decoupled weight decay on the weights of every Linear layer, LM head included, and
on MoE expert matrices; none on the input embedding, norm gains, pseudo-queries or HC/mHC static
weights and biases), gradient clipping, linear warmup
over `warmup_fraction` of the steps then cosine decay to `min_lr_ratio` x lr, the global batch
reached by gradient accumulation, bf16 autocast on GPU and fp32 on CPU, deterministic seeding.

A run resumes from its latest checkpoint and ends with exactly the weights of an uninterrupted run
on the same device and thread count (the data position is the step; see depthbench.data.loader).
A run whose loss turns NaN/inf or exceeds divergence_factor x ln(vocab) stops with status
`diverged`; its summary is still written so that the workflow goes on.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from depthbench.spec import RunSpec
from depthbench.data.loader import TokenWindows, TrainBatches, eval_batches
from depthbench.data.shards import read_meta, split_files
from depthbench.io import atomic_write, atomic_write_json
from depthbench.models import build_model
from depthbench.errors import ConfigError
from depthbench.train import distributed
from depthbench.train.checkpoint import load_latest, save_checkpoint
from depthbench.train.dynamics import measure as measure_dynamics
from depthbench.train.flops import device_peak_flops, train_flops_per_token

FULL_STATE_FORMAT = "full_by_name"  # checkpoints: unsharded state dicts keyed by parameter name
STATUS_OK = "ok"
STATUS_DIVERGED = "diverged"


def lr_at(step: int, base_lr: float, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to base_lr over `warmup` steps, then cosine decay to min_ratio * base_lr."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return base_lr * (min_ratio + (1.0 - min_ratio) * cosine)


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW over `param_groups`, fused (one kernel for all parameters) on CUDA and on the CPU:
    on the CPU the per-parameter loop costs about 7 ms per step for a 0.6M-parameter pre_ln model
    and 14 ms for mhc, with its 147 small tensors; the fused kernel 1.1 and 2.7 ms
    (2 threads). Elsewhere (MPS) the default implementation."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                             fused=device.type in ("cuda", "cpu"))


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


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines after `step`: they came from the part of the run that is being redone."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    atomic_write(path, lambda tmp: Path(tmp).write_text("".join(line + "\n" for line in kept)))


@torch.no_grad()
def evaluate(model, windows: TokenWindows, n_batches: int, micro_batch: int, device, autocast) -> float:
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


def train(spec: RunSpec, data_dir: str | os.PathLike, paths: RunPaths, progress: bool = True, stop_after: int | None = None) -> dict[str, Any]:
    """Train `spec` to completion (or divergence) and write its outputs; return the summary.

    `stop_after` ends the process-level loop early after that many steps (tests use it to
    simulate an interruption); it is not part of the run's identity.
    """
    cfg, tc = spec.model, spec.train
    torch.set_num_threads(tc.threads)
    ctx, device_name = distributed.setup(tc.parallel, tc.device)
    if ctx.strategy == "fsdp" and tc.dynamics_every:
        raise ConfigError("train.dynamics_every", "training dynamics are measured with DDP or on one rank; set 0 with train.parallel: fsdp")
    device = resolve_device(device_name)
    if device.type == "cuda":  # TF32 for the few fp32 matmuls left outside bf16 autocast
        torch.set_float32_matmul_precision("high")
    dtype = resolve_dtype(tc.dtype, device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    if ctx.is_main:
        paths.checkpoints.mkdir(parents=True, exist_ok=True)

    meta = read_meta(data_dir)
    if meta["vocab_size"] != cfg.vocab_size:
        raise ValueError(f"{data_dir}: shards have vocab {meta['vocab_size']}, model expects {cfg.vocab_size}")
    train_windows = TokenWindows(split_files(data_dir, meta, "train"), meta["dtype"], tc.seq_len)
    val_windows = TokenWindows(split_files(data_dir, meta, "val"), meta["dtype"], tc.seq_len)
    if tc.global_batch_size % (tc.micro_batch_size * ctx.world_size):
        raise ConfigError("train.micro_batch_size", f"global batch {tc.global_batch_size} must be a multiple of micro batch "
                          f"{tc.micro_batch_size} x {ctx.world_size} ranks; choose a micro batch that divides {tc.global_batch_size // ctx.world_size}")
    batches = TrainBatches(train_windows, tc.seed, tc.global_batch_size, tc.micro_batch_size, ctx.rank, ctx.world_size)

    torch.manual_seed(tc.seed)
    model = build_model(cfg).to(device)
    n_params = model.num_parameters()
    flops_per_token = train_flops_per_token(model, tc.seq_len)
    net = distributed.wrap(model, ctx, device)  # DDP wrapper, or `model` itself (sharded in place by FSDP2)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.adam_eps, device)
    step_fn = torch.compile(net) if tc.compile else net

    start_step, wall_before = 0, 0.0
    status, last_val = STATUS_OK, float("nan")
    state = load_latest(paths.checkpoints, spec.run_id)
    if state is not None:
        if state.get("state_format") == FULL_STATE_FORMAT:  # any rank count, any strategy
            distributed.load_full_state(model, optimizer, state["model"], state["optimizer"])
        else:  # checkpoints written before distributed training: one rank
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        start_step, wall_before = state["step"], state["wall_seconds"]
        last_val = state.get("last_val", float("nan"))
        if ctx.is_main:
            _truncate_metrics(paths.metrics, start_step)
        print(f"[{spec.run_id}] rank {ctx.rank}/{ctx.world_size} resumed from step {start_step}", file=sys.stderr)
    elif ctx.is_main:
        paths.metrics.unlink(missing_ok=True)
    distributed.barrier(ctx)

    peak = device_peak_flops(device, dtype)
    diverge_at = tc.divergence_factor * math.log(cfg.vocab_size)
    bar = None
    if progress and ctx.is_main:
        from tqdm import tqdm

        bar = tqdm(total=tc.total_steps, initial=start_step, desc=spec.run_id, file=sys.stderr, mininterval=2.0)
    metrics_file = open(paths.metrics, "a") if ctx.is_main else None

    def log(record: dict[str, Any]) -> None:
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    def snapshot(step: int) -> None:
        model_state, optim_state = distributed.full_state(model, optimizer, ctx)  # a collective under FSDP
        if ctx.is_main:
            _save(step, model_state, optim_state)
        distributed.barrier(ctx)

    def _save(step: int, model_state: dict, optim_state: dict) -> None:
        save_checkpoint(paths.checkpoints, step, {
            "run_id": spec.run_id, "step": step, "model": model_state,
            "optimizer": optim_state, "state_format": FULL_STATE_FORMAT, "world_size": ctx.world_size,
            "schedule": {"step": step, "total_steps": tc.total_steps, "warmup_steps": tc.warmup_steps},
            "data_position": {"samples_consumed": step * tc.global_batch_size},
            "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None},
            "wall_seconds": wall_before + (time.time() - t_start), "last_val": last_val,
        })

    t_start = time.time()
    t_window, tokens_window = time.time(), 0
    step = start_step
    model.train()
    try:
        while step < tc.total_steps:
            if stop_after is not None and step - start_step >= stop_after:
                break
            lr = lr_at(step, tc.lr, tc.total_steps, tc.warmup_steps, tc.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            record: dict[str, Any] = {}
            if tc.dynamics_every and step % tc.dynamics_every == 0:
                x, y = batches.get(step, 0)
                record["dynamics"] = {"after_updates": step, **measure_dynamics(model, x.to(device), y.to(device), autocast)}
            loss_sum = 0.0
            for micro in range(batches.accum_steps):
                x, y = batches.get(step, micro)
                last_micro = micro == batches.accum_steps - 1
                # gradients are averaged over ranks once per step, on the last micro-batch
                with distributed.gradient_sync(net, ctx, last_micro):
                    with autocast:
                        out = step_fn(x.to(device), y.to(device))
                    loss = out.loss
                    objective = loss if out.aux_loss is None else loss + out.aux_loss  # MoE load balancing
                    (objective / batches.accum_steps).backward()
                loss_sum += loss.item()
            train_loss = distributed.all_reduce_mean(loss_sum / batches.accum_steps, ctx, device)
            max_norm = tc.grad_clip if tc.grad_clip is not None else float("inf")  # inf: measure, do not clip
            grad_norm = distributed.scalar(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            if not math.isfinite(train_loss) or not math.isfinite(grad_norm) or train_loss > diverge_at:
                status = STATUS_DIVERGED
                log({"step": step + 1, "train_loss": train_loss, "grad_norm": grad_norm, "lr": lr, "event": "diverged"})
                break
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_window += tc.tokens_per_step
            if bar is not None:
                bar.update(1)
            if step % tc.log_every == 0 or step == tc.total_steps:
                elapsed = time.time() - t_window
                tps = tokens_window / elapsed if elapsed > 0 else float("nan")
                record.update(train_loss=train_loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tps,
                              mfu=tps * flops_per_token / peak if peak == peak else float("nan"))
                t_window, tokens_window = time.time(), 0
                if bar is not None:
                    bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tps:,.0f}")
            if step % tc.eval_every == 0 or step == tc.total_steps:
                last_val = evaluate(model, val_windows, tc.eval_batches, tc.micro_batch_size, device, autocast)
                record["val_loss"] = last_val
                if not math.isfinite(last_val) or last_val > diverge_at:
                    status = STATUS_DIVERGED
            if record:
                log({"step": step, "tokens": step * tc.tokens_per_step, **record})
            if status == STATUS_DIVERGED:
                break
            if step % tc.checkpoint_every == 0 and step < tc.total_steps:
                snapshot(step)
    finally:
        if metrics_file is not None:
            metrics_file.close()
        if bar is not None:
            bar.close()

    wall = wall_before + (time.time() - t_start)
    if status == STATUS_OK and step < tc.total_steps:  # interrupted on purpose (stop_after)
        snapshot(step)
        distributed.teardown(ctx)
        return {"run_id": spec.run_id, "status": "interrupted", "step": step}
    summary = finish(spec, paths, model, status, step, wall, last_val, n_params, device, ctx)
    distributed.teardown(ctx)
    return summary


def finish(spec: RunSpec, paths: RunPaths, model, status: str, step: int, wall: float, last_val: float, n_params: int, device,
           ctx: distributed.DistContext | None = None) -> dict[str, Any]:
    """Write final weights, the metrics log and the summary (last: its presence means done).
    Under torch.distributed every rank gathers the full weights; rank 0 writes."""
    from safetensors.torch import save_file

    ctx = ctx or distributed.DistContext()
    tc = spec.train
    full = distributed.full_model_state(model, ctx)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in full.items()}
    if not ctx.is_main:
        return {"run_id": spec.run_id, "status": status, "rank": ctx.rank}
    atomic_write(paths.weights, lambda tmp: save_file(tensors, tmp, metadata={"run_id": spec.run_id, "step": str(step)}))
    text = paths.metrics.read_text() if paths.metrics.exists() else ""
    atomic_write(paths.curves, lambda tmp: Path(tmp).write_text(text))
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    tps = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and math.isfinite(r["tokens_per_s"])]
    if device.type == "cuda":
        peak_mem, peak_kind = torch.cuda.max_memory_allocated(device), "cuda_allocator"
    else:  # the process's high-water mark (Linux reports KiB); includes Python and the data
        import resource

        peak_mem, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"
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
        "spec_hash": spec.spec_hash(),  # checked by the tables against the grid (depthbench.tables)
    }
    atomic_write_json(paths.summary, summary)
    return summary
