"""A target device's bf16 autocast, replayed on meta tensors for the memory trace.

Autocast does not act on meta tensors, so `MetaAutocast` redoes its casts as a function mode, by
the policy of the target device ("cuda" or "cpu"). On both devices the inputs of matrix
products, `linalg.vecdot` (the RMS of HC's and mHC's coefficient projections) and attention go
to bf16 (autocast's lower-precision list; each argument is cast on its own, so vecdot(x, x)
keeps two bf16 copies of x); the losses take fp32 inputs. On CUDA the other ops of ATen's fp32
lists (exp, log, rsqrt, pow, sum, logsumexp, softmax, log-softmax; ATen/autocast_mode.h) also
take fp32 inputs, where CPU autocast runs them in bf16; the promote ops (cat, stack, and on CUDA
addcmul, addcdiv and a few more) take every floating input in the widest dtype among them. The
mode's `state` is the replay that depthbench.models.precision answers from while the trace
installs it: regions the models run with autocast off (`precision.autocast_off`) pause the casts,
and MoE experts read the dtype and the target device from it (depthbench.models.moe).

The mode also stands in for kernels whose meta versions save other tensors than the real ones:
fused SDPA (saves q, k, v, the output and the log-sum-exp, never the T x T probabilities; for
fp32 on CUDA, the memory-efficient kernel, whose output the output projection reads without a
copy; for bf16, a kernel whose output it copies, as cuDNN attention's on Hopper: flash
attention's output is read without a copy, so where it runs the estimate is one (B, T, d) bf16
tensor per attention layer above the measurement),
`torch._grouped_mm` (its meta kernel takes bf16 only; the stand-in saves both operands and the
offsets, as its backward does) and, for CUDA, `F.rms_norm`: CUDA runs it as the fused kernel
`_fused_rms_norm`, whose backward keeps the input and the fp32 reciprocal RMS (one value per row)
and nothing else, where the CPU and meta run the composite (x^2, its mean, rsqrt, x * rsqrt and
the product with the gain), which keeps a second full-size tensor per norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from depthbench.models.precision import Replay

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
# autocast's fp32 ops, per device (the Python functions of ATen's lists that the models can
# reach): every floating input in fp32; the second CUDA set only where no dtype is given
# (fp32_set_opt_dtype)
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
# autocast's promote ops, per device: every floating input cast to the widest floating dtype among
# them (ATen's promote lists). On CUDA `addcmul` is one: HC's write, H + b * F(x), keeps an fp32
# copy of the bf16 sublayer output for backward, where the CPU keeps the bf16 output itself
_PROMOTE = {
    "cpu": {torch.cat, torch.stack, torch.index_copy, torch.Tensor.index_copy},
    "cuda": {
        torch.cat,
        torch.stack,
        torch.addcmul,
        torch.Tensor.addcmul,
        torch.addcdiv,
        torch.Tensor.addcdiv,
        torch.atan2,
        torch.Tensor.atan2,
        torch.dot,
        torch.Tensor.dot,
        torch.vdot,
        torch.tensordot,
        torch.cross,
        torch.linalg.cross,
        torch.scatter_add,
        torch.Tensor.scatter_add,
        torch.Tensor.index_put,
        F.bilinear,
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


def _widest_float(args, kwargs) -> torch.dtype | None:
    """The widest floating dtype among the tensors of a call (lists included), None if none."""
    found: list[torch.dtype] = []

    def visit(obj):
        if isinstance(obj, torch.Tensor) and obj.is_floating_point():
            found.append(obj.dtype)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o)

    visit(args)
    visit(list(kwargs.values()))
    widest = None
    for dtype in found:
        widest = dtype if widest is None else torch.promote_types(widest, dtype)
    return widest


def _flash_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """SDPA as the fused kernels run it: saves q, k, v, the output and the log-sum-exp, never the
    T x T probabilities (on meta, SDPA would fall back to the math path, which keeps them).
    Grouped K/V heads are repeated to the query's, as the CPU's kernel takes them (CUDA's flash
    kernel reads them in place: there the estimate is the repeated copies above it)."""
    if enable_gqa and key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )[0]


def _efficient_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """fp32 SDPA with as many K/V heads as query heads, as CUDA runs it: the memory-efficient
    kernel (flash and cuDNN attention take half precision only), which writes its output in
    (B, T, H, D) layout and returns the (B, H, T, D) view of it, so that the model's transpose
    and reshape into the output projection is a view and the projection keeps the kernel's own
    output rather than a copy."""
    return _MetaEfficientSDPA.apply(query, key, value)


class _MetaOnly(torch.autograd.Function):
    """A stand-in that exists only in the memory trace: its forward makes the outputs and saves
    what the real kernel saves; nothing differentiates a meta trace."""

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("traced on meta only")


class _MetaEfficientSDPA(_MetaOnly):
    """On meta: saves q, k, v, the output (a view of its (B, T, H, D) buffer) and the fp32
    log-sum-exp (its positions padded to a multiple of 32), as the efficient kernel's backward
    does."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, _ = q.shape
        out = q.new_empty(B, T, H, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(B, H, -(-T // 32) * 32, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out


class MetaAutocast(TorchFunctionMode):
    """On meta tensors: fused attention's saved tensors, and `device`'s bf16 autocast casts when
    `bf16` (see the module docstring); `state` is the replay the casts follow."""

    def __init__(self, bf16: bool, device: str = "cuda"):
        super().__init__()
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        self.state = Replay(device=device, enabled=bf16)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        casting, device = self.state.enabled, self.state.device
        if casting and func in _LOW:
            args, kwargs = (
                _cast(args, torch.bfloat16),
                {k: _cast(v, torch.bfloat16) for k, v in kwargs.items()},
            )
        elif casting and (
            func in _FP32[device]
            or (func in _FP32_UNLESS_DTYPE[device] and kwargs.get("dtype") is None)
        ):
            args, kwargs = (
                _cast(args, torch.float32),
                {k: _cast(v, torch.float32) for k, v in kwargs.items()},
            )
        elif casting and func in _PROMOTE[device]:
            widest = _widest_float(args, kwargs)
            if widest is not None:
                args, kwargs = _cast(args, widest), {k: _cast(v, widest) for k, v in kwargs.items()}
        if (
            func is F.scaled_dot_product_attention
            and kwargs.get("attn_mask") is None
            and len(args) < 4
        ):
            q, k = _sdpa_arguments(*args, **kwargs)[:2]
            if device == "cuda" and q.dtype == torch.float32:
                if q.shape[1] != k.shape[1]:
                    # grouped K/V heads: the efficient kernel takes none, so CUDA runs the math
                    # path, which keeps the T x T probabilities; meta's own SDPA is that path
                    return func(*args, **kwargs)
                return _efficient_sdpa(*args, **kwargs)
            return _flash_sdpa(*args, **kwargs)
        if func is F.rms_norm and device == "cuda":
            x, shape, weight, eps = _rms_norm_arguments(*args, **kwargs)
            # CUDA fuses only a gain of the input's dtype (or none); else the composite runs
            if weight is None or weight.dtype == x.dtype:
                return _MetaFusedRMSNorm.apply(x, shape, weight, eps)
        if func is _GROUPED_MM and kwargs.get("bias") is None:
            return _MetaGroupedMM.apply(
                args[0], args[1], kwargs["offs"] if "offs" in kwargs else args[2]
            )
        return func(*args, **kwargs)


class _MetaGroupedMM(_MetaOnly):
    """`torch._grouped_mm` on meta, any dtype (its meta kernel takes bf16 only): saves the two
    operands and the offsets, as its backward does."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return a.new_empty(a.shape[0], b.shape[-1])


def _rms_norm_arguments(input, normalized_shape, weight=None, eps=None):
    return input, tuple(normalized_shape), weight, eps


def _sdpa_arguments(query, key, value, *rest, **kwargs):
    return query, key, value


class _MetaFusedRMSNorm(_MetaOnly):
    """`F.rms_norm` as CUDA runs it (`_fused_rms_norm`), on meta: saves the input, the reciprocal
    RMS (the input's shape with the normalised dimensions 1; fp32 for bf16 and fp16 inputs, as
    the kernel accumulates) and the gain, as the kernel's backward does."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        stat = x.shape[: x.dim() - len(normalized_shape)] + (1,) * len(normalized_shape)
        rstd = x.new_empty(stat, dtype=torch.promote_types(x.dtype, torch.float32))
        ctx.save_for_backward(x, rstd, weight)
        return x.new_empty(x.shape)
