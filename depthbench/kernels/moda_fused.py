"""MoDA's joint attention as one fused computation: swapped in for the definition's explicit score
matrices (depthbench.models.archs.moda.MoDABlock.joint_attention) on both backends
(depthbench.kernels.swap).

The joint softmax of moda.py, p = softmax([q k_j / sqrt(hd) for j <= t ; q k^depth_m / sqrt(hd)]),
is one online softmax over two chunks of keys: the causal sequence keys and the D depth keys of
the same position. With lse_s the log-sum-exp of the sequence scores, s_m the depth scores and
lse = logaddexp(lse_s, logsumexp_m s_m) the joint one,

    y = exp(lse_s - lse) * y_s + sum_m exp(s_m - lse) v^depth_m                      (1)

where y_s is plain causal attention. y_s and lse_s come from the fused causal kernel (flash
attention on CPU), so no (T, S) score matrix is ever held. The depth chunk is two batched
products per layer over the depth keys of every position at once, read from a preallocated
buffer (`DepthBuffer`) that each layer writes its own keys into: no layer re-stacks the keys of
the layers before it (the explicit path's torch.stack is O(L^2) copies over the network).

Backward (FlashAttention-2's, split by chunk): with dy, the joint output y and D = rowsum(dy * y),
a score's gradient is p (dp - D), dp = dy . v, for both chunks. The fused kernel's backward
recomputes its probabilities as exp(score - lse) from the lse and output it is handed, so handing
it the JOINT lse and y gives exactly the sequence chunk's part of the joint gradient (dq, dk, dv);
the depth chunk's part is four batched products (`_depth_backward`).

The sequence chunk's kernel pair (forward with its log-sum-exp; backward from a given lse and
output), by backend (`_kernel_for`):
- cpu: aten's fused flash-attention pair (`_scaled_dot_product_flash_attention_for_cpu` and its
  backward), on CPU tensors of the dtypes it takes.
- cuda without fla-core (with it, depthbench.kernels.moda_triton swaps in fla-core's Triton pair,
  which takes what it can and hands the rest to this one), and every tensor the CPU pair does not
  take (meta, for the memory trace): `chunked_attention_forward` / `_backward`, the same two
  functions written with torch operations over blocks of QUERY_CHUNK queries: each block's scores
  against the keys up to its last query are formed, used and dropped (at most QUERY_CHUNK x S per
  head at a time, never T x S), and backward recomputes them from the lse (FlashAttention-2's
  recomputation, blocked by queries only). Every product has a float32 result: on CUDA from
  bf16/fp16 operands (`torch.bmm(..., out_dtype=float32)`, tensor cores with fp32 accumulation, as a
  flash kernel; p and ds cast down to the operands' dtype as flash casts them), elsewhere from
  float32 copies. Chosen over FlexAttention, which in torch 2.13 has no backward on the CPU (so
  could not be held to the explicit path by the CPU tests) and whose backward cannot be handed the
  joint lse; and over aten's CUDA flash / memory-efficient pairs, whose lse layouts differ by kernel
  and version. The cuda backend's implementation runs this pair on CPU tensors too, which is how the
  tests hold it to the explicit path. Where neither applies (a decoding offset, an integer dtype)
  `fused_joint_attention` returns None and the definition's explicit path runs.
"""

from __future__ import annotations

import math

import torch

from depthbench.models.archs.moda import MixtureOfDepthsAttention, MoDABlock
from depthbench.models.archs.moda_depth_keys import DepthBuffer, DepthKeys
from depthbench.models.layers import at_least_fp32


QUERY_CHUNK = 256  # queries per block of the chunked pair: at T = 2048 eight blocks per layer
# depth slots per broadcast product: the transients of D slots at once were the backward's peak
DEPTH_GROUP = 16


def _bmm32(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b (batched) in float32 (float64 kept). On CUDA with a bf16/fp16 compute `dtype` the
    operands go in that dtype with a float32 output (`bmm(out_dtype=float32)`: tensor-core
    products with fp32 accumulation, as a flash kernel's), float32 operands such as p and ds
    cast down as flash casts them; elsewhere the products run in float32."""
    if a.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a.to(dtype), b.to(dtype), out_dtype=torch.float32)
    return torch.bmm(at_least_fp32(a), at_least_fp32(b))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * q k^T in float32 (float64 kept) for q (N, c, hd), k (N, S, hd)."""
    return _bmm32(q, k.transpose(1, 2), q.dtype).mul_(scale)


def _causal_block(s: torch.Tensor, start: int) -> torch.Tensor:
    """Mask (in place, -inf) the keys after each query of a block of queries start.. of scores
    (N, c, S) over keys 0..S-1, S = start + c: only the block's last c key columns can be in the
    future."""
    c = s.shape[1]
    future = torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1)
    s[:, :, start:].masked_fill_(future, float("-inf"))
    return s


def chunked_attention_forward(q, k, v, dropout_p=0.0, is_causal=True, *, scale):
    """Causal attention and its log-sum-exp, block by block of queries; the signature and
    results of aten's CPU flash forward: q, k, v (B, H, T, hd) -> y (B, H, T, hd), lse (B, H, T)
    in float32 (float64 for float64 inputs)."""
    assert dropout_p == 0.0 and is_causal
    B, H, T, hd = q.shape
    qf, kf, vf = (t.reshape(B * H, T, hd) for t in (q, k, v))
    y = torch.empty_like(qf)
    lse = torch.empty(B * H, T, dtype=at_least_fp32(q).dtype, device=q.device)
    for start in range(0, T, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, T)
        s = _causal_block(_scores(qf[:, start:end], kf[:, :end], scale), start)  # (N, c, end)
        block_lse = s.logsumexp(-1)
        p = torch.exp(s - block_lse.unsqueeze(-1))
        y[:, start:end] = torch.bmm(p.to(vf.dtype), vf[:, :end])
        lse[:, start:end] = block_lse
    return y.view(B, H, T, hd), lse.view(B, H, T)


def chunked_attention_backward(grad, q, k, v, out, lse, dropout_p=0.0, is_causal=True, *, scale):
    """(dq, dk, dv) of causal attention from the upstream gradient, the output and the lse it is
    handed (FlashAttention-2: p = exp(s - lse), dv = p^T dy, ds = p (dy v^T - rowsum(dy * out)),
    dq = scale ds k, dk = scale ds^T q), block by block of queries, the scores recomputed."""
    assert dropout_p == 0.0 and is_causal
    B, H, T, hd = q.shape
    qf, kf, vf, gf, of = (t.reshape(B * H, T, hd) for t in (q, k, v, grad, out))
    lf = lse.reshape(B * H, T, 1)
    # D = rowsum(dy * y), (N, T, 1)
    rowsum = torch.linalg.vecdot(at_least_fp32(gf), at_least_fp32(of)).unsqueeze(-1)
    acc, dtype = at_least_fp32(q).dtype, q.dtype
    dq = torch.empty(B * H, T, hd, dtype=acc, device=q.device)
    dk = torch.zeros(B * H, T, hd, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for start in range(0, T, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, T)
        s = _causal_block(_scores(qf[:, start:end], kf[:, :end], scale), start)
        p = torch.exp(s - lf[:, start:end])  # masked keys: exp(-inf) = 0
        g = gf[:, start:end]
        dv[:, :end] += _bmm32(p.transpose(1, 2), g, dtype)
        ds = p * (_bmm32(g, vf[:, :end].transpose(1, 2), dtype) - rowsum[:, start:end])
        dq[:, start:end] = _bmm32(ds, kf[:, :end], dtype) * scale
        dk[:, :end] += _bmm32(ds.transpose(1, 2), qf[:, start:end], dtype) * scale
    shape = (B, H, T, hd)
    return dq.view(shape).to(q.dtype), dk.view(shape).to(k.dtype), dv.view(shape).to(v.dtype)


CHUNKED = (chunked_attention_forward, chunked_attention_backward)


def _kernel_for(q: torch.Tensor, k: torch.Tensor, kernel: str = "auto"):
    """The causal kernel pair (forward with lse, backward) for these inputs, or None. `kernel`:
    auto (aten's CPU flash pair on CPU tensors of the dtypes it takes; the chunked pair
    otherwise) or chunked."""
    # queries must be all positions (no decoding offset)
    if q.shape[2] != k.shape[2] or not q.is_floating_point():
        return None
    if (
        kernel == "auto"
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16)
    ):
        fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
        if fwd is not None and bwd is not None:
            return fwd, bwd
    return CHUNKED


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


class _JointAttention(torch.autograd.Function):
    """Equation (1) and its gradient. Inputs: q (B, H, T, hd); k, v (B, H_kv, T, hd); the depth
    keys and values as buffer views (D, B, H_kv, T, hd), not differentiated (the buffer is written
    in place by later layers; slots < D never change, and they are held on ctx, not saved: a save
    would fail autograd's version check); then the tensors the slots were copied
    from, in order (k_1, v_1, k_2, ...): the gradient of each slot is returned to its tensor.

    The depth chunk works on the slot-major buffer with broadcasts over the D slots (one kernel
    each), faster on the CPU than a per-position (G, hd) x (hd, D) product as a batched matmul of
    thousands of tiny matrices (docs/design/architectures.md, MoDA). Query heads are viewed
    (B, H_kv, G, T, hd), G = H / H_kv sharing a KV head, so GQA needs no copy of the depth keys."""

    @staticmethod
    def forward(ctx, q, k, v, depth_k, depth_v, kernels, *sources):
        fwd, bwd = kernels
        B, H, T, hd = q.shape
        Hk = k.shape[1]
        scale = 1.0 / math.sqrt(hd)
        kr, vr = _repeat_kv(k, H // Hk), _repeat_kv(v, H // Hk)
        y_s, lse_s = fwd(q, kr, vr, 0.0, True, scale=scale)  # (B, H, T, hd), (B, H, T) fp32
        grouped = (B, Hk, H // Hk, T)
        qg = q.reshape(*grouped, hd)
        dk, dv = depth_k.unsqueeze(3), depth_v.unsqueeze(3)  # (D, B, H_kv, 1, T, hd)
        s = at_least_fp32(torch.linalg.vecdot(qg, dk)) * scale  # (D, B, H_kv, G, T) depth scores
        lse_sg = lse_s.reshape(grouped)
        lse = torch.logaddexp(lse_sg, s.logsumexp(0))  # the joint log-sum-exp
        p = torch.exp(s - lse)  # the depth chunk's joint probabilities
        y = torch.exp(lse_sg - lse).unsqueeze(-1).to(q.dtype) * y_s.reshape(*grouped, hd)
        pq = p.to(q.dtype).unsqueeze(-1)
        for g in _slot_groups(p.shape[0]):  # sum_m p_m v_m, DEPTH_GROUP slots' products at a time
            y += (pq[g] * dv[g]).sum(0)
        y = y.view(B, H, T, hd)
        # the joint lse in the layout the kernel's backward expects (that of its own lse)
        lse_joint = torch.empty_like(lse_s).copy_(lse.view(B, H, T))
        ctx.save_for_backward(q, kr, vr, y, lse_joint, p)
        ctx.depth, ctx.bwd, ctx.scale, ctx.kv_heads = (dk, dv), bwd, scale, Hk
        ctx.n_sources = len(sources)
        return y

    @staticmethod
    def backward(ctx, grad):
        q, kr, vr, y, lse, p = ctx.saved_tensors
        B, H, T, hd = q.shape
        Hk = ctx.kv_heads
        grad = grad.contiguous()
        dq, dkr, dvr = ctx.bwd(grad, q, kr, vr, y, lse, 0.0, True, scale=ctx.scale)
        if H != Hk:  # GQA: the repeated KV heads' gradients sum back onto each shared head
            dkr, dvr = (g.view(B, Hk, H // Hk, T, hd).sum(2) for g in (dkr, dvr))
        dq_d, d_depth_k, d_depth_v = _depth_backward(ctx, q.view(B, Hk, H // Hk, T, hd), y, grad, p)
        dq = dq + dq_d.view(B, H, T, hd)
        # the slots in order are k_1, v_1, k_2, v_2, ...: slot m of depth_k is source 2m
        per_source = [g for pair in zip(d_depth_k.unbind(0), d_depth_v.unbind(0)) for g in pair]
        return dq, dkr, dvr, None, None, None, *per_source[: ctx.n_sources]


def _depth_backward(ctx, qg, y, grad, p):
    """The depth chunk's share of the joint gradient: dp_m = dy . v_m, ds_m = p_m (dp_m - D)
    with D = rowsum(dy * y), then dq = scale sum_m ds_m k_m, dk_m = scale sum_g ds_m q and
    dv_m = sum_g p_m dy (sums over the G query heads of a KV head)."""
    (dk, dv), scale = ctx.depth, ctx.scale
    gg, yg = grad.view(qg.shape), y.view(qg.shape)
    rowsum = torch.linalg.vecdot(at_least_fp32(gg), at_least_fp32(yg))  # (B, H_kv, G, T)
    dp = at_least_fp32(torch.linalg.vecdot(gg, dv))  # (D, B, H_kv, G, T)
    ds = (p * (dp - rowsum)).to(qg.dtype).unsqueeze(-1)
    pq = p.to(qg.dtype).unsqueeze(-1)
    D = p.shape[0]
    dq = torch.zeros_like(qg)
    d_depth_k = qg.new_empty(D, *dk.shape[1:3], *dk.shape[4:])  # (D, B, H_kv, T, hd)
    d_depth_v = torch.empty_like(d_depth_k)
    for g in _slot_groups(D):  # DEPTH_GROUP slots' (B, H_kv, G, T, hd) products at a time
        dq += (ds[g] * dk[g]).sum(0)
        d_depth_k[g] = (ds[g] * qg).sum(3).mul_(scale)
        d_depth_v[g] = (pq[g] * gg).sum(3)
    return dq.mul_(scale), d_depth_k, d_depth_v


def _slot_groups(n: int):
    """Slices of at most DEPTH_GROUP depth slots covering 0..n-1."""
    return [slice(i, min(i + DEPTH_GROUP, n)) for i in range(0, n, DEPTH_GROUP)]


def fused_joint_attention(q, k, v, buffer: DepthBuffer, n_pairs: int, kernel: str = "auto"):
    """Equation (1) over the first `n_pairs` (k, v) pairs in `buffer`, or None where no fused
    kernel applies. q (B, H, T, hd); k, v (B, H_kv, T, hd) -> (B, H, T, hd). `kernel`: see
    _kernel_for."""
    return joint_attention_with(_kernel_for(q, k, kernel), q, k, v, buffer, n_pairs)


def joint_attention_with(kernels, q, k, v, buffer: DepthBuffer, n_pairs: int):
    """Equation (1) with the sequence chunk's kernel pair `kernels` (forward with lse, backward
    from a given output and lse, in the signatures of aten's CPU flash pair), or None where
    `kernels` is None or the buffer does not hold these keys."""
    if kernels is None or not buffer.fits(k):
        return None
    sources = buffer.tensors(n_pairs) if torch.is_grad_enabled() else []
    if sources is None:
        return None
    return _JointAttention.apply(q, k, v, buffer.k[:n_pairs], buffer.v[:n_pairs], kernels, *sources)


class FusedMoDA(MixtureOfDepthsAttention):
    """MoDA whose depth keys are copied into one buffer per forward as they come, for the fused
    joint attention of its layers to read."""

    buffered_depth = True


class FusedMoDABlock(MoDABlock):
    """The cpu backend's MoDA layer: the joint attention fused (aten's flash pair for the
    sequence chunk where it takes the tensors), the depth keys kept as they come (the buffer
    copies them)."""

    kernel = "auto"

    def kernel_pair(self, q: torch.Tensor, k: torch.Tensor):
        """The sequence chunk's kernel pair for these inputs, or None (the explicit path)."""
        return _kernel_for(q, k, self.kernel)

    def joint_attention(self, q, k, v, depth: DepthKeys) -> torch.Tensor:
        buffer = depth.buffer()
        y = None
        if buffer is not None:
            y = joint_attention_with(self.kernel_pair(q, k), q, k, v, buffer, len(depth))
        return super().joint_attention(q, k, v, depth) if y is None else y

    def depth_pair(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # the buffer copies them


class ChunkedMoDABlock(FusedMoDABlock):
    """The cuda backend's MoDA layer without fla-core: the sequence chunk by the chunked
    online-softmax pair."""

    kernel = "chunked"


SWAPS = {
    ("cpu", MixtureOfDepthsAttention): FusedMoDA,
    ("cpu", MoDABlock): FusedMoDABlock,
    ("cuda", MixtureOfDepthsAttention): FusedMoDA,
    ("cuda", MoDABlock): ChunkedMoDABlock,
}
