"""Data-parallel training with torch.distributed: DDP by default, FSDP2 (`fully_shard`) on request.

The process group is set up from the standard environment variables (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE, LOCAL_RANK). Under submitit (SLURM or the local executor with several tasks)
`TrainingJob` exports them from submitit's job environment
(`submitit.helpers.TorchDistributedEnvironment`), one task per GPU: no torchrun inside srun.
Each rank takes the GPU of its LOCAL_RANK (or the only one it sees when SLURM binds GPUs).
NCCL on GPUs, gloo on CPU.

What does not depend on the number of ranks: the global batch (each rank takes every R-th
micro-batch of a step, see depthbench.data.loader, and accumulates global / (micro x R)
micro-batches), the learning-rate schedule and the token budget. Gradients are averaged over
ranks, so R ranks compute the same update as one rank up to floating-point summation order.

Training checkpoints are sharded (torch.distributed.checkpoint: each rank writes its own part,
keyed by parameter name; depthbench.train.checkpoint), and DCP reshards them on load, so a run
resumes with any number of ranks and either strategy. Only the final weights are gathered
(`full_model_state`), into one safetensors file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STRATEGIES = ("ddp", "fsdp")


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"  # none (one rank), ddp or fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def world_from_env() -> tuple[int, int, int]:
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def setup(strategy: str, device_name: str) -> tuple[DistContext, str]:
    """Join the process group described by the environment (when WORLD_SIZE > 1) and return the
    context and the device name this rank trains on."""
    if strategy not in STRATEGIES:
        from depthbench.util.errors import ConfigError

        raise ConfigError("train.parallel", f"{strategy!r}; valid: {list(STRATEGIES)}")
    rank, world, local_rank = world_from_env()
    if world <= 1:
        return DistContext(), device_name
    use_cuda = torch.cuda.is_available() and device_name in ("auto", "cuda")
    if use_cuda:
        # one GPU per rank: by local rank when the task sees the node's GPUs, else the one it sees
        index = local_rank if torch.cuda.device_count() > local_rank else 0
        torch.cuda.set_device(index)
        device_name = f"cuda:{index}"
    if not dist.is_initialized():
        # device_id binds the NCCL communicator to this rank's GPU at once (eager init): no guess
        # of the device at the first collective, and barrier() needs no device_ids
        kwargs = {"device_id": torch.device(device_name)} if use_cuda else {}
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", **kwargs)
    return DistContext(rank, world, local_rank, strategy), device_name


def shard(model: nn.Module, mp_policy=None) -> nn.Module:
    """FSDP2 in place: each of the architecture's units (one per layer by default, see
    DecoderLM.fsdp_units), then the rest (embedding, head, final norm) as the root unit, all with
    `mp_policy` (a MixedPrecisionPolicy; `data_parallel` picks it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for unit in model.fsdp_units():
        fully_shard(unit, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def mixed_precision_policy(device: torch.device, dtype: torch.dtype):
    """bf16 parameters (all-gathered in bf16) and fp32 gradient reduction on CUDA in bf16; float32
    parameters otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type == "cuda" and dtype == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)


def data_parallel(
    model: nn.Module, ctx, device: torch.device, dtype: torch.dtype, policy_device=None
) -> nn.Module:
    """The module a step calls: the model itself on one rank, DDP, or the model sharded in place
    by FSDP2 with the `mixed_precision_policy` of `policy_device` (default `device`; the memory
    measurement gives CPU ranks CUDA's)."""
    if not ctx.enabled:
        return model
    if ctx.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return shard(model, mixed_precision_policy(torch.device(policy_device or device), dtype))


def gradient_sync(net: nn.Module, ctx: DistContext, sync: bool):
    """Context for one micro-batch's forward and backward: skip the gradient all-reduce
    (reduce-scatter under FSDP2) on all but the last micro-batch of a step."""
    import contextlib

    if not ctx.enabled or sync:
        if ctx.strategy == "fsdp":
            net.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if ctx.strategy == "ddp":
        return net.no_sync()
    net.set_requires_gradient_sync(False)
    return contextlib.nullcontext()


def all_reduce_mean(value: float, ctx: DistContext, device: torch.device) -> float:
    if not ctx.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / ctx.world_size


def all_reduce_mean_tensor(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """The mean over ranks of a 0-d tensor, as a tensor on its device (no host read): the same
    float64 sum and division by the world size as `all_reduce_mean`."""
    if not ctx.enabled:
        return value
    t = value.reshape(1).clone()
    dist.all_reduce(t)
    return t.reshape(()) / ctx.world_size


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full value of a tensor that may be a DTensor (FSDP2 gradient norms), kept on the
    device."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# Prefixes that wrappers put into state-dict keys (activation checkpointing, torch.compile);
# DCP's get_model_state_dict removes them.
_WRAPPER_KEY_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def full_model_state(model: nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict, keys without wrapper prefixes."""
    if not ctx.enabled:
        # One process and no wrapper in the keys: DCP's full state dict is the module's own
        # (tests/integration/test_distributed.py compares them for every architecture); skipping
        # it skips importing torch.distributed.checkpoint, about a second of every training job.
        state = model.state_dict()
        if not any(part in key for key in state for part in _WRAPPER_KEY_PARTS):
            return state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=ctx.enabled)
    )


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def teardown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def unwrap(model: nn.Module) -> nn.Module:
    return (
        model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
    )


def scalar(t: Any) -> float:
    """A float from a tensor that may be a DTensor (FSDP2 gradient norms)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)
