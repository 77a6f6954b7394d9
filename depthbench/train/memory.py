"""Per-GPU training memory before launch: weights, gradients, AdamW state and saved activations.

Saved activations are traced, not modelled: the model of the run is built on the meta device (no
memory, no arithmetic) and one forward pass at the run's micro-batch and sequence length is
traced (depthbench.train.activation_trace, which says what it counts and how checkpointing
changes it), with the autocast policy and MoE path of the target device (`device`, "cuda" unless
told; depthbench.train.meta_autocast). A CUDA trace saves a few fp32 tensors where the CPU saves
bf16 ones: on the models of tests/unit/test_memory.py the "cuda" count is above the "cpu" count
by 0.14-0.22 % for hc and 0.02-0.03 % for mhc (the fp32 rsqrt of the bf16 vecdot, one value per
token and stream) and equal to it for every other architecture, and the "cpu" count equals the
bytes measured on the CPU (eager path). On CPU the training loop runs in fp32 and nothing is
cast; `device="cpu"` is the CPU's autocast policy on the eager path, which the tests measure.

Peak per GPU = weights + gradients + AdamW (two fp32 moments) + saved activations + one block's
activations again (the gradient buffers of the block being differentiated) ; under FSDP2 the
first three are divided by the world size and two blocks' parameters are gathered at a time
(the current unit and the prefetched one). Allocator fragmentation and workspace are not
modelled: `HEADROOM` (10 %) is added before the fit test against the GPU's memory.
"""

from __future__ import annotations

import dataclasses

import torch

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model, parameters_on_meta
from depthbench.train.activation_trace import trace_activations

HEADROOM = 0.10
FP32 = 4


CHECKPOINT_MODES = (
    "none",
    "selective",
    "full",
)  # least memory saved first (depthbench.train.parallelize)


def recompute_mask(mode: str, n_units: int) -> list[bool]:
    """The units a checkpointing mode recomputes: all (full), the 1st, 3rd, ... (selective),
    none."""
    return [mode == "full" or (mode == "selective" and i % 2 == 0) for i in range(n_units)]


@dataclasses.dataclass
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    gathered: float  # FSDP2: two units' parameters all-gathered at once
    activations: float
    activations_checkpointed: float  # full checkpointing
    backward_working: float  # one unit's activations again, while it is differentiated
    outside: float  # saved outside the units: embedding, final norm, head and loss
    activations_selective: float = 0.0  # selective checkpointing (every other unit)

    def activations_for(self, mode) -> float:
        """Saved activations at the backward's peak under a checkpointing mode (True = full)."""
        mode = {True: "full", False: "none"}.get(mode, mode)
        return {
            "none": self.activations,
            "selective": self.activations_selective,
            "full": self.activations_checkpointed,
        }[mode]

    def total(self, checkpointing="none") -> float:
        act = self.activations_for(checkpointing)
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.gathered
            + act
            + self.backward_working
        )

    def needs_checkpointing(self, gpu_bytes: float) -> bool:
        return self.total("none") * (1 + HEADROOM) > gpu_bytes

    def fits(self, gpu_bytes: float) -> bool:
        return self.total("full") * (1 + HEADROOM) <= gpu_bytes

    def checkpointing_for(self, gpu_bytes: float) -> str:
        """The least checkpointing that fits `gpu_bytes` with the headroom (full when none does)."""
        for mode in CHECKPOINT_MODES:
            if self.total(mode) * (1 + HEADROOM) <= gpu_bytes:
                return mode
        return "full"


def estimate_memory(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    bf16: bool = True,
    world: int = 1,
    fsdp: bool = False,
    device: str = "cuda",
) -> MemoryEstimate:
    """Per-rank memory of a training step on `device` ("cuda" or "cpu": its autocast and MoE
    paths; see the module docstring for each term)."""
    # weights on meta, uninitialised (parameters_on_meta), then the constants built on the CPU
    # (HC's eye) moved to meta too; under torch.device("meta") every nn.Linear and nn.Embedding
    # init ran on meta through Python reference kernels: a third of an estimate's time
    with parameters_on_meta():
        model = build_model(cfg, initialize=False)
    model.to("meta")
    trace = trace_activations(
        model, torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta"), bf16, device
    )
    n_params = sum(p.numel() for p in model.parameters())
    shard = world if fsdp else 1
    unit = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    n_units = len(trace.unit_saved)
    return MemoryEstimate(
        weights=n_params * FP32 / shard,
        gradients=n_params * FP32 / shard,
        optimizer=2 * n_params * FP32 / shard,
        gathered=2 * unit * (2 if bf16 else FP32) if fsdp and world > 1 else 0.0,
        activations=trace.total,
        activations_checkpointed=trace.checkpointed,
        backward_working=max(trace.per_block),
        outside=trace.outside,
        activations_selective=trace.saved_with(recompute_mask("selective", n_units)),
    )
