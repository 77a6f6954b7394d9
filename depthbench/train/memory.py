"""Per-GPU training memory before launch: weights, gradients, AdamW state and saved activations.

Activations are not a formula per architecture: each architecture saves what its own code saves
(HC's n streams, AttnRes's source list, MoDA's depth keys and its T x S scores), and a formula
kept next to eleven modules would drift from them. Instead the model of the run is built on the
meta device (no memory, no arithmetic) and one forward pass at the run's micro-batch and
sequence length is traced with `torch.autograd.graph.saved_tensors_hooks`: the bytes autograd
keeps for backward are counted once per storage, parameters excluded (they are the weights).
Buffers that an autograd.Function holds on its ctx instead of saving (MoDA's depth K/V buffer,
AttnRes's source buffer: later layers write into them in place) are announced by the models
through `depthbench.models.layers.held_for_backward` and counted as saved outside every unit
(checkpointing does not free them). The tensors whose values they copy are not: the buffers
reference them weakly (MoDA) or are not kept themselves (AttnRes: its Function keeps a view).

Precision: on GPU the loop runs under bf16 autocast, which does not act on meta tensors, so
`_MetaAutocast` redoes its casts as a function mode, by the policy of the target device
(`device`, "cuda" unless told). On both devices the inputs of matrix products, `linalg.vecdot`
(the RMS of HC's and mHC's coefficient projections) and attention go to bf16 (autocast's
lower-precision list; each argument is cast on its own, so vecdot(x, x) keeps two bf16 copies of
x); the losses take fp32 inputs. On CUDA the other ops of ATen's fp32 lists (exp, log, rsqrt,
pow, sum, logsumexp, softmax, log-softmax; ATen/autocast_mode.h) also take fp32 inputs, where
CPU autocast runs them in bf16. So a CUDA trace saves a few fp32 tensors where the CPU saves
bf16 ones: on the models of tests/unit/test_memory.py the "cuda" count is above the "cpu" count by
0.14-0.22 % for hc and 0.02-0.03 % for mhc (the fp32 rsqrt of the bf16 vecdot, one value per
token and stream) and equal to it for every other architecture, and the "cpu" count equals the
bytes measured on the CPU. On CPU the training loop runs in fp32 and nothing is cast. The CPU
C++ kernels of HC/mHC never run on CUDA, so the trace takes the eager path (`kernels.apply_to`
patched to False while tracing) for either device: `device="cpu"` is the CPU's autocast policy
on that path, which the tests measure, not the kernels' saved tensors. MoE experts take the target device's path
(depthbench.models.moe): grouped products on the CPU and for bf16 on CUDA (Hopper or newer, the
planner's GPUs), every expert on every token for fp32 on CUDA (E/k times the experts' saved
bytes); on meta a stand-in for the grouped product saves what its backward saves (both operands
and the offsets), since its meta kernel takes bf16 only.

Activation checkpointing (depthbench.train.parallelize) acts on the architecture's units
(`checkpoint_units`: the blocks, or attnres's pre-normed sublayers), so the trace attributes each saved storage to
the units that save it and records the storages entering each unit (its inputs, MoDA's depth
keys included). A checkpointed unit keeps only its inputs and recomputes one unit at a time in
backward: saved = every storage still saved by a non-checkpointed unit or outside the units
(embedding, final norm, head, loss, attnres's depth mixing and source norms) + the inputs of the checkpointed
units (each storage once) + the largest checkpointed unit's own saved bytes (its recomputation).

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

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.models.layers import HELD_LISTENERS

HEADROOM = 0.10
FP32 = 4

_LOW = {
    F.linear,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.bmm,
    torch.mm,
    torch.baddbmm,
    torch.addmm,
    torch.einsum,
    torch.linalg.vecdot,
    F.scaled_dot_product_attention,
}
# autocast's fp32 ops, per device (the Python functions of ATen's lists that the models can reach):
# every floating input in fp32; the second CUDA set only where no dtype is given (fp32_set_opt_dtype)
_FP32 = {"cpu": {F.cross_entropy, F.nll_loss, F.mse_loss}}
_FP32["cuda"] = _FP32["cpu"] | {
    torch.exp,
    torch.Tensor.exp,
    torch.log,
    torch.Tensor.log,
    torch.log1p,
    torch.Tensor.log1p,
    torch.expm1,
    torch.Tensor.expm1,
    torch.rsqrt,
    torch.Tensor.rsqrt,
    torch.reciprocal,
    torch.Tensor.reciprocal,
    torch.pow,
    torch.Tensor.pow,
    torch.Tensor.__pow__,
    torch.logsumexp,
    torch.Tensor.logsumexp,
    F.softplus,
    F.rms_norm,
    F.layer_norm,
    F.group_norm,
    F.cosine_similarity,
    F.kl_div,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.binary_cross_entropy_with_logits,
    torch.cdist,
}
_FP32_UNLESS_DTYPE = {
    "cpu": set(),
    "cuda": {
        F.softmax,
        torch.softmax,
        torch.Tensor.softmax,
        F.log_softmax,
        torch.log_softmax,
        torch.Tensor.log_softmax,
        torch.sum,
        torch.Tensor.sum,
        torch.cumsum,
        torch.Tensor.cumsum,
        torch.prod,
        torch.Tensor.prod,
        torch.linalg.vector_norm,
    },
}
DEVICES = tuple(_FP32)
_GROUPED_MM = getattr(torch, "_grouped_mm", None)  # F.grouped_mm's op, where torch has it


def _cast(obj, dtype):
    if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.dtype != dtype:
        return obj.to(dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    return obj


def _flash_sdpa(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """SDPA as the fused kernels run it: saves q, k, v, the output and the log-sum-exp, never the
    T x T probabilities (on meta, SDPA would fall back to the math path, which keeps them)."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, scale=scale
    )[0]


class _MetaAutocast(TorchFunctionMode):
    """On meta tensors: fused attention's saved tensors, and `device`'s bf16 autocast casts when
    `bf16` (see the module docstring)."""

    def __init__(self, bf16: bool, device: str = "cuda"):
        super().__init__()
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        self.bf16, self.device = bf16, device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.bf16 and func in _LOW:
            args, kwargs = (
                _cast(args, torch.bfloat16),
                {k: _cast(v, torch.bfloat16) for k, v in kwargs.items()},
            )
        elif self.bf16 and (
            func in _FP32[self.device]
            or (func in _FP32_UNLESS_DTYPE[self.device] and kwargs.get("dtype") is None)
        ):
            args, kwargs = (
                _cast(args, torch.float32),
                {k: _cast(v, torch.float32) for k, v in kwargs.items()},
            )
        if (
            func is F.scaled_dot_product_attention
            and kwargs.get("attn_mask") is None
            and len(args) < 4
        ):
            return _flash_sdpa(*args, **kwargs)
        if func is _GROUPED_MM and kwargs.get("bias") is None:
            return _MetaGroupedMM.apply(
                args[0], args[1], kwargs["offs"] if "offs" in kwargs else args[2]
            )
        return func(*args, **kwargs)


class _MetaGroupedMM(torch.autograd.Function):
    """`torch._grouped_mm` on meta, any dtype (its meta kernel takes bf16 only): saves the two
    operands and the offsets, as its backward does."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("traced on meta only")


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
    elif hasattr(obj, "__iter__") and not isinstance(
        obj, (str, bytes, torch.nn.Module)
    ):  # MoDA's DepthKeys
        for o in obj:
            _tensors(o, out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _key(t: torch.Tensor):
    """One storage: its address on real devices; meta tensors have none, a view's base stands in."""
    if t.device.type != "meta":
        return t.untyped_storage().data_ptr()
    return id(t._base if t._base is not None else t)


@dataclasses.dataclass
class ActivationTrace:
    saved: dict  # storage key -> (bytes, set of saving units; -1 outside every unit)
    unit_saved: list[int]  # bytes saved inside each unit
    unit_inputs: list[dict]  # per unit: storage key -> bytes of the floating tensors entering it

    @property
    def total(self) -> int:
        """Bytes saved for backward by one micro-batch, no checkpointing."""
        return sum(b for b, _ in self.saved.values())

    @property
    def per_block(self) -> list[int]:
        return self.unit_saved

    @property
    def outside(self) -> int:
        return sum(b for b, owners in self.saved.values() if -1 in owners)

    def retained(self, recompute: list[bool]) -> int:
        """Bytes held after the forward when the units marked in `recompute` are checkpointed."""
        kept = {
            k: b
            for k, (b, owners) in self.saved.items()
            if any(o < 0 or not recompute[o] for o in owners)
        }
        for inputs, on in zip(self.unit_inputs, recompute):
            if on:
                for k, b in inputs.items():
                    kept.setdefault(k, b)
        return sum(kept.values())

    def saved_with(self, recompute: list[bool]) -> int:
        """Peak saved bytes in backward: retained + the largest recomputed unit's saved bytes."""
        return self.retained(recompute) + max(
            [b for b, on in zip(self.unit_saved, recompute) if on], default=0
        )

    @property
    def checkpointed(self) -> int:
        return self.saved_with([True] * len(self.unit_saved))


def trace_activations(
    model: torch.nn.Module, idx: torch.Tensor, bf16: bool, device: str = "cuda"
) -> ActivationTrace:
    """Saved-for-backward bytes of one forward of `model` on `idx` (any device, meta included); on
    meta, `device` is the device whose autocast and MoE paths the trace follows."""
    param_ids = {id(p) for p in model.parameters()}
    param_ptrs = {p.data_ptr() for p in model.parameters()} if idx.device.type != "meta" else set()
    saved: dict = {}
    keep: list = []  # holds every saved tensor during the pass, so that ids are not reused
    current: list[int] = [-1]
    units = list(model.checkpoint_units())
    unit_saved = [0] * len(units)
    inputs: list[dict] = [{} for _ in units]

    def pack(t):
        base = t._base if t._base is not None else t
        key = _key(t)
        if id(base) in param_ids or (t.device.type != "meta" and key in param_ptrs):
            return t
        if key not in saved:
            saved[key] = (_nbytes(t), set())
            keep.append(base)
        if current[0] not in saved[key][1]:
            saved[key][1].add(current[0])
            if current[0] >= 0:
                unit_saved[current[0]] += _nbytes(t)
        return t

    def held(t):  # kept until backward whatever is checkpointed (see the module docstring)
        key = _key(t)
        if key not in saved:
            saved[key] = (_nbytes(t), set())
            keep.append(t)
        saved[key][1].add(-1)

    hooks, depth = [], [0]
    for i, unit in enumerate(units):
        # Every submodule of unit i counts towards unit i. The tensors entering the unit are its
        # inputs (all of them: a unit may be called more than once).
        def pre(_m, args, i=i):
            if depth[0] == 0:
                current[0] = i
                for t in _tensors(args, []):
                    if t.is_floating_point() and id(t) not in param_ids:
                        inputs[i].setdefault(_key(t), _nbytes(t))
                        keep.append(t)
            depth[0] += 1

        def post(*_):
            depth[0] -= 1
            if depth[0] == 0:
                current[0] = -1

        for module in unit.modules():
            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    mode = _MetaAutocast(bf16, device) if idx.device.type == "meta" else nullcontext()
    HELD_LISTENERS.append(held)
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            mode,
            _eager_kernels(idx, mode),
        ):
            out = model(idx, targets=idx)
            del out
    finally:
        HELD_LISTENERS.remove(held)
        for h in hooks:
            h.remove()
    return ActivationTrace(saved, unit_saved, inputs)


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


def _grouped_mm_serves(device: str, dtype: torch.dtype) -> bool:
    """depthbench.models.moe's choice of expert path on the target device (CUDA: Hopper or newer)."""
    if not hasattr(F, "grouped_mm"):
        return False
    return (
        dtype in (torch.float32, torch.bfloat16, torch.float16)
        if device == "cpu"
        else dtype == torch.bfloat16
    )


@contextmanager
def _eager_kernels(idx: torch.Tensor, mode):
    if idx.device.type == "meta":
        with (
            mock.patch("depthbench.kernels.apply_to", lambda t: False),
            mock.patch("torch.autocast", lambda *a, **k: _autocast_region(mode, **k)),
            mock.patch(
                "depthbench.models.moe._compute_dtype",
                lambda x: torch.bfloat16 if mode.bf16 else x.dtype,
            ),
            mock.patch(
                "depthbench.models.moe._grouped_mm_serves",
                lambda _d, dtype: _grouped_mm_serves(mode.device, dtype),
            ),
        ):
            yield
    else:
        yield


CHECKPOINT_MODES = (
    "none",
    "selective",
    "full",
)  # least memory saved first (depthbench.train.parallelize)


def recompute_mask(mode: str, n_units: int) -> list[bool]:
    """The units a checkpointing mode recomputes: all (full), the 1st, 3rd, ... (selective), none."""
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
    with torch.device("meta"):
        model = build_model(cfg, initialize=False)
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
