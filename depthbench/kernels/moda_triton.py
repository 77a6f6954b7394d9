"""MoDA's joint attention on CUDA with its sequence chunk in Triton: flash-linear-attention's
causal softmax attention (fla-core, `fla.ops.attn.parallel`), swapped in for the chunked pair of
depthbench.kernels.moda_fused where fla-core is installed.

The joint attention of moda_fused.py needs two things of the sequence chunk's kernel: a forward
that returns the log-sum-exp of its scores, and a backward that recomputes its probabilities from
an lse and an output it is HANDED, so that handing it the joint lse and the joint output gives the
sequence chunk's exact share of the joint gradient (moda_fused.py, "Backward"). fla-core's pair
does both: `parallel_attn_fwd(q, k, v, ...)` returns (o, lse) and `parallel_attn_bwd(q, k, v, o,
g, lse, do, ...)` takes them, with rowsum(o * do) taken from the o it is given. That is why it is
used rather than FlexAttention (whose backward cannot be handed the joint lse) or aten's CUDA
flash pair (whose lse layout differs by kernel and version). What the adapter relies on, held by
tests/unit/test_moda_triton.py against the chunked pair and the explicit definition:
- layout (B, T, H, hd) where DepthBench's pair uses (B, H, T, hd): transposed copies both ways;
- the lse in base 2 (the kernels score with exp2): multiplied by ln 2 on the way out and by
  1 / ln 2 on the way back;
- causal masking with no window, scores scaled by `scale`, head dimension at most 256;
- the Triton implementations themselves, called past fla's backend dispatch (which on Hopper
  with Triton 3.4 or later prefers its TileLang kernels where TileLang is installed): what runs
  is what the tests check. On such a device the swap keeps to the chunked pair
  (`kept_off_reason`) until a GPU run holds the Triton kernels to float64 attention there;
- the signatures of the two functions, checked before the first call (`_check_internals`):
  they are fla-core internals that another version may change, so the adapter takes only the
  version constraints.txt pins (`unavailable_reason`).

The two calls are custom ops (`depthbench::fla_causal_attention` and its backward), so
torch.compile keeps them opaque and the fake implementations give shapes on meta. The memory
estimate traces the chunked pair (meta tensors take it), whose blocks of QUERY_CHUNK x S scores
are transients this kernel never holds: an upper bound, with the same saved tensors.

On a CPU the kernels run under Triton's interpreter within depthbench.kernels.triton_streams'
`on_cpu()`, in float32 and float16 (how the tests hold them to the definition); elsewhere, for
float32 on CUDA (fla's products would run in TF32) and for other dtypes or heads wider than 256,
the chunked pair runs.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from importlib import metadata

import torch

from depthbench.kernels.moda_fused import CHUNKED, ChunkedMoDABlock
from depthbench.kernels.triton_streams import on_triton_device
from depthbench.models.archs.moda import MoDABlock

FLA_VERSION = "0.6.0"  # constraints.txt's pin: the version whose internals the adapter follows
MAX_HEAD_DIM = 256  # fla's kernels hold a head's keys in one block of at most 256
# the dtypes the pair takes: on CUDA the half-precision ones (fla's tl.dot computes float32 in
# TF32, whatever torch allows; float32 on CUDA stays on the chunked pair, whose products follow
# torch's setting), in the interpreter float32 too (true float32 there: how the tests hold it)
CUDA_DTYPES = (torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32, torch.float16)
LN2 = math.log(2.0)
# the parameters of fla-core's two functions that the adapter passes, in order
FORWARD_PARAMETERS = ("q", "k", "v", "g_cumsum", "sink_bias", "scale")
BACKWARD_PARAMETERS = ("q", "k", "v", "o", "g_cumsum", "lse", "do", "sink_bias", "scale")


@functools.cache
def _fla():
    """fla-core's forward and backward, checked, without fla's backend dispatch (which may route
    a call to another backend): the Triton implementations the tests hold to the reference."""
    from fla.ops.attn import parallel

    _check_internals(parallel)
    return inspect.unwrap(parallel.parallel_attn_fwd), inspect.unwrap(parallel.parallel_attn_bwd)


def _check_internals(parallel) -> None:
    """Fail loudly where fla-core's functions no longer take what the adapter passes."""
    for name, expected in (
        ("parallel_attn_fwd", FORWARD_PARAMETERS),
        ("parallel_attn_bwd", BACKWARD_PARAMETERS),
    ):
        fn = inspect.unwrap(getattr(parallel, name))
        found = tuple(inspect.signature(fn).parameters)[: len(expected)]
        if found != expected:
            raise RuntimeError(
                f"fla.ops.attn.parallel.{name} takes {found}, not {expected}: the fla-core "
                f"installed is not the {FLA_VERSION} that depthbench.kernels.moda_triton follows"
            )


def _heads_last(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


@torch.library.custom_op("depthbench::fla_causal_attention", mutates_args=())
def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q, k, v (B, H, T, hd) -> y (B, H, T, hd) and its natural log-sum-exp
    (B, H, T) in float32."""
    forward, _ = _fla()
    y, lse2 = forward(_heads_last(q), _heads_last(k), _heads_last(v), None, None, scale)
    return _heads_last(y), _heads_last(lse2.mul(LN2))


@causal_attention.register_fake
def _(q, k, v, scale):
    B, H, T, _ = q.shape  # contiguous, as the real op returns them
    return q.new_empty(B, H, T, v.shape[-1], dtype=v.dtype), q.new_empty(
        B, H, T, dtype=torch.float32
    )


@torch.library.custom_op("depthbench::fla_causal_attention_backward", mutates_args=())
def causal_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of causal attention whose probabilities are exp(score - lse) for the natural
    log-sum-exp `lse` (B, H, T) and whose output is `out` (FlashAttention-2's backward)."""
    _, backward = _fla()
    dq, dk, dv, _, _ = backward(
        _heads_last(q),
        _heads_last(k),
        _heads_last(v),
        _heads_last(out),
        None,
        _heads_last(lse.float().div(LN2)),
        _heads_last(grad),
        scale=scale,
    )
    return (
        _heads_last(dq).to(q.dtype),
        _heads_last(dk).to(k.dtype),
        _heads_last(dv).to(v.dtype),
    )


@causal_attention_backward.register_fake
def _(grad, q, k, v, out, lse, scale):  # contiguous, as the real op returns them
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def triton_attention_forward(q, k, v, dropout_p=0.0, is_causal=True, *, scale):
    """The pair's forward, in the signature of aten's CPU flash forward."""
    assert dropout_p == 0.0 and is_causal
    return causal_attention(q, k, v, scale)


def triton_attention_backward(grad, q, k, v, out, lse, dropout_p=0.0, is_causal=True, *, scale):
    """The pair's backward, in the signature of aten's CPU flash backward."""
    assert dropout_p == 0.0 and is_causal
    return causal_attention_backward(grad.contiguous(), q, k, v, out, lse, scale)


TRITON = (triton_attention_forward, triton_attention_backward)


class TritonMoDABlock(ChunkedMoDABlock):
    """The cuda backend's MoDA layer where fla-core is installed: the sequence chunk in Triton,
    the chunked pair where the kernel does not take the tensors (meta, another dtype, a head
    wider than 256)."""

    def kernel_pair(self, q: torch.Tensor, k: torch.Tensor):
        pair = super().kernel_pair(q, k)
        dtypes = CUDA_DTYPES if q.device.type == "cuda" else INTERPRETER_DTYPES
        if (
            pair is CHUNKED
            and on_triton_device(q)
            and q.dtype in dtypes
            and q.shape[-1] <= MAX_HEAD_DIM
        ):
            return TRITON
        return pair


SWAPS = {("cuda", MoDABlock): TritonMoDABlock}


def unavailable_reason() -> str | None:
    """Why the Triton pair cannot run here, or None. Looks for the packages without importing
    them (triton reads TRITON_INTERPRET when it is first imported)."""
    for package, install in (("triton", "triton"), ("fla", "fla-core"), ("einops", "einops")):
        if importlib.util.find_spec(package) is None:
            return f"{install} is not installed (pip install {install})"
    try:
        version = metadata.version("fla-core")
    except metadata.PackageNotFoundError:  # fla importable without its distribution's metadata
        version = "of unknown version"
    if version != FLA_VERSION:
        return f"fla-core {version} is installed; the adapter follows {FLA_VERSION}"
    return kept_off_reason()


def kept_off_reason() -> str | None:
    """Why the CUDA device here keeps to the chunked pair, or None. On Hopper (sm_90) with Triton
    3.4 or later, fla-core prefers its TileLang attention to these Triton kernels wherever
    TileLang can run (`fla.ops.attn.backends`, citing Triton's codegen regressions on Hopper),
    and no GPU run has yet held them to float64 attention there
    (tests/integration/test_gpu.py::test_moda_pairs_on_cuda_against_float64 does, on a GPU)."""
    if not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability()
    triton = _triton_version()
    if major == 9 and triton >= (3, 4):
        return (
            "Hopper with Triton {}.{}: fla-core prefers its TileLang attention to these Triton "
            "kernels there, and no GPU run has checked them there".format(*triton)
        )
    return None


def _triton_version() -> tuple[int, int]:
    """(major, minor) of the triton that runs, as fla-core reads it (on a CUDA machine, where
    importing triton here is harmless: TRITON_INTERPRET matters only on a CPU)."""
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
