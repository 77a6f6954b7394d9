"""The Triton kernels of AttnRes's grouped depth mix (depthbench.kernels.attnres_triton, which
wraps them as torch custom ops). Imported only when they first run: triton reads
TRITON_INTERPRET when it is first imported, and may not be installed.

Both kernels take one tile of BLOCK_N tokens and BLOCK_D features per program and hold the
BLOCK_G readers of a group at once, so that each source tile is read once for the whole group:

- `mix_forward`: h[g, n, :] = sum_s p[g, s, n] v_s[n, :] for the probabilities p, v_0 = `first`
  (when HAS_FIRST) and v_1.. the slots of `view` (any token and slot strides, features
  contiguous), read in their own dtype and accumulated in float32.
- `mix_backward`: from dh (G, N, D) float32 and the probabilities p (G, S, N) float32, per
  source s:
  dq[g, s, n] = dh[g, n, :] . v_s[n, :]
  over the program's features (one partial sum per feature tile, summed by the caller) and
  dv_s[n, :] = sum_g p[g, s, n] dh[g, n, :], stored in the source's dtype.

Offsets are int64 (a (N, S, D) source buffer passes 2^31 elements at 32k tokens and L = 70): the
token and reader indices are int64, the feature index stays int32 (a contiguous run the compiler
can vectorise), and the loops advance pointers rather than multiply an int32 loop index. Feature
tiles are the grid's first axis, so that the programs of one token tile run together and share
the probabilities' reads in L2. Products are elementwise multiply-adds in float32 (no tl.dot, so
no TF32 on a GPU)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(
    N, D, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr
):
    """The program's readers g, tokens n (int64) and features f (int32, a contiguous run), and
    the masks of the (reader, token) and (token, feature) pairs that exist."""
    g = tl.arange(0, BLOCK_G).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    f = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    return g, n, f, (g[:, None] < G) & (n[None, :] < N), (n[:, None] < N) & (f[None, :] < D)


@triton.jit
def mix_forward(
    probs,  # (G, S, N) float32
    first,  # (N, D) or a dummy
    view,  # (N, S - HAS_FIRST, D), strides (stride_vn, stride_vs, 1)
    h,  # (G, N, D) float32, written
    N,
    S,
    D,
    stride_vn,
    stride_vs,
    G: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    g, n, f, gn, nf = _tile(N, D, G, BLOCK_G, BLOCK_N, BLOCK_D)
    row = probs + g[:, None] * S * N + n[None, :]  # (BLOCK_G, BLOCK_N) of source 0
    out = h + g[:, None, None] * N * D + n[None, :, None] * D + f[None, None, :]
    written = gn[:, :, None] & nf[None, :, :]
    # zeros, as a load of the output tile that reads nothing (S > 0, which the compiler does not
    # know): the accumulator then takes a load's coalesced layout, several features a thread,
    # where tl.zeros gets one feature a thread and every lane along the features loads each
    # probability again (benchmarks/triton_compile.py shows the compiled code)
    nothing = (g[:, None, None] * 0 + S) < 0
    acc = tl.load(out, mask=written & nothing, other=0.0)
    if HAS_FIRST:
        p = tl.load(row, mask=gn, other=0.0)
        v = tl.load(first + n[:, None] * D + f[None, :], mask=nf, other=0.0).to(tl.float32)
        acc += p[:, :, None] * v[None, :, :]
        row += N  # the loop starts at source 1
    slots = view + n[:, None] * stride_vn + f[None, :]
    for _ in range(HAS_FIRST, S):
        p = tl.load(row, mask=gn, other=0.0)
        v = tl.load(slots, mask=nf, other=0.0).to(tl.float32)
        acc += p[:, :, None] * v[None, :, :]
        row += N
        slots += stride_vs
    tl.store(out, acc, mask=written)


@triton.jit
def mix_backward(
    probs,  # (G, S, N) float32
    first,  # (N, D) or a dummy
    view,  # (N, S - HAS_FIRST, D), strides (stride_vn, stride_vs, 1)
    dh,  # (G, N, D) float32
    dq,  # (D tiles, G, S, N) float32, written: partial dh . v per feature tile
    dfirst,  # (N, D) in first's dtype, written
    dview,  # (N, S - HAS_FIRST, D) contiguous in view's dtype, written
    N,
    S,
    D,
    stride_vn,
    stride_vs,
    G: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    g, n, f, gn, nf = _tile(N, D, G, BLOCK_G, BLOCK_N, BLOCK_D)
    grad = tl.load(
        dh + g[:, None, None] * N * D + n[None, :, None] * D + f[None, None, :],
        mask=gn[:, :, None] & nf[None, :, :],
        other=0.0,
    )
    row = probs + g[:, None] * S * N + n[None, :]
    dq_row = dq + tl.program_id(0).to(tl.int64) * G * S * N + g[:, None] * S * N + n[None, :]
    if HAS_FIRST:
        p = tl.load(row, mask=gn, other=0.0)
        v = tl.load(first + n[:, None] * D + f[None, :], mask=nf, other=0.0).to(tl.float32)
        tl.store(dq_row, tl.sum(grad * v[None, :, :], axis=2), mask=gn)
        dv = tl.sum(p[:, :, None] * grad, axis=0)
        out = dfirst + n[:, None] * D + f[None, :]
        tl.store(out, dv.to(dfirst.dtype.element_ty), mask=nf)
    slots = view + n[:, None] * stride_vn + f[None, :]
    grads = dview + n[:, None] * (S - HAS_FIRST) * D + f[None, :]
    if HAS_FIRST:
        row += N  # the loop starts at source 1
        dq_row += N
    for _ in range(HAS_FIRST, S):
        p = tl.load(row, mask=gn, other=0.0)
        v = tl.load(slots, mask=nf, other=0.0).to(tl.float32)
        tl.store(dq_row, tl.sum(grad * v[None, :, :], axis=2), mask=gn)
        dv = tl.sum(p[:, :, None] * grad, axis=0)
        tl.store(grads, dv.to(dview.dtype.element_ty), mask=nf)
        row += N
        dq_row += N
        slots += stride_vs
        grads += D
