"""Top-k mixture of SwiGLU experts (the sparsity knob of "When Does Sparsity Mitigate the Curse
of Depth", arXiv 2603.15389), usable as the FFN sublayer of every architecture.

Routing: p = softmax(W_r x) over E experts (fp32); the k largest p are renormalised to sum to 1
(documented choice, as in Mixtral) and weight the chosen experts' outputs. Load balancing: the
Switch-Transformer loss E * sum_e f_e * P_e, where f_e is the fraction of the N*k routing slots
sent to expert e and P_e the mean router probability of e; it equals 1 when routing is uniform.
The layer stores `aux_loss` = aux_loss_coef * that loss after each forward.

Dispatch without host syncs: the N*k routing slots are sorted by expert (a stable
sort, so each expert sees its tokens in token order, as a per-expert loop would),
the tokens gathered into that order, and each SwiGLU projection is one grouped matrix product
(`F.grouped_mm`) whose group boundaries are the cumulative counts per expert, a device tensor:
no `.nonzero()`, no `.item()`, no boolean indexing, the same shapes every step (torch.compile
traces it once). The outputs are put back in slot order and summed over the k slots of a token
with their weights. Every expert's weights enter every step's graph (one grouped product over
all of them), so an expert that receives no token gets a zero gradient, never none, and DDP's
unused-parameter check never trips. Where `F.grouped_mm` does not serve (no such function, fp64,
fp32 or pre-Hopper GPUs on CUDA) every expert runs on every token with a weight of zero for the
tokens not routed to it: the same output, E/k times the expert FLOPs, still no sync. Dimensions
that are not a multiple of 8 are zero-padded for the grouped product (its rows must be 16-byte
aligned); zero rows and columns add exact zeros.

Parameter accounting: the budget fixes *total* parameters as built (every expert counted), as
for every other architecture; `inactive_parameters` (the E - k experts a token does not use) lets
`num_active_parameters` report the per-token active count, which the FLOP estimates use.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from depthbench.models.precision import autocast_dtype, replay
from depthbench.models.config import ModelConfig


class MoESwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.n_experts = int(moe["n_experts"])
        self.top_k = int(moe.get("top_k", 2))
        self.aux_loss_coef = float(moe.get("aux_loss_coef", 0.01))
        self.d_ff = int(moe.get("d_ff_expert") or cfg.d_ff)
        d, E = cfg.d_model, self.n_experts
        self.router = nn.Linear(d, E, bias=False)
        self.w13 = nn.Parameter(torch.empty(E, d, 2 * self.d_ff))  # per expert [W1 | W3], x @ w13
        self.w2 = nn.Parameter(torch.empty(E, self.d_ff, d))
        self.aux_loss: torch.Tensor | None = None
        self.inactive_parameters = (E - self.top_k) * 3 * d * self.d_ff

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.w13, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=std)

    def init_weights_xavier(self, gain: float) -> None:
        """Xavier-normal per expert projection (for DeepNorm): fans of each W1, W3, W2."""
        d = self.w13.shape[1]
        nn.init.normal_(self.w13, std=gain * math.sqrt(2.0 / (d + self.d_ff)))
        nn.init.normal_(self.w2, std=gain * math.sqrt(2.0 / (d + self.d_ff)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)  # (N, E)
        top_p, top_e = probs.topk(self.top_k, dim=-1)  # (N, k)
        top_p = (top_p / top_p.sum(-1, keepdim=True)).to(flat.dtype)
        dtype = _compute_dtype(flat)
        if _grouped_mm_serves(flat.device, dtype):
            y = self._grouped(flat, top_e, dtype)  # (N, k, d): expert output of each slot
            out = (y * top_p[..., None]).sum(1)
        else:
            out = self._dense(flat, top_e, top_p, dtype)
        # routing-slot counts per expert by a fixed-shape scatter (bincount syncs on CUDA)
        counts = torch.zeros(self.n_experts, device=flat.device).index_add_(
            0, top_e.reshape(-1), torch.ones(top_e.numel(), device=flat.device)
        )
        fraction = counts / top_e.numel()
        self.aux_loss = self.aux_loss_coef * self.n_experts * (fraction * probs.mean(0)).sum()
        return out.view(shape)

    def _grouped(self, flat: torch.Tensor, top_e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Every slot's expert output, (N, k, d), by two grouped products over slots sorted by
        expert."""
        N, k = top_e.shape
        slot_expert = top_e.reshape(-1)
        order = torch.sort(
            slot_expert, stable=True
        ).indices  # slots grouped by expert, token order within
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=flat.device).index_add_(
            0, slot_expert, torch.ones_like(slot_expert)
        )
        offs = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
        xs = flat.index_select(0, order // k).to(dtype)
        gate, up = _grouped_mm(xs, self.w13.to(dtype), offs).chunk(2, dim=-1)
        ys = _grouped_mm(F.silu(gate) * up, self.w2.to(dtype), offs)
        return ys.new_empty(ys.shape).index_copy(0, order, ys).view(N, k, -1)

    def _dense(self, flat, top_e, top_p, dtype) -> torch.Tensor:
        """Fallback: every expert on every token, weighted by its routing weight (0 where
        unrouted)."""
        weight = torch.zeros(flat.shape[0], self.n_experts, dtype=top_p.dtype, device=flat.device)
        weight = weight.scatter(1, top_e, top_p)
        out = torch.zeros_like(flat)
        xs = flat.to(dtype)
        for e in range(self.n_experts):
            gate, up = (xs @ self.w13[e].to(dtype)).chunk(2, dim=-1)
            out = out + ((F.silu(gate) * up) @ self.w2[e].to(dtype)) * weight[:, e, None]
        return out


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert products run in: autocast's where it is on (as `@` would be cast),
    on meta the memory trace's replayed autocast (depthbench.models.precision)."""
    return autocast_dtype(x)


def _grouped_mm_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.grouped_mm runs this dtype on this device: CPU fp32/bf16/fp16 (bf16 only under
    torch.compile), CUDA bf16 on Hopper or newer (its documented kernels). On the meta device the
    memory trace (depthbench.models.precision.replay) stands for a target device and takes its
    path, CUDA's for the planner's GPUs (Hopper or newer); outside a trace meta takes the dense
    fallback: an upper bound on the experts' activations."""
    if not hasattr(F, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False  # its fake-tensor rule (what torch.compile traces with) accepts bf16 only
    kind = device.type
    if kind == "meta":
        state = replay()
        if state is None:
            return False
        kind = state.device
        if kind == "cuda":
            return dtype == torch.bfloat16
    if kind == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    if kind == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return False


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a (M, K) rows in groups ending at `offs`, times b[g] (K, N) for group g -> (M, N); K and N
    zero-padded to multiples of 8 where they are not (16-byte aligned strides)."""
    K, N = b.shape[1:]
    pk, pn = -K % 8, -N % 8
    if pk or pn:
        a, b = F.pad(a, (0, pk)), F.pad(b, (0, pn, 0, pk))
    out = F.grouped_mm(a, b, offs=offs)
    return out[:, :N] if pn else out


def _register_grouped_mm_flops() -> None:
    """FlopCounterMode's count for aten._grouped_mm (torch has none, so the products would count
    zero and the FLOP checks of depthbench.models.cost would miss the experts): every row of a
    (M, K) meets one (K, N) matrix, 2 M K N in all, the formula of mm."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None or op in flop_registry or op.default in flop_registry:
        return

    @register_flop_formula(op)
    def _flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[-2] * a_shape[-1] * b_shape[-1]


_register_grouped_mm_flops()
