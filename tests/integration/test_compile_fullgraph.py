"""Every architecture compiles as training compiles it, without a graph break: each model's
checkpoint units (the blocks, or AttnRes's pre-normed sublayers) through one shared
torch.compile'd function (depthbench.train.parallelize.wrap_units, `train.compile: block`) with
`fullgraph=True` on the CPU's inductor, with the CPU's implementations swapped in (HC's and
mHC's C++ custom ops, MoDA's fused attention), and a training step's loss and gradients equal
eager's. mHC's Sinkhorn iterations are one custom op (depthbench.models.sinkhorn), not an
unrolled loop. Inductor checks each compiled library in a fresh interpreter (hence slow)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from depthbench.kernels.swap import swap_in
from depthbench.models.registry import PACKAGE_ARCHITECTURES
from depthbench.train.parallelize import wrap_units
from tests.parallel_models import VOCAB, assert_same, tiny

# graphs per model of 2 layers: one unit graph serves every layer (MoDA: one per depth-key
# count; AttnRes: an attention and an FFN sublayer)
GRAPHS = {"moda": 2, "attnres_full": 2, "attnres_block": 2}


@pytest.fixture(autouse=True)
def inductor_in_process():
    """Inductor compiles in this process (no pool of compile workers to start)."""
    import torch._inductor.config as inductor

    with inductor.patch(compile_threads=1):
        yield


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(PACKAGE_ARCHITECTURES))
def test_units_compile_with_fullgraph_and_train_as_eager(arch):
    model = swap_in(tiny(arch, n_layer=2), "cpu")
    reference = copy.deepcopy(model)
    counters.clear()
    wrap_units(model, "none", "block", backend="inductor", fullgraph=True)
    assert_same(model, reference, torch.randint(0, VOCAB, (2, 9)), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == GRAPHS.get(arch, 1)
    assert not counters["graph_break"], dict(counters["graph_break"])
