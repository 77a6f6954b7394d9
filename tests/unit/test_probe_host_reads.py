"""The probe, removal and NLL stages read values from the model's device a fixed number of times,
whatever the depth: never once per layer, per pass or per scored window. On a GPU every such read
waits for all the work queued before it, so a read inside a loop over layers stalls the device L
times per probe.

A CPU run cannot see a GPU synchronise, so the reads are counted: a TorchFunctionMode marks every
tensor computed from the model's parameters or the token sample, or made with an explicit
`device=` (the code put it beside them), as "on the device" and counts
each read of such a tensor by the host (.cpu(), .item(), .tolist(), .numpy(), float(), bool(),
torch.allclose, and writing one into a host tensor) that the stages' own code makes. The same
probes on a model of 2 and of 5 layers must read equally often.

Reads made inside depthbench/models/ (the architectures' adapters) count too: a probe resumes
AttnRes's depth state once per layer (DepthSources.fork), which knows whether the pseudo-queries
changed from their key (AttnResFull.reader_key) rather than from reading them."""

from __future__ import annotations


import numpy as np
import pandas as pd
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from depthbench.evals.nll import Window, score_windows
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.probes.measure import probe_model
from depthbench.probes.removal import ScoredTokens, removal_losses
from depthbench.probes.run import probe_settings

T = torch.Tensor
READS = {
    T.cpu,
    T.item,
    T.tolist,
    T.numpy,
    T.__float__,
    T.__int__,
    T.__bool__,
    T.__index__,
    T.__array__,
    torch.allclose,
    torch.equal,
}


def _to_host(args, kwargs) -> bool:
    """Tensor.to whose target is the CPU."""
    targets = [*args[1:], kwargs.get("device")]
    return any(str(t) == "cpu" for t in targets if isinstance(t, (str, torch.device)))


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors derived from the roots (module docstring). Tensors are kept
    alive for the mode's lifetime, so that an id is never reused."""

    def __init__(self, roots):
        super().__init__()
        self.device_side: dict[int, torch.Tensor] = {}
        self.reads = 0
        for t in roots:
            self.device_side[id(t)] = t

    def _on_device(self, values) -> bool:
        return any(id(v) in self.device_side for v in tree_leaves(values) if isinstance(v, T))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or (func is T.to and _to_host(args, kwargs)):
            out = func(*args, **kwargs)
            if self._on_device(args[:1]):
                self.reads += 1
                if out is args[0]:  # .cpu() of a CPU tensor is itself: the copy is a new tensor
                    out = out.clone()
            return out
        if func is T.__setitem__ and not self._on_device(args[:1]) and self._on_device(args[2:]):
            self.reads += 1  # a device value written into a host tensor
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self._on_device((args, kwargs)) or kwargs.get("device") is not None:
            for v in tree_leaves(out):
                if isinstance(v, T):
                    self.device_side[id(v)] = v
        return out


def _model(arch: str, n_layer: int):
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch, vocab_size=64, d_model=32, n_layer=n_layer, n_head=4, max_seq_len=16
    )
    return build_model(cfg).eval()


def _sample() -> torch.Tensor:
    return torch.randint(0, 64, (4, 13), generator=torch.Generator().manual_seed(0))


def _probe_reads(arch: str, n_layer: int) -> int:
    model, idx = _model(arch, n_layer), _sample()
    settings = {**probe_settings({}), "threads": 1}
    with HostReads([*model.parameters(), *model.buffers(), idx]) as mode:
        rows = probe_model(model, idx, "trained", settings, full=True)
    assert rows and mode.reads > 0
    return mode.reads


@pytest.mark.parametrize("arch", ["pre_ln", "hc", "mhc", "attnres_block", "attnres_full", "moda"])
def test_probes_read_the_device_as_often_at_every_depth(arch):
    assert _probe_reads(arch, 2) == _probe_reads(arch, 5)


def _removal_reads(n_layer: int) -> int:
    model, idx = _model("pre_ln", n_layer), _sample()
    data = {"val": ScoredTokens.windows(idx), "code": ScoredTokens.windows(idx.flip(0))}
    sets = [("last", 0, k, list(range(n_layer - k, n_layer))) for k in range(1, n_layer)]
    with HostReads([*model.parameters(), *model.buffers(), idx]) as mode:
        full, rows = removal_losses(model, sets, data)
    assert set(full) == {"val", "code"} and len(rows) == n_layer - 1
    return mode.reads


def test_removal_reads_each_domain_once_whatever_the_number_of_sets():
    assert _removal_reads(2) == _removal_reads(6) == 2


def test_nll_reads_every_window_sum_at_once():
    model = _model("pre_ln", 2)
    windows = [Window(inputs=list(range(1, 9 + i)), targets=[5, 6, 7], doc=i) for i in range(6)]
    params = [*model.parameters(), *model.buffers()]
    counts = []
    for n in (2, 6):
        with HostReads(params) as mode:
            sums = score_windows(model, windows[:n], tokens_per_batch=16, device="cpu")
        assert len(sums) == n and np.isfinite(sums).all()
        counts.append(mode.reads)
    assert counts == [1, 1]
    assert isinstance(pd.Series(sums).sum(), float)
