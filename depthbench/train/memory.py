"""Per-GPU training memory before launch: weights, gradients, AdamW state and saved activations.

Saved activations are traced, not modelled: the model of the run is built on the meta device (no
memory, no arithmetic) and one forward pass at the run's micro-batch and sequence length is
traced (depthbench.train.activation_trace, which says what it counts and how checkpointing
changes it), with the autocast policy, MoE path and implementations of the target device
(`device`, "cuda" unless told; depthbench.train.meta_autocast, depthbench.kernels.swap: kernels
that cannot take a meta tensor leave the definitions to run). The "cpu" trace equals the bytes
measured on the CPU (tests/unit/test_memory.py); the "cuda" trace equals the storages autograd
keeps on an H200 to 1.3e-7 (tests/integration/test_gpu.py, and tests/unit/test_memory.py
against that GPU's record). On CPU the training loop runs in fp32 and nothing is cast.

The loss is traced as the run computes it: `loss_chunk_tokens` > 0 is the chunked LM head and
loss of training (depthbench.models.loss: it saves d x and d W, never the logits), 0 the plain
cross-entropy (it saves the (N T, V) fp32 log-probabilities).

Peak per GPU = weights and buffers + gradients + AdamW (two fp32 moments) + saved activations + the
larger of two working sets: the loss's (`loss_working_bytes`: with the plain loss two fp32 (N T, V)
gradients at the start of backward, with the chunked one a chunk's logits and gradients in the
forward), and one block's activations again (the gradient buffers of the block being differentiated)
beside the gradients of the buffers held on a ctx (AttnRes's sources, MoDA's depth keys), which
their readers' backward makes and which wait for their producers' backward: as many buffer-sized
gradients as the architecture announces (layers.held_for_backward). DDP adds its gradient buckets (a
second fp32 copy of every gradient, alive with the wrapper). Under FSDP2 the first three are divided
by the world size; the root unit's parameters (embedding, head, final norm) are gathered from its
forward to the end of backward and two units' at a time (the current one and the prefetched one), in
the dtype of its mixed-precision policy (bf16 on GPUs under bf16: the trace then runs on bf16
parameters, of which autocast keeps no copy); and the unsharded gradients count too: every one while
micro-batches accumulate without sync (beside them what the last micro-batch's reduce-scatters hold:
a unit's fp32 input copy, on CPU ranks gloo's scratch copy of it, the shards made so far, under bf16
the fresh bf16 gradients of a unit and of the root; and at the end of backward the root's gradients
beside its own copy), else the root's and one unit's. The gradients are counted whole throughout
(gradient accumulation keeps them across micro-batches); a run of one micro-batch per step without
checkpointing (`accumulating=False`) takes the tighter `single_micro_batch_peak`, which on an H200
is 1.002-1.082 times the CUDA allocator's high-water mark of such a step, every architecture and
MoE, fp32 and bf16, plain and chunked loss. On gloo CPU ranks (depthbench.train.measured_memory) the
estimate bounded every rank's peak measured under DDP and FSDP2, 1.03-1.47 times it
(docs/design/memory.md). Allocator fragmentation and workspace are not modelled: `HEADROOM` (10 %)
is added before the fit test against the GPU's memory.
"""

from __future__ import annotations

import dataclasses

import torch

from depthbench.models.config import ModelConfig
from depthbench.kernels.swap import swap_in
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
    gathered: float  # FSDP2: the root unit's and two units' parameters all-gathered at once
    activations: float
    activations_checkpointed: float  # full checkpointing
    backward_working: float  # one unit's activations again, while it is differentiated
    outside: float  # saved outside the units: embedding, final norm, head and loss
    activations_selective: float = 0.0  # selective checkpointing (every other unit)
    loss_working: float = 0.0  # the loss's transient tensors (loss_working_bytes)
    held_working: float = 0.0  # the gradients of the buffers held on a ctx (their copies x bytes)
    # a step of one micro-batch without checkpointing: gradients, saved activations and working
    # sets at the backward's worst moment (single_micro_batch_peak); None: not computed
    single_micro_batch: float | None = None
    accumulating: bool = True  # the run accumulates micro-batches: its gradients persist
    unsharded_gradients: float = 0.0  # FSDP2: gradients before their reduce-scatter
    buckets: float = 0.0  # DDP: its gradient buckets, a second fp32 copy of every gradient
    # the (sharded) gradients alive at the accumulating step's peak where fewer than `gradients`
    # (FSDP2's, see estimate_memory); None: all of them
    gradients_at_peak: float | None = None
    # FSDP2, accumulating: the gradients at the end of the last backward, when no activation is
    # left (every unit's shard, the root's unsharded ones and its reduce-scatter's copy)
    end_of_backward: float = 0.0
    # the model's buffers (RoPE's tables, position-bound constants): on every rank, all along
    buffers: float = 0.0

    def activations_for(self, mode) -> float:
        """Saved activations at the backward's peak under a checkpointing mode (True = full)."""
        mode = {True: "full", False: "none"}.get(mode, mode)
        return {
            "none": self.activations,
            "selective": self.activations_selective,
            "full": self.activations_checkpointed,
        }[mode]

    def total(self, checkpointing="none") -> float:
        """Peak bytes of a training step under a checkpointing mode (see the module docstring);
        a run of one micro-batch per step without checkpointing takes the tighter
        `single_micro_batch` bound."""
        act = self.activations_for(checkpointing)
        mode = {True: "full", False: "none"}.get(checkpointing, checkpointing)
        if not self.accumulating and mode == "none" and self.single_micro_batch is not None:
            return (
                self.weights
                + self.buffers
                + self.optimizer
                + self.gathered
                + self.buckets
                + self.single_micro_batch
            )
        gradients = self.gradients if self.gradients_at_peak is None else self.gradients_at_peak
        during = (
            self.weights
            + self.buffers
            + gradients
            + self.buckets
            + self.optimizer
            + self.gathered
            + self.unsharded_gradients
            + act
            + max(self.backward_working + self.held_working, self.loss_working)
        )
        after = self.weights + self.buffers + self.optimizer + self.gathered + self.end_of_backward
        return max(during, after)

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
    loss_chunk_tokens: int = 0,
    accumulating: bool = True,
    fsdp_policy_device: str | None = None,
    backend: str | None = None,
    kernels: str = "auto",
) -> MemoryEstimate:
    """Per-rank memory of a training step on `device` ("cuda" or "cpu": its autocast and MoE
    paths) with the loss computed `loss_chunk_tokens` tokens at a time (0: the plain loss), in a
    run that accumulates several micro-batches per optimizer step or not (`accumulating`; see
    the module docstring for each term). Under FSDP2 the ranks take the mixed-precision policy of
    `fsdp_policy_device` (default `device`; depthbench.train.distributed.mixed_precision_policy).
    The model runs the implementations of `backend` (default `device`; `kernels` = reference:
    the definitions; depthbench.kernels.swap)."""
    # weights on meta, uninitialised (parameters_on_meta), then the constants built on the CPU
    # (HC's eye) moved to meta too; under torch.device("meta") every nn.Linear and nn.Embedding
    # init ran on meta through Python reference kernels: a third of an estimate's time
    with parameters_on_meta():
        model = build_model(cfg, initialize=False)
    model.to("meta")
    # the implementations training swaps in on `device` (depthbench.kernels.swap); the C++ and
    # Triton kernels' custom ops take meta tensors through their fake implementations
    swap_in(model, backend or device, kernels)
    model.loss_chunk_tokens = loss_chunk_tokens
    shard = world if fsdp else 1
    sharded = fsdp and world > 1
    param_bytes = FP32
    if sharded:
        from depthbench.train.distributed import mixed_precision_policy

        dtype = torch.bfloat16 if bf16 else torch.float32
        policy = mixed_precision_policy(torch.device(fsdp_policy_device or device), dtype)
        if policy.param_dtype is not None:
            # FSDP2 all-gathers the parameters in param_dtype, and the layers save the gathered
            # tensors, whose storage it frees after each unit's forward and gathers again for its
            # backward (`gathered`): autocast makes no copy of a weight for backward to keep
            for p in model.parameters():
                p.data = p.data.to(policy.param_dtype)
            param_bytes = policy.param_dtype.itemsize
    trace = trace_activations(
        model, torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta"), bf16, device
    )
    n_params = sum(p.numel() for p in model.parameters())
    units = [sum(p.numel() for p in u.parameters()) for u in model.fsdp_units()]
    unit, root = max(units), n_params - sum(units)
    n_units = len(trace.unit_saved)
    loss_working = loss_working_bytes(
        micro_batch * seq_len, cfg.vocab_size, cfg.d_model, loss_chunk_tokens, bf16
    )
    held_working = sum(nbytes * copies for nbytes, copies in trace.held.values())
    gradients = n_params * FP32 / shard
    # gloo, the CPU ranks' backend, reduce-scatters through a scratch copy of its whole input (a
    # unit's fp32 gradients) that its worker thread frees after it has released the caller, at
    # times once the next unit's backward has begun: one more unit's fp32 bytes in flight
    gloo_scratch = unit * FP32 if sharded and device == "cpu" else 0.0
    # FSDP2's reduce-scatter of a unit (torch 2.13's foreach_reduce) copies the unit's unsharded
    # gradients into one fp32 input buffer (freed before the next unit's is made) beside them:
    # two units' fp32 bytes while a unit is differentiated, its gradients in the parameters'
    # dtype and the copy
    in_flight = 2 * unit * FP32 + gloo_scratch if sharded else 0.0
    # accumulating: the copy beside the accumulated fp32 gradients, the shards made so far beside
    # their inputs (two units', as above), and under bf16 parameters the fresh bf16 gradients
    # that wait for FSDP2 to add them to the fp32 accumulation: a unit's, and the root's, made
    # at the start of backward (the head's) and added only at its end
    fresh_bytes = param_bytes if param_bytes != FP32 else 0  # per parameter
    accumulating_in_flight = (
        unit * FP32 + 2 * unit * FP32 / shard + (unit + root) * fresh_bytes + gloo_scratch
    )
    frees = [0.0] * n_units  # bytes freed once unit u's backward is done (see below)
    for nbytes, owners in trace.saved.values():
        if owners and -1 not in owners:
            frees[min(owners)] += nbytes
    return MemoryEstimate(
        weights=n_params * FP32 / shard,
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        gradients=gradients,
        optimizer=2 * n_params * FP32 / shard,
        # FSDP2: the root unit (embedding, head, final norm) stays gathered from its forward to
        # the end of backward, and two units are gathered at a time (the current one and the
        # prefetched one)
        gathered=(root + 2 * unit) * param_bytes if sharded else 0.0,
        # FSDP2's unsharded gradients: accumulating without sync (train.loop's gradient_sync)
        # keeps every one until the step's last micro-batch reduce-scatters them; else the
        # root's, until the end of backward, and one unit's, until its reduce-scatter
        unsharded_gradients=(n_params if accumulating else root + unit) * FP32 if sharded else 0.0,
        # ... and the sharded ones exist only from the last micro-batch's reduce-scatters on,
        # each made as its unsharded input goes (the peak, at the start of that backward, has
        # none): what the reduce-scatters hold beside the unsharded gradients counts instead;
        # at the very end of backward (no activation left) every shard, and the root's
        # unsharded gradients beside its reduce-scatter's copy (and its fresh bf16 ones)
        gradients_at_peak=accumulating_in_flight if sharded and accumulating else None,
        end_of_backward=(
            n_params * FP32 / shard + 2 * root * FP32 + root * fresh_bytes
            if sharded and accumulating
            else 0.0
        ),
        # DDP (gradient_as_bucket_view off) copies each gradient into its bucket for the
        # all-reduce and back: the buckets, allocated with the wrapper, live as long as it
        buckets=n_params * FP32 if world > 1 and not fsdp else 0.0,
        activations=trace.total,
        activations_checkpointed=trace.checkpointed,
        backward_working=max(trace.per_block),
        outside=trace.outside,
        activations_selective=trace.saved_with(recompute_mask("selective", n_units)),
        loss_working=loss_working,
        held_working=held_working,
        single_micro_batch=single_micro_batch_peak(
            trace.total,
            trace.unit_saved,
            frees,
            [FP32 * n for n in trace.unit_params],
            n_params * FP32,
            loss_working,
            held_working,
            shard,
            in_flight,
        ),
        accumulating=accumulating,
    )


def single_micro_batch_peak(
    saved: float,
    unit_saved: list,
    unit_frees: list,
    unit_gradients: list,
    gradients: float,
    loss_working: float,
    held_working: float,
    shard: int = 1,
    in_flight: float = 0.0,
) -> float:
    """Bytes above weights and AdamW's moments (and FSDP2's gathered parameters, DDP's buckets) at
    the worst moment of a step of one micro-batch without checkpointing, whose gradients do not
    exist before its backward (set to None after the previous step). Backward runs from the loss
    through the units, last first. `gradients` counts every gradient whole.

    - Before the first unit: every saved tensor, the gradients of the parameters outside the
      units (the head's and the final norm's come first; the embedding's last, all counted here)
      and the larger of the loss's and the held buffers' working sets.
    - While unit u is differentiated: the saved tensors not yet freed (a storage is freed once
      every unit saving it is done, never while a part outside the units saves it too:
      `unit_frees[u]`, the bytes freed after unit u), the gradients made so far (outside and
      units v >= u: `unit_gradients`), unit u's working set (its saved bytes again) and the held
      buffers' (their readers' gradients wait for their producers' backward).
    - After the last unit: every gradient.

    Under FSDP2 (`shard` ranks) a unit's gradients are reduce-scattered once it is done: the
    units done count a `shard`-th of theirs, and while a unit is differentiated `in_flight` bytes
    (its unsharded gradients and the reduce-scatter's fp32 copy of them) count beside them; the
    root's (outside the units) stay unsharded to the end of backward, where the reduce-scatter
    copies them too. On one rank (`shard` 1, `in_flight` 0) every gradient made counts whole.

    On an H200 the step's measured high-water mark is 0.92-1.00 of weights + AdamW + this
    (tests/data/h200_training_step_memory.json)."""
    outside = gradients - sum(unit_gradients)
    moments = [saved + outside + max(loss_working, held_working)]
    freed, made = 0.0, outside
    for u in reversed(range(len(unit_saved))):
        made += unit_gradients[u] / shard
        moments.append(saved - freed + made + in_flight + unit_saved[u] + held_working)
        freed += unit_frees[u]
    moments.append(made + in_flight + (outside if shard > 1 else 0.0))
    return max(moments)


def loss_working_bytes(tokens: int, vocab: int, d_model: int, chunk: int, bf16: bool) -> float:
    """The loss's tensors that live beside the saved activations, at their largest.

    Plain loss (`chunk` 0, or at least `tokens`, as DecoderLM falls back to it): at the start of
    backward the fp32 gradient of the log-probabilities and that of the logits, (tokens, V) each,
    exist together (the forward's bf16 and fp32 logits, 6 bytes a value, are fewer).
    Chunked loss (depthbench.models.loss): in the forward, one chunk's fp32 logits (softmaxed in
    place), their scaled gradient in fp32 and, under bf16, its bf16 copy: 8 or 10 bytes a value;
    beside them the head's weight in bf16, its gradient product and that product in fp32 (4
    bytes a weight in fp32, 8 under bf16). Its backward scales d x and d W into new tensors
    (tokens x d and V x d, fp32), fewer at every shape of the presets but counted too."""
    if chunk <= 0 or chunk >= tokens:
        return 2.0 * tokens * vocab * FP32
    per_logit, per_weight = (10, 8) if bf16 else (8, 4)
    forward = chunk * vocab * per_logit + vocab * d_model * per_weight
    backward = (tokens + vocab) * d_model * FP32
    return float(max(forward, backward))
