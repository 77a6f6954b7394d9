"""What a training step allocates, measured, for holding `depthbench.train.memory`'s estimate to.

`allocator_step_memory` trains the model of a config for two steps as a run does (AdamW, fused
where the device has it; micro-batches accumulated, the gradient sync skipped on all but the
last (depthbench.train.distributed.gradient_sync); gradients set to None after each step) and
measures the second, which finds AdamW's moments and the workspaces made by the first:

- on CUDA, the caching allocator's counters (`torch.cuda.memory_allocated` and its high-water
  mark; allocations are rounded up to the allocator's blocks);
- on the CPU, the same two numbers from a counting allocator (DepthBench's C++ extension,
  depthbench/kernels/counting_allocator.cpp) installed over torch's CPU allocator for the
  measurement: it counts each block torch allocates on the CPU while it is installed, as it is
  handed out and as it is freed, on any thread (gloo's included, which torch's profiler does not
  follow). Not counted: the buffers gloo allocates for itself, outside torch's allocator, and
  storages made before the measurement that grow during it.
The model runs the implementations training swaps in on the device (depthbench.kernels.swap).

Under torch.distributed (`ctx`: gloo ranks on the CPU, NCCL on GPUs) the model is wrapped as
training wraps it (depthbench.train.distributed.data_parallel: DDP, or FSDP2 with the
mixed-precision policy of `fsdp_policy_device`) and each rank measures its own bytes: this is how
DDP's gradient buckets and FSDP2's sharding, all-gathers and reduce-scatters are measured without
a GPU (tests/integration/test_distributed_memory.py). What the CPU cannot show is CUDA's
stream-ordered freeing of the communication buffers and CUDA's own kernels' working sets.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
import time
from contextlib import contextmanager

import torch

from depthbench import kernels
from depthbench.kernels.swap import swap_in
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.train.distributed import DistContext, data_parallel, gradient_sync


@dataclasses.dataclass
class AllocatorMeasurement:
    """One training step as the device's allocator counts it, in bytes above what was allocated
    before the model was built."""

    static: int  # weights and AdamW's moments between steps (gradients set to None), DDP's buckets
    saved: int  # growth over the step's last forward with its graph alive: what backward reads
    peak: int  # the high-water mark of that step's forward, backward and AdamW update


def allocator_step_memory(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    bf16: bool,
    device="cuda",
    loss_chunk_tokens: int = 0,
    micro_batches: int = 1,
    seed: int = 0,
    ctx: DistContext | None = None,
    fsdp_policy_device: str | None = None,
) -> AllocatorMeasurement:
    """The model of `cfg` trained for two steps on `device` (CUDA or the CPU) under bf16
    autocast or not, each step over `micro_batches` micro-batches of random token ids, on this
    rank of `ctx` (None: one process), measured in the second step (module docstring). `saved`
    is the growth over the step's last forward, when the earlier micro-batches' gradients
    already exist. What `estimate_memory` predicts for it (with the same `loss_chunk_tokens`,
    world size and strategy): `weights + optimizer + buckets` for `static`, `activations` for
    `saved`, `total("none")` for `peak`. FSDP2 ranks take the mixed-precision policy of
    `fsdp_policy_device` (default `device`): "cuda" on CPU ranks gathers bf16 parameters and
    reduces in fp32 as GPU ranks do under bf16."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"allocator_step_memory: measures CUDA or the CPU, not {device}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    step = TrainingStep(
        cfg,
        micro_batch,
        seq_len,
        bf16,
        device,
        loss_chunk_tokens,
        micro_batches,
        seed,
        ctx or DistContext(),
        fsdp_policy_device,
    )
    if device.type == "cuda":
        return _measure(step, _CudaCounter(device))
    with counted_cpu_allocations() as counter:
        return _measure(step, counter)


@dataclasses.dataclass
class TrainingStep:
    """A model, its wrapper and AdamW (`build`), and the parts of a step the measurements time;
    `run` is a whole step. The arguments of `allocator_step_memory`."""

    cfg: ModelConfig
    micro_batch: int
    seq_len: int
    bf16: bool
    device: torch.device
    loss_chunk_tokens: int = 0
    micro_batches: int = 1
    seed: int = 0
    ctx: DistContext = dataclasses.field(default_factory=DistContext)
    fsdp_policy_device: str | None = None

    def build(self) -> None:
        torch.manual_seed(self.seed)
        # what training runs on the device (depthbench.kernels.swap), as the estimate traces it
        self.model = swap_in(build_model(self.cfg).to(self.device), self.device)
        self.model.loss_chunk_tokens = self.loss_chunk_tokens
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.net = data_parallel(self.model, self.ctx, self.device, dtype, self.fsdp_policy_device)
        # after wrapping: FSDP2 replaces the parameters by their shards
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=1e-4, fused=True)
        self.ids = torch.randint(
            0, self.cfg.vocab_size, (self.micro_batch, self.seq_len), device=self.device
        )
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def forward(self) -> torch.Tensor:
        with self.autocast:
            out = self.net(self.ids, self.ids)
        # the logits leave with `out`, as in a run's step
        return out.loss if out.aux_loss is None else out.loss + out.aux_loss

    def first_micro_batches(self) -> None:
        for _ in range(self.micro_batches - 1):
            with gradient_sync(self.net, self.ctx, False):
                self.forward().backward()

    def last_forward(self) -> torch.Tensor:
        with gradient_sync(self.net, self.ctx, True):
            return self.forward()

    def update(self, loss: torch.Tensor) -> None:
        with gradient_sync(self.net, self.ctx, True):
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self) -> None:
        self.first_micro_batches()
        self.update(self.last_forward())


# gloo's worker thread lets go of a collective it has finished (and with it of what the
# collective holds: a reduce-scatter's scratch copy of its whole input, made by
# ProcessGroupGloo::reduce_scatter_tensor_coalesced) after it has released the caller: at once
# where it has a core, but on a loaded machine a runnable worker waits its turn for tens of
# milliseconds. No call waits for it, so a rank's count is read once it has held still for
# SETTLE_S while every other thread of the process slept (a waiting runnable thread, however
# long it waits, keeps the count from settling)
SETTLE_S = 0.05
SETTLE_TIMEOUT_S = 10.0


def settled_alive(counter) -> int:
    """Bytes alive by `counter` once nothing is freed in the background: read every millisecond
    until it has not changed for SETTLE_S while the process's other threads all slept
    (`_other_threads_asleep`), or after SETTLE_TIMEOUT_S where that never happens."""
    start = since = time.monotonic()
    alive = counter.alive()
    while (now := time.monotonic()) - since < SETTLE_S and now - start < SETTLE_TIMEOUT_S:
        time.sleep(0.001)
        current = counter.alive()
        if current != alive or not _other_threads_asleep():
            alive, since = current, time.monotonic()
    return alive


def _other_threads_asleep() -> bool:
    """Whether no other thread of this process runs or waits for a core (state R, or D: in the
    kernel, uninterruptible) by Linux's /proc/self/task/*/stat; True where there is no /proc."""
    me = threading.get_native_id()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for tid in tasks:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                # "tid (name) state ...": the name may hold spaces and parentheses
                state = stat.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread has ended
        if state in ("R", "D"):
            return False
    return True


def _measure(step: TrainingStep, counter) -> AllocatorMeasurement:
    """The two steps, counted by `counter` (bytes alive, their high-water mark, its reset). The
    garbage of earlier work and of the first step (reference cycles of models, hooks and graphs)
    is collected first, so that it is neither freed during the measured step nor counted in it;
    on a rank of several, the counts before and between the steps are read once gloo's workers
    have freed what the collectives held (`settled_alive`)."""
    alive = settled_alive if step.ctx.enabled else (lambda counter: counter.alive())
    gc.collect()
    empty = alive(counter)
    step.build()
    step.run()
    gc.collect()
    static = alive(counter)
    counter.reset_peak()
    step.first_micro_batches()
    before = counter.alive()
    loss = step.last_forward()
    saved = counter.alive() - before
    step.update(loss)
    return AllocatorMeasurement(static=static - empty, saved=saved, peak=counter.peak() - empty)


class _CudaCounter:
    """The CUDA caching allocator's counters, read once the device has run what was queued."""

    def __init__(self, device: torch.device):
        self.device = device

    def alive(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


class _CpuCounter:
    """The counting CPU allocator of DepthBench's C++ extension (depthbench.kernels,
    counting_allocator.cpp), installed while the measurement lasts."""

    def __init__(self, extension):
        self.extension = extension

    def alive(self) -> int:
        return self.extension.counting_allocator_counts()[0]

    def peak(self) -> int:
        return self.extension.counting_allocator_counts()[1]

    def reset_peak(self) -> None:
        self.extension.counting_allocator_reset_peak()


@contextmanager
def counted_cpu_allocations():
    """A `_CpuCounter` while the counting allocator replaces torch's CPU allocator. Raises where
    the extension cannot be built (depthbench.kernels.unavailable_reason) or when a measurement
    is already counting."""
    extension = kernels.cpu_kernels()
    if extension is None:
        raise RuntimeError(
            "measuring the CPU's memory needs DepthBench's C++ extension, which is unavailable "
            f"here ({kernels.unavailable_reason() or 'its build failed'}); "
            "build it with `python -m depthbench.kernels`"
        )
    if not extension.counting_allocator_install():
        raise RuntimeError("a CPU memory measurement is already counting in this process")
    try:
        yield _CpuCounter(extension)
    finally:
        extension.counting_allocator_remove()
