"""AttnRes's grouped depth mix with its products over the sources in Triton: the CUDA backend's
Full and Block AttnRes where triton is installed, swapped in for the grouped mix of
depthbench.kernels.attnres_groups, whose schedule (groups of readers, phase 1 over the cached
sources, phase 2 and the merge in one product) and logits' gradients it keeps (`GroupMix`,
`MergeMix`). What changes is how those products read the sources (attnres_triton_jit.py):

- forward: every source tile read once, in its own dtype (bf16 under autocast), for all of a
  group's readers, weighted by their probabilities (G, S, N) and accumulated in float32 into
  h (G, N, d). The batched matmul of the PyTorch mix first copies the bf16 buffer's view to
  float32 (2 bytes a value read, 4 written and read again) and the probabilities to a permuted
  (N, G, S) tensor;
- backward: per source tile, dq = dh . v for every reader and the source's gradient
  sum_g p_g dh_g, written once in the source's dtype into one (N, S', d) tensor whose slices
  are returned to the sources (autograd adds each source's gradient once per group). The
  PyTorch mix computes that tensor in float32 and copies it per source. dq comes back as one
  partial sum per feature tile (64 features), summed here: deterministic, without atomics.

Not fla-core's `fused_attnres`: its kernel mixes one reader at a time, reading every source once
per reader where this reads it once per group, and its forward refuses CPU tensors, so CI could
not hold it to the definition without patching the library.

The kernels run where `takes` says: CUDA tensors (float32 exactly: elementwise products, no
TF32), or CPU tensors within depthbench.kernels.triton_streams' `on_cpu()` under Triton's
interpreter in float32 and float16 (bfloat16 is wrong there); float64, meta tensors (the memory
trace) and CPU tensors otherwise take the PyTorch products. The memory estimate therefore traces
the PyTorch mix: the same saved tensors, and larger backward transients (its float32 copies of
the sources and their gradients, against these kernels' one float32 dh . v per 64 features,
G (S d / 64) values per token to the copies' 2 S d): an upper bound. The tile sizes are
untuned defaults; benchmarks/attnres_mix.py times them on a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

from depthbench.kernels.attnres_groups import (
    GroupedAttnResBlocks,
    GroupedAttnResFull,
    torch_gradients,
    torch_products,
)
from depthbench.kernels.triton_streams import on_triton_device
from depthbench.models.archs.attnres_block import AttnResBlocks
from depthbench.models.archs.attnres_full import AttnResFull

# the sources' dtypes the kernels take: on CUDA all three; in the interpreter not bfloat16
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32, torch.float16)
BLOCK_D = 64  # features per program
TILE = 128  # readers x tokens per program: BLOCK_N = TILE / BLOCK_G, within 4 .. MAX_BLOCK_N
MAX_BLOCK_N = 64
NUM_WARPS = 8


@functools.cache
def _jit():
    from depthbench.kernels import attnres_triton_jit

    return attnres_triton_jit


def _feature_tiles(D: int) -> int:
    return (D + BLOCK_D - 1) // BLOCK_D


def tiles(G: int) -> dict:
    """The block sizes of a group of G readers: BLOCK_G (G to a power of two), BLOCK_N (tokens:
    TILE / BLOCK_G within 4 .. MAX_BLOCK_N) and BLOCK_D."""
    block_g = 1 << (G - 1).bit_length()
    block_n = min(MAX_BLOCK_N, max(4, TILE // block_g))
    return dict(BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=BLOCK_D)


def _launch(kernel, probs: torch.Tensor, first, view: torch.Tensor, *tensors) -> None:
    """kernel[grid](probs, first, view, *tensors, sizes, strides, tiles) on view's GPU (Triton
    launches on the current device); an absent `first` passed as probs (never read)."""
    G, S, N = probs.shape
    D = view.shape[2]
    blocks = tiles(G)
    grid = (_feature_tiles(D), (N + blocks["BLOCK_N"] - 1) // blocks["BLOCK_N"])
    where = torch.cuda.device(view.device) if view.is_cuda else contextlib.nullcontext()
    with where:
        kernel[grid](
            probs,
            probs if first is None else first,
            view,
            *tensors,
            N,
            S,
            D,
            view.stride(0),
            view.stride(1),
            G=G,
            HAS_FIRST=int(first is not None),
            **blocks,
            num_warps=NUM_WARPS,
        )


@torch.library.custom_op("depthbench::attnres_mix", mutates_args=())
def attnres_mix(
    probs: torch.Tensor, first: torch.Tensor | None, view: torch.Tensor
) -> torch.Tensor:
    """h (G, N, d) float32 = sum_s probs[:, s] v_s for the probabilities (G, S, N) float32,
    v_0 = `first` (N, d) when given, v_1.. the slots of `view` (N, S', d)."""
    h = probs.new_empty(probs.shape[0], probs.shape[2], view.shape[2])
    _launch(_jit().mix_forward, probs, first, view, h)
    return h


@attnres_mix.register_fake
def _(probs, first, view):
    return probs.new_empty(probs.shape[0], probs.shape[2], view.shape[2])


@torch.library.custom_op("depthbench::attnres_mix_backward", mutates_args=())
def attnres_mix_backward(
    probs: torch.Tensor,
    first: torch.Tensor | None,
    view: torch.Tensor,
    dh: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From dh (G, N, d) float32 and the probabilities (G, S, N) float32: dq (G, S, N) float32,
    dq_s = dh . v_s, and the gradients of `first` ((N, d) in its dtype; (0,) without it) and of
    the view's slots ((N, S', d) contiguous, in the view's dtype)."""
    dq = probs.new_empty(_feature_tiles(view.shape[2]), *probs.shape)  # partial sums per tile
    dfirst = probs.new_empty(0) if first is None else torch.empty_like(first)
    dview = view.new_empty(view.shape)
    _launch(
        _jit().mix_backward, probs, first, view, dh, dq, probs if first is None else dfirst, dview
    )
    return dq.sum(0), dfirst, dview


@attnres_mix_backward.register_fake
def _(probs, first, view, dh):
    G, S, N = probs.shape
    dfirst = probs.new_empty(0) if first is None else torch.empty_like(first)
    return probs.new_empty(G, S, N), dfirst, view.new_empty(view.shape)


def takes(probs: torch.Tensor, first: torch.Tensor | None, view: torch.Tensor) -> bool:
    """Whether the kernels run on these tensors (module docstring)."""
    if not on_triton_device(view):
        return False
    dtypes = CUDA_DTYPES if view.device.type == "cuda" else INTERPRETER_DTYPES
    return (
        probs.dtype == torch.float32
        and view.dtype in dtypes
        and (first is None or first.dtype in dtypes)
        and view.stride(2) == 1
    )


def triton_products(p, first, view, merge: bool = False):
    """torch_products' result from the kernel, where it takes the tensors (the kernel counts no
    FLOPs: `merge` changes nothing here)."""
    if not takes(p, first, view):
        return torch_products(p, first, view, merge)
    first = None if first is None else first.contiguous()
    return attnres_mix(p.contiguous(), first, view)


def triton_gradients(p, first, view, dh):
    """torch_gradients' results from the kernel, where it takes the tensors: the gradients in
    the sources' dtypes (GroupMix and MergeMix convert the others)."""
    if not takes(p, first, view):
        return torch_gradients(p, first, view, dh)
    first = None if first is None else first.contiguous()
    dq, dfirst, dview = attnres_mix_backward(p.contiguous(), first, view, dh.contiguous())
    return dq, (None if first is None else dfirst), (dview if view.shape[1] else None)


KERNELS = (triton_products, triton_gradients)


class TritonAttnResFull(GroupedAttnResFull):
    mix_kernels = KERNELS


class TritonAttnResBlocks(GroupedAttnResBlocks):
    mix_kernels = KERNELS


SWAPS = {
    ("cuda", AttnResFull): TritonAttnResFull,
    ("cuda", AttnResBlocks): TritonAttnResBlocks,
}


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, or None (looks for triton without importing it: triton
    reads TRITON_INTERPRET when it is first imported)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None
