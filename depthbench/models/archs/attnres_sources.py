"""The depth attention of Attention Residuals (attnres_full.py, attnres_block.py): one reader's
pseudo-query and mix (`DepthAttention`) and the sources it mixes with their logits
(`DepthSources`).

A reader s mixes h_s = sum_i softmax_i(w_s . N_s(v_i)) v_i over its sources v_i. Since
N_s(v) = g_s * v / rms(v), the logit w_s . N_s(v_i) = (w_s * g_s) . (v_i / rms(v_i)) =
q_s . unit_i: each source is RMS-normalised once (`rms_unit`), and when it is added its logits
against the effective queries q_s of every later reader come from one matmul. The mix is one
multiply-add per source (`WeightedSum`): the sources are never stacked (an O(S) copy per reader,
so O(L^2) over the network), and no (S, B, T, d) product is materialised. Faster mixes subclass
`DepthSources` (depthbench.kernels.attnres_groups) and are swapped in from outside.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from depthbench.models.layers import RMSNorm, at_least_fp32


class DepthAttention(nn.Module):
    """One reader's pseudo-query w and key-norm gain g: its sources are mixed under
    softmax_i(w . N(v_i)) (DepthSources.mix)."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))  # pseudo-query w, zero init
        self.key_norm = RMSNorm(d_model, eps)  # N: its gain applies to the keys only

    def effective_query(self) -> torch.Tensor:
        """q = w * g, so that w . N(v) = q . (v / rms(v))."""
        return self.query * self.key_norm.weight


def rms_unit(v: torch.Tensor, eps: float) -> torch.Tensor:
    """v / rms(v): RMSNorm without its gain."""
    return v * torch.rsqrt(at_least_fp32(v).pow(2).mean(-1, keepdim=True) + eps).to(v.dtype)


class DepthSources:
    """The sources each reader may attend to, with their logits. Full AttnRes: every earlier
    output. Readers are numbered 0 .. 2L (the 2L sublayers, then the final aggregation);
    `queries` (d, 2L + 1) holds their effective queries. A source added after reader r - 1 ran
    is read by readers r .. 2L: its logits for all of them are computed at once."""

    def __init__(self, v0: torch.Tensor, queries: torch.Tensor, eps: float):
        self.eps = eps
        self.queries = queries
        self.next_reader = 0
        self.values: list[torch.Tensor] = []
        self.units: list[torch.Tensor] = []  # v / rms(v), kept for fork()
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(queries.shape[1])]  # per reader
        # the next reader's mix, once computed (h_l for probes, then its input)
        self.reads: dict = {}
        # what `queries` were made of, when the model says (AttnResFull.reader_key): fork()
        # compares keys on the host; without one it compares the queries themselves
        self.key: tuple | None = None
        self.append(v0)

    def _add_logits(self, unit: torch.Tensor) -> None:
        # a matmul (the FLOP counter counts it): 2 d per (source, reader), as cost.py charges.
        # Computed as (readers, B*T) so that each reader's column is contiguous: read() stacks
        # them, and stacking strided columns of a (B, T, readers) product is a slow gather.
        B, T, d = unit.shape
        rows = self.queries[:, self.next_reader :].t() @ unit.reshape(B * T, d).t()
        for reader, row in enumerate(rows.view(-1, B, T).unbind(0), start=self.next_reader):
            self.logits[reader].append(row)

    def append(self, v: torch.Tensor) -> None:
        """v becomes a source of every reader from `next_reader` on."""
        unit = rms_unit(v, self.eps)
        self._add_logits(unit)
        self.values.append(v)
        self.units.append(unit)

    def sources(self, extra: torch.Tensor | None = None):
        """The sources to mix, in order (`extra` last: Block AttnRes's partial sum)."""
        return list(self.values) + ([extra] if extra is not None else [])

    def read(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The next reader's S sources (B, T, d each) and their logits (S, B, T)."""
        return self.sources(), torch.stack(self.logits[self.next_reader])

    @staticmethod
    def mix(values, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h = sum_i softmax_i(logits) v_i (B, T, d) and the weights (S, B, T), for the S
        sources `values` and their logits (S, B, T)."""
        weights = torch.softmax(at_least_fp32(logits), dim=0).to(values[0].dtype)
        return WeightedSum.apply(weights, *values), weights

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next reader's mix (h, weights), computed once per reader: the probes read it as
        h_l, and the layer's first sublayer then takes it as its input."""
        if self.next_reader not in self.reads:
            self.reads = {self.next_reader: self.mix(*self.read())}
        return self.reads[self.next_reader]

    def add(self, out: torch.Tensor, layer: int, is_last_sublayer_of_layer: bool) -> None:
        """The reader that just ran produced `out`."""
        self.next_reader += 1
        self.append(out)

    def skip_layer(self, layer: int) -> None:
        """Layer `layer` removed: its two readers do not run and add no source, so later readers'
        softmaxes run over the other sources only (a zero source would keep softmax mass)."""
        self.next_reader += 2

    def fork(self, queries: torch.Tensor, key: tuple | None = None) -> "DepthSources":
        """A copy whose later additions leave this one unchanged (tensors are shared), with the
        logits of the readers still to run recomputed for `queries`: a probe resuming from this
        state may have swapped the pseudo-queries of later layers. With the queries' `key`
        (AttnResFull.reader_key) and one recorded for this state, equal queries are known from
        the keys, on the host; otherwise they are compared (a read of the device per fork)."""
        other = copy.copy(self)
        other.values, other.units = list(self.values), list(self.units)
        if key is not None and self.key is not None:
            same = same_key(key, self.key)
        else:
            same = torch.equal(queries, self.queries)  # False for another shape too
        other.reads = dict(self.reads) if same else {}
        # readers that already ran never read again: their logits are not carried over
        past = [[] for _ in self.logits[: self.next_reader]]
        if same:
            # nothing swapped (a baseline pass): the pending logits still hold
            other.logits = past + [list(column) for column in self.logits[self.next_reader :]]
            return other
        other.queries, other.key = queries, key
        other.logits = past + [[] for _ in self.logits[self.next_reader :]]
        for unit in other.units:
            other._add_logits(unit)
        return other


def same_key(a: tuple, b: tuple) -> bool:
    """Whether two keys of AttnResFull.reader_key name the same parameters, in order, at the same
    versions (the parameters compared by identity: comparing tensors would read them)."""
    return len(a) == len(b) and all(p is q and u == v for (p, u), (q, v) in zip(a, b))


class WeightedSum(torch.autograd.Function):
    """h = sum_i w_i v_i over the S sources v_i (B, T, d) with per-token weights w (S, B, T), as
    one multiply-add per source.

    Forward: a multiply-add per source into one buffer. Backward: dv_i = w_i dh and
    dw_i = dh . v_i, the latter one fused dot product per source (linalg.vecdot) instead of a
    product tensor and a sum. One autograd node instead of S: with up to 2L + 1 sources per reader
    and 2L + 1 readers, autograd's per-node work and the extra passes would be a visible share of
    Full AttnRes's step time."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        h = values[0] * weights[0].unsqueeze(-1)
        for i in range(1, len(values)):
            h.addcmul_(weights[i].unsqueeze(-1), values[i])
        ctx.save_for_backward(weights, *values)
        return h

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights, *values = ctx.saved_tensors
        grad_weights = None
        if ctx.needs_input_grad[0]:
            # (under autocast the sources may be bf16 and the sum fp32: the dot takes one dtype)
            grad_weights = torch.stack(
                [torch.linalg.vecdot(grad, v.to(grad.dtype)) for v in values]
            )
        grad_values = [
            grad * weights[i].unsqueeze(-1) if ctx.needs_input_grad[1 + i] else None
            for i in range(len(values))
        ]
        return grad_weights, *grad_values
