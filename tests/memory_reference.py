"""What the memory estimate is held to: the bytes autograd keeps for backward after one forward,
measured on a real device (`measured_saved_bytes`, counted independently of
depthbench.train.memory: tests/unit/test_memory.py on the CPU, tests/integration/test_gpu.py on
CUDA), and the bounds against a measured CUDA training step (`assert_within_cuda_bounds`: the
GPU tests, and the CPU tests against the H200 record in tests/data/)."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import torch

from depthbench.kernels.swap import swap_in
from depthbench.train.memory import MemoryEstimate
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model


def measured_saved_bytes(
    cfg: ModelConfig,
    bf16: bool,
    micro_batch: int,
    seq_len: int,
    device: str = "cpu",
    grouped_mm: bool = True,
    backend: str | None = None,
) -> int:
    """Every distinct storage (parameters excluded) that one forward of `cfg`'s model on
    `micro_batch` x `seq_len` random tokens saves for backward, under `device`'s bf16 autocast
    when `bf16`, with the implementations of `backend` (depthbench.kernels.swap; default: the
    definitions). `grouped_mm=False`: MoE experts take the every-expert path (CUDA's for
    fp32)."""
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    if backend is not None:
        swap_in(model, backend)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    idx = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), device=device)
    serves = (
        mock.patch("depthbench.models.moe._grouped_mm_serves", lambda *a: False)
        if not grouped_mm
        else nullcontext()
    )
    with serves, torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(idx, targets=idx)
    # tensors a custom autograd.Function keeps as ctx attributes rather than saving them (buffers
    # written in place by later layers) are found by walking the graph: every node of a Python
    # Function is its ctx
    for node in graph_nodes(out.loss.grad_fn):
        for value in getattr(node, "__dict__", {}).values():
            for t in flat_tensors(value):
                s = t.untyped_storage()
                if s.data_ptr() not in params:
                    storages[s.data_ptr()] = s.nbytes()
    out.loss.backward()  # the graph was real: backward runs from what was saved
    return sum(storages.values())


def graph_nodes(root):
    """Every node of the autograd graph below `root`, once. The Python objects standing for the
    nodes are kept while the walk lasts: one freed could hand its id to another node's, which
    would then be skipped as seen."""
    seen, alive, todo = set(), [], [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        alive.append(node)
        yield node
        todo += [n for n, _ in node.next_functions]


def flat_tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from flat_tensors(v)


# The bounds of the estimate against a CUDA training step (tests/data/h200_training_step_memory.json
# holds one measured on an H200: each bound's measured range is in its comment).
GRAPH_RTOL = 1e-6  # saved activations vs the storages autograd keeps: 1.3e-7 at most
ALLOCATOR_SAVED_RTOL = 0.025  # vs the allocator's growth over the forward: 0.2-2.1 % below it
STATIC_FLOOR = 0.95  # weights + AdamW vs the allocator between steps: 0.974-0.992 of it
# the peak, an upper bound: 1.002-1.082 x the measured step of one micro-batch
# (MemoryEstimate.single_micro_batch); for a step accumulating micro-batches the same bounds are
# an unmeasured expectation (tests/integration/test_gpu.py measures one of two)
PEAK_CEILING = 1.10


def assert_within_cuda_bounds(est: MemoryEstimate, measured: dict) -> dict:
    """`measured`: the CUDA bytes of a training step ("static", "saved", "peak"; "graph_saved"
    for the plain loss), as depthbench.train.measured_memory.allocator_step_memory and
    `measured_saved_bytes` read them. Returns the ratios estimate / measured."""
    ratios = {
        "static": (est.weights + est.optimizer) / measured["static"],
        "saved": est.activations / measured["saved"],
        "peak": est.total("none") / measured["peak"],
    }
    if "graph_saved" in measured:
        ratios["graph_saved"] = est.activations / measured["graph_saved"]
    assert abs(ratios.get("graph_saved", 1) - 1) <= GRAPH_RTOL, ratios
    assert abs(ratios["saved"] - 1) <= ALLOCATOR_SAVED_RTOL, ratios
    assert STATIC_FLOOR <= ratios["static"] <= 1, ratios
    assert 1 <= ratios["peak"] <= PEAK_CEILING, ratios
    return ratios
