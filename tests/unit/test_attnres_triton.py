"""AttnRes's grouped mix with its products in Triton (depthbench/kernels/attnres_triton.py, the
CUDA backend's Full and Block AttnRes) against the same mix in float64 PyTorch and against the
definitions, forward and every gradient.

The kernels run on CPU tensors in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported on a machine without a GPU; `on_cpu()` lets CPU tensors take them):
float32 to 1e-5, float16 within its rounding. bfloat16 is checked on a GPU
(tests/integration/test_gpu.py::test_attnres_mix_on_cuda_against_float64)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton", reason="the AttnRes kernels need triton (setup: test)")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU, tests/integration/test_gpu.py checks the kernels"
)

from depthbench.kernels import attnres_groups as ag  # noqa: E402
from depthbench.kernels import attnres_triton as at  # noqa: E402
from depthbench.kernels import triton_streams as ts  # noqa: E402
from depthbench.kernels.swap import implementations, swap_in, swapped  # noqa: E402
from depthbench.models.archs.attnres_block import AttnResBlocks  # noqa: E402
from depthbench.models.archs.attnres_full import AttnResFull  # noqa: E402
from depthbench.models.config import ModelConfig  # noqa: E402
from depthbench.models.registry import build_model  # noqa: E402


@pytest.fixture(autouse=True)
def kernels_in_the_interpreter():
    with ts.on_cpu():
        yield


def close(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str = "") -> None:
    """Norm-wise relative error within rtol."""
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


def group(G, S, N, D, first, dtype, seed=0):
    """Logits (G, S, N), `first` (N, D) or None, the other S' sources as slots of a wider buffer
    (its view strided as the models' buffer is) and the tensors the slots were copied from."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(G, S, N, generator=g, requires_grad=True)
    v0 = torch.randn(N, D, generator=g).to(dtype).requires_grad_() if first else None
    k = 1 if first else 0
    buffer = torch.randn(N, S - k + 3, D, generator=g).to(dtype)
    view = buffer[:, 2 : 2 + S - k]
    sources = [view[:, i].clone().requires_grad_() for i in range(S - k)]
    return logits, v0, view, sources


def run(kernels, logits, first, view, sources, merged, up):
    """h, lse and the gradients of logits, first and every source for the upstream (dh, dlse)."""
    h, lse = ag.GroupMix.apply(kernels, logits, first, view, merged, *sources)
    inputs = [logits, *([first] if first is not None else []), *sources]
    loss = (h * up[0]).sum() + (lse * up[1]).sum()
    return (h, lse, *torch.autograd.grad(loss, inputs))


# G = 8: a Full AttnRes group; 1 without v_0: a phase 2; 18 readers: a block of 9 layers
# (BLOCK_G 32); N = 30 spans token tiles, D = 72 two feature tiles of 64
SHAPES = [(8, 11, 30, 72, True), (1, 5, 30, 40, False), (18, 4, 9, 20, True), (3, 1, 7, 8, True)]


@pytest.mark.parametrize("G, S, N, D, first", SHAPES)
@pytest.mark.parametrize("merged", [False, True])
def test_kernels_equal_the_mix_in_float64(G, S, N, D, first, merged):
    """h, lse and the gradients of the logits, v_0 and every source, float32 kernels against the
    PyTorch mix in float64, within 1e-5; with the readers' flags as a merge sets them and not."""
    logits, v0, view, sources = group(G, S, N, D, first, torch.float32)
    g = torch.Generator().manual_seed(1)
    up = (torch.randn(G, N, D, generator=g), torch.randn(G, N, generator=g))
    flags = [merged and i % 2 == 0 for i in range(G)]
    got = run(at.KERNELS, logits, v0, view, sources, list(flags), up)
    leaves = [logits, *([v0] if first else []), *sources]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_view = view.double()
    rl, *rest = ref_leaves
    ref_first = rest.pop(0) if first else None
    ref = run(ag.TORCH, rl, ref_first, ref_view, rest, list(flags), [u.double() for u in up])
    names = ["h", "lse", "logits", *(["v0"] if first else []), *[f"v{i}" for i in range(len(rest))]]
    assert len(got) == len(ref) == len(names)
    for a, b, name in zip(got, ref, names):
        assert a.dtype == torch.float32, name
        close(a, b, 1e-5, name)


@pytest.mark.parametrize("j", [1, 7])
def test_merge_on_the_kernels_equals_the_float64_merge(j):
    """Phase 1 of a group of 8 and a reader's merge of the j sources added since (the cached
    mix one more source, whose logit is its lse): h, lse and every input's gradient, float32
    kernels against the PyTorch products in float64, within 1e-5."""
    logits1, v0, view1, cached = group(8, 6, 30, 72, True, torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    logits2 = torch.randn(j, 30, generator=g, requires_grad=True)
    buffer = torch.randn(30, j + 2, 72, generator=g)
    view2 = buffer[:, 1 : 1 + j]
    new = [view2[:, i].clone().requires_grad_() for i in range(j)]
    up = (torch.randn(30, 72, generator=g), torch.randn(30, generator=g))
    results = []
    for kernels, cast in ((at.KERNELS, lambda x: x), (ag.TORCH, lambda x: x.double())):
        leaves = [cast(x.detach()).requires_grad_() for x in (logits1, v0, logits2, *cached, *new)]
        lg1, first, lg2 = leaves[:3]
        c, n = leaves[3 : 3 + len(cached)], leaves[3 + len(cached) :]
        merged = [True] + [False] * 7  # reader 0 merged, the others' outputs used as they are
        h1, lse1 = ag.GroupMix.apply(kernels, lg1, first, cast(view1), merged, *c)
        h, lse = ag.MergeMix.apply(kernels, h1[0], lse1[0], lg2, cast(view2), *n)
        loss = (h * cast(up[0])).sum() + (lse * cast(up[1])).sum() + (h1[1:] ** 2).sum()
        results.append((h, lse, *torch.autograd.grad(loss, leaves)))
    for i, (a, b) in enumerate(zip(*results)):
        close(a, b, 1e-5, f"output {i}")


def test_float16_sources_within_their_rounding():
    """float16 sources read and their gradients written in float16, against float64."""
    logits, v0, view, sources = group(8, 9, 30, 72, True, torch.float16)
    g = torch.Generator().manual_seed(2)
    up = (torch.randn(8, 30, 72, generator=g), torch.randn(8, 30, generator=g))
    got = run(at.KERNELS, logits, v0, view, sources, [False] * 8, up)
    ref_leaves = [t.detach().double().requires_grad_() for t in (logits, v0, *sources)]
    ref = run(ag.TORCH, ref_leaves[0], ref_leaves[1], view.double(), ref_leaves[2:],
              [False] * 8, [u.double() for u in up])  # fmt: skip
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == (torch.float16 if i >= 3 else torch.float32)
        close(a, b, 3e-3, f"output {i}")


def counting(monkeypatch) -> list:
    calls = []
    for name in ("attnres_mix", "attnres_mix_backward"):
        op = getattr(at, name)
        monkeypatch.setattr(at, name, lambda *a, op=op, name=name: calls.append(name) or op(*a))
    return calls


def test_kernel_choice(monkeypatch):
    """The kernels take float32 and float16 in the interpreter; float64, bfloat16 (wrong in the
    interpreter), meta tensors and CPU tensors outside on_cpu() take the PyTorch products."""
    calls = counting(monkeypatch)
    p, view = torch.zeros(2, 3, 4), torch.zeros(4, 3, 8)
    at.triton_products(p, None, view)
    at.triton_products(p, None, view.half())
    assert calls == ["attnres_mix"] * 2
    at.triton_products(p.double(), None, view.double())
    at.triton_products(p, None, view.bfloat16())
    at.triton_products(p.to("meta"), None, view.to("meta"))
    at.triton_products(p, torch.zeros(4, 8).bfloat16(), view[:, 1:])  # v_0 in bfloat16
    at.triton_products(p, None, torch.zeros(4, 8, 3).transpose(1, 2))  # features strided
    monkeypatch.setattr(ts, "_ON_CPU", False)
    at.triton_products(p, None, view)
    assert calls == ["attnres_mix"] * 2


@pytest.mark.parametrize(
    "arch, n_layer, options",
    [("attnres_full", 5, {}), ("attnres_block", 5, {"n_blocks": 2})],
)
def test_models_on_the_kernels_equal_the_definitions(monkeypatch, arch, n_layer, options):
    """The CUDA backend's swap (here on CPU tensors, the kernels in the interpreter) against the
    definition: loss, every parameter's gradient, the depth weights the probes record and the
    residual stream, float32, and the logits without autograd; every mix ran in the kernels.
    L = 5: Full AttnRes's 11 readers in groups of 8 and 3, Block AttnRes's in blocks of 3 and 2
    layers."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=64, n_layer=n_layer, d_model=72, n_head=2,
                      max_seq_len=16, arch_options=options)  # fmt: skip
    definition = build_model(cfg)
    with torch.no_grad():
        for p in definition.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    fast = swap_in(copy.deepcopy(definition), "cuda")
    assert set(swapped(fast).values()) <= {"TritonAttnResFull", "TritonAttnResBlocks"}
    calls = counting(monkeypatch)
    idx = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(1))
    runs = []
    for model in (fast, definition):
        out = model(idx[:, :-1], idx[:, 1:], return_internals=True, return_hidden=True)
        out.loss.backward()
        runs.append((out, {n: p.grad for n, p in model.named_parameters()}))
    forward, backward = calls.count("attnres_mix"), calls.count("attnres_mix_backward")
    readers = 2 * n_layer + 1
    # a phase 1 per group and a merge per reader after its group's first: one call per reader
    assert forward == backward == readers
    (out, grads), (ref, ref_grads) = runs
    close(out.loss, ref.loss, 1e-6, "loss")
    weights = out.internals["depth_weights"]
    for i, (a, b) in enumerate(
        zip(weights + out.hidden, ref.internals["depth_weights"] + ref.hidden)
    ):
        close(a, b, 1e-5, f"depth weights / hidden {i}")
    for name, grad in ref_grads.items():
        close(grads[name], grad, 1e-5, name)
    calls.clear()
    with torch.no_grad():
        close(fast(idx).logits, definition(idx).logits, 1e-5, "logits without autograd")
    assert calls and "attnres_mix_backward" not in calls


def test_swap_table():
    """Where triton is installed the cuda backend's AttnRes is the Triton one; without it the
    grouped PyTorch mix."""
    table = implementations("cuda")
    assert table[AttnResFull] is at.TritonAttnResFull
    assert table[AttnResBlocks] is at.TritonAttnResBlocks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(at, "unavailable_reason", lambda: "triton is not installed")
        table = implementations("cuda")
        assert table[AttnResFull] is ag.GroupedAttnResFull
        assert table[AttnResBlocks] is ag.GroupedAttnResBlocks


@pytest.mark.parametrize("first", [True, False])
def test_custom_ops_pass_opcheck(first):
    """opcheck of both ops (fakes, schema, strides), on the strided view the models pass."""
    logits, v0, view, _ = group(3, 4, 6, 8, first, torch.float32)
    logits = logits.detach()
    v0 = v0.detach() if first else None
    p = torch.softmax(logits, 1)
    torch.library.opcheck(at.attnres_mix, (p, v0, view))
    torch.library.opcheck(at.attnres_mix_backward, (p, v0, view, torch.randn(3, 6, 8)))
