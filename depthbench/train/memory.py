"""Per-GPU training memory before launch: weights, gradients, AdamW state and saved activations.

Activations are not a formula per architecture: each architecture saves what its own code saves
(HC's n streams, AttnRes's source list, MoDA's depth keys and its T x S scores), and a formula
kept next to eleven modules would drift from them. Instead the model of the run is built on the
meta device (no memory, no arithmetic) and one forward pass at the run's micro-batch and
sequence length is traced with `torch.autograd.graph.saved_tensors_hooks`: the bytes autograd
keeps for backward are counted once per storage, parameters excluded (they are the weights).

Precision: on GPU the loop runs under bf16 autocast, which does not act on meta tensors, so
`_Bf16Autocast` redoes its casts as a function mode: the inputs of matrix products and attention
go to bf16 (autocast's lower-precision list), softmax, log-softmax and the loss to fp32. On CPU
the loop runs in fp32 and nothing is cast. The CPU C++ kernels of HC/mHC never run on CUDA, so
the trace takes the eager path (`kernels.apply_to` patched to False while tracing).

Full activation checkpointing per block keeps, of each block, only its inputs (the residual
state entering it), recomputes one block at a time in backward and keeps the rest of the graph
(embedding, final norm, head and loss): saved = sum of block inputs + max block + outside.

Peak per GPU = weights + gradients + AdamW (two fp32 moments) + saved activations + one block's
activations again (the gradient buffers of the block being differentiated) ; under FSDP2 the
first three are divided by the world size and two blocks' parameters are gathered at a time
(the current unit and the prefetched one). Allocator fragmentation and workspace are not
modelled: `HEADROOM` (10 %) is added before the fit test against the GPU's memory.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from depthbench.models import ModelConfig, build_model

HEADROOM = 0.10
FP32 = 4

_LOW = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm, torch.baddbmm,
        torch.addmm, torch.einsum, F.scaled_dot_product_attention}
_HIGH = {F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax, F.cross_entropy}


def _cast(obj, dtype):
    if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.dtype != dtype:
        return obj.to(dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    return obj


def _flash_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as the fused kernels run it: saves q, k, v, the output and the log-sum-exp, never the
    T x T probabilities (on meta, SDPA would fall back to the math path, which keeps them)."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[0]


class _MetaAutocast(TorchFunctionMode):
    """On meta tensors: fused attention's saved tensors, and bf16 autocast's casts when `bf16`
    (see the module docstring)."""

    def __init__(self, bf16: bool):
        super().__init__()
        self.bf16 = bf16

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.bf16 and func in _LOW:
            args, kwargs = _cast(args, torch.bfloat16), {k: _cast(v, torch.bfloat16) for k, v in kwargs.items()}
        elif self.bf16 and func in _HIGH:
            args = _cast(args, torch.float32)
            kwargs.pop("dtype", None)
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None and len(args) < 4:
            return _flash_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclasses.dataclass
class ActivationTrace:
    total: int  # bytes saved for backward by one micro-batch, no checkpointing
    per_block: list[int]  # saved inside each block
    block_inputs: list[int]  # bytes of the tensors entering each block (kept under checkpointing)

    @property
    def outside(self) -> int:
        return self.total - sum(self.per_block)

    @property
    def checkpointed(self) -> int:
        return sum(self.block_inputs) + max(self.per_block) + self.outside


def trace_activations(model: torch.nn.Module, idx: torch.Tensor, bf16: bool) -> ActivationTrace:
    """Saved-for-backward bytes of one forward of `model` on `idx` (any device, meta included)."""
    param_ids = {id(p) for p in model.parameters()}
    param_ptrs = {p.data_ptr() for p in model.parameters()} if idx.device.type != "meta" else set()
    seen: set = set()
    keep: list = []  # holds every saved tensor during the pass, so that ids are not reused
    counts = {"total": 0}
    current: list[int] = [-1]
    per_block = [0] * len(model.blocks)
    inputs = [0] * len(model.blocks)

    def pack(t):
        base = t._base if t._base is not None else t
        # real tensors: one storage counted once; meta tensors have no address, a view's base stands in
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(base)
        if id(base) in param_ids or (t.device.type != "meta" and key in param_ptrs) or key in seen:
            return t
        seen.add(key)
        keep.append(base)
        counts["total"] += _nbytes(t)
        if current[0] >= 0:
            per_block[current[0]] += _nbytes(t)
        return t

    hooks, depth = [], [0]
    for i, block in enumerate(model.blocks):
        # Every submodule of block i counts towards block i: some trunks (AttnRes) run a block's
        # sublayers without calling the block. The first tensors entering block i are its inputs.
        def pre(_m, args, i=i):
            depth[0] += 1
            current[0] = i
            if not inputs[i]:
                inputs[i] = sum(_nbytes(t) for t in _tensors(args, []) if t.is_floating_point())

        def post(*_):
            depth[0] -= 1
            if depth[0] == 0:
                current[0] = -1
        for module in block.modules():
            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    mode = _MetaAutocast(bf16) if idx.device.type == "meta" else nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode, _eager_kernels(idx, mode):
            out = model(idx, targets=idx)
            del out
    finally:
        for h in hooks:
            h.remove()
    return ActivationTrace(counts["total"], per_block, inputs)


@contextmanager
def _autocast_region(mode, enabled: bool = True, **_):
    """torch.autocast(..., enabled=False) inside the model (HC's fp32 regions) on meta: the
    replayed casts pause, as autocast's would (torch.autocast refuses the meta device)."""
    saved = mode.bf16
    mode.bf16 = saved and enabled
    try:
        yield
    finally:
        mode.bf16 = saved


@contextmanager
def _eager_kernels(idx: torch.Tensor, mode):
    if idx.device.type == "meta":
        with mock.patch("depthbench.kernels.apply_to", lambda t: False), \
                mock.patch("torch.autocast", lambda *a, **k: _autocast_region(mode, **k)):
            yield
    else:
        yield


@dataclasses.dataclass
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    gathered: float  # FSDP2: two units' parameters all-gathered at once
    activations: float
    activations_checkpointed: float
    backward_working: float  # one block's activations again, while it is differentiated
    outside: float  # saved outside the blocks: embedding, final norm, head and loss

    def total(self, checkpointing: bool) -> float:
        act = self.activations_checkpointed if checkpointing else self.activations
        return self.weights + self.gradients + self.optimizer + self.gathered + act + self.backward_working

    def needs_checkpointing(self, gpu_bytes: float) -> bool:
        return self.total(False) * (1 + HEADROOM) > gpu_bytes

    def fits(self, gpu_bytes: float) -> bool:
        return self.total(True) * (1 + HEADROOM) <= gpu_bytes


def estimate_memory(cfg: ModelConfig, micro_batch: int, seq_len: int, bf16: bool = True, world: int = 1,
                    fsdp: bool = False) -> MemoryEstimate:
    """Per-rank memory of a training step (see the module docstring for each term)."""
    with torch.device("meta"):
        model = build_model(cfg, initialize=False)
    trace = trace_activations(model, torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta"), bf16)
    n_params = sum(p.numel() for p in model.parameters())
    shard = world if fsdp else 1
    unit = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    return MemoryEstimate(
        weights=n_params * FP32 / shard,
        gradients=n_params * FP32 / shard,
        optimizer=2 * n_params * FP32 / shard,
        gathered=2 * unit * (2 if bf16 else FP32) if fsdp and world > 1 else 0.0,
        activations=trace.total,
        activations_checkpointed=trace.checkpointed,
        backward_working=max(trace.per_block),
        outside=trace.outside,
    )
