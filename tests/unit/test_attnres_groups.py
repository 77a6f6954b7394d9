"""AttnRes's two-phase mix over groups of readers (depthbench/kernels/attnres_groups.py, the CUDA
backend's implementation of Full and Block AttnRes) against the direct softmax over every source,
apart from the models (the algorithm) and inside them (the swap)."""

from __future__ import annotations

import copy

import pytest
import torch

from depthbench.kernels import attnres_groups as ag
from depthbench.kernels.swap import swap_in, swapped
from depthbench.models.archs.attnres_sources import rms_unit
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from tests.unit.test_logit_lens import perturbed, sample


def direct(v0, outputs, queries, eps):
    """Every reader's mix and weights by the direct softmax over the sources it sees."""
    sources = [v0, *outputs]
    hs, ws = [], []
    for r in range(queries.shape[1]):
        seen = torch.stack(sources[: r + 1])  # (S, B, T, d)
        w = torch.softmax(rms_unit(seen, eps) @ queries[:, r], dim=0)  # (S, B, T)
        hs.append((w.unsqueeze(-1) * seen).sum(0))
        ws.append(w)
    return hs, ws


def two_phase(v0, outputs, queries, eps):
    sources = ag.GroupedDepthSources(v0, queries, eps, capacity=len(outputs))
    hs, ws = [], []
    for r in range(queries.shape[1]):
        h, w = sources.current()
        hs.append(h)
        ws.append(w)
        if r < len(outputs):
            sources.add(outputs[r], r // 2 + 1, r % 2 == 1)
    return hs, ws


@pytest.mark.parametrize("n_layer", [1, 3, 4, 70])
def test_two_phase_schedule_equals_the_direct_softmax(n_layer):
    """Every reader's mix and depth weights, and the gradients of the sources and queries
    through all of them, equal the direct softmax's within 1e-6 in float64; L = 70: 141 readers
    in groups of 8 (17 full groups and one of 5)."""
    g = torch.Generator().manual_seed(n_layer)
    B, T, d, R = 2, 3, 8, 2 * n_layer + 1
    v0 = torch.randn(B, T, d, dtype=torch.float64, generator=g, requires_grad=True)
    outputs = [
        torch.randn(B, T, d, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(R - 1)
    ]
    queries = torch.randn(d, R, dtype=torch.float64, generator=g, requires_grad=True)
    inputs = [v0, *outputs, queries]
    up = [torch.randn(B, T, d, dtype=torch.float64, generator=g) for _ in range(R)]
    results = []
    for schedule in (two_phase, direct):
        hs, ws = schedule(v0, outputs, queries, 1e-6)
        grads = torch.autograd.grad(sum((h * u).sum() for h, u in zip(hs, up)), inputs)
        results.append((hs, ws, grads))
    (hs, ws, grads), (ref_hs, ref_ws, ref_grads) = results
    for a, b in zip(hs + ws + list(grads), ref_hs + ref_ws + list(ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_group_mix_gradients_pass_gradcheck():
    """Phase 1's autograd Function, with v_0 apart and without (phase 2), every input."""
    g = torch.Generator().manual_seed(0)
    N, G, S, d = 3, 2, 4, 5
    t = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)  # noqa: E731
    logits, first, sources = t(G, S, N), t(N, d), [t(N, d) for _ in range(S - 1)]

    def mix(logits, first, *sources):
        view = torch.stack(sources, 1).detach()
        return ag.GroupMix.apply(ag.TORCH, logits, first, view, [False] * G, *sources)

    assert torch.autograd.gradcheck(mix, (logits, first, *sources))
    logits = t(G, S - 1, N)
    assert torch.autograd.gradcheck(lambda lg, *s: mix(lg, None, *s), (logits, *sources))


def test_merge_gradients_pass_gradcheck():
    """A phase 1 of three readers, the first and last merged with the sources added since
    (their flags set, as the merges set them), the middle one used as it is, its lse too:
    every input's gradient, through both Functions. A merge is not differentiated alone: the
    centring term of its reader's cached sources comes from it (GroupMix's docstring)."""
    g = torch.Generator().manual_seed(1)
    N, S, d = 3, 3, 5
    t = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)  # noqa: E731
    logits1, first, cached = t(3, S, N), t(N, d), [t(N, d) for _ in range(S - 1)]
    logits_a, new_a = t(1, N), [t(N, d)]
    logits_b, new_b = t(2, N), [t(N, d), t(N, d)]

    def mix_and_merge(logits1, first, logits_a, logits_b, *sources):
        cached, new_a, new_b = sources[: S - 1], sources[S - 1 : S], sources[S:]
        view = lambda ts: torch.stack(ts, 1).detach()  # noqa: E731
        h1, lse1 = ag.GroupMix.apply(ag.TORCH, logits1, first, view(cached), [1, 0, 1], *cached)
        ha, lse_a = ag.MergeMix.apply(ag.TORCH, h1[0], lse1[0], logits_a, view(new_a), *new_a)
        hb, lse_b = ag.MergeMix.apply(ag.TORCH, h1[2], lse1[2], logits_b, view(new_b), *new_b)
        return ha, lse_a, h1[1], lse1[1], hb, lse_b

    inputs = (logits1, first, logits_a, logits_b, *cached, *new_a, *new_b)
    assert torch.autograd.gradcheck(mix_and_merge, inputs)


@pytest.mark.parametrize(
    "arch, n_layer, options",
    [
        ("attnres_full", 2, {}),
        ("attnres_full", 5, {}),
        ("attnres_block", 5, {"n_blocks": 2}),
        ("attnres_block", 3, {"n_blocks": 8}),
    ],
)
def test_swapped_attnres_equals_the_definition(arch, n_layer, options):
    """The CUDA backend's AttnRes (here on CPU tensors) against the definition: loss, every
    gradient, the recorded depth weights and the residual stream, float32; L = 5: Full AttnRes's
    11 readers in a group of 8 and one of 3, Block AttnRes's in blocks of 3 and 2 layers; 8 blocks
    over 3 layers: every layer a block."""
    torch.manual_seed(0)
    definition = build_model(
        ModelConfig(
            arch=arch,
            vocab_size=64,
            n_layer=n_layer,
            d_model=32,
            n_head=2,
            max_seq_len=16,
            arch_options=options,
        )
    )
    with torch.no_grad():
        for p in definition.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    fast = swap_in(copy.deepcopy(definition), "cuda")
    assert len(swapped(fast)) == 1
    idx = sample()
    runs = []
    for model in (fast, definition):
        out = model(idx[:, :-1], idx[:, 1:], return_internals=True, return_hidden=True)
        out.loss.backward()
        runs.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (out, grads), (ref, ref_grads) = runs
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(
        out.internals["depth_weights"] + out.hidden, ref.internals["depth_weights"] + ref.hidden
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_outputs_are_kept_in_bf16_and_v0_in_fp32():
    """Under bf16 autocast the sublayer outputs go into a bf16 buffer (half an fp32 buffer's
    bytes, nothing rounded: they are bf16 already), v_0 stays fp32 apart, and the model's loss
    and gradients are the definition's within bf16's rounding of the products."""
    definition = perturbed("attnres_full", n_layer=3).train()
    fast = swap_in(copy.deepcopy(definition), "cuda")
    idx = sample()
    seen = {}
    make = fast.make_sources

    def spy(h0):
        seen["sources"] = make(h0)
        return seen["sources"]

    fast.make_sources = spy
    losses = []
    for model in (fast, definition):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx[:, :-1], idx[:, 1:]).loss
        loss.backward()
        losses.append(loss.detach())
    sources = seen["sources"]
    assert sources.buffer.values.dtype == torch.bfloat16
    assert sources.values[0].dtype == torch.float32
    assert len(sources.buffer.sources) == 2 * 3
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-3, atol=2e-3)
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (fast, definition)]
    assert (grads[0] - grads[1]).norm() <= 2e-2 * grads[1].norm()


@pytest.mark.parametrize("arch", ["attnres_full", "attnres_block"])
def test_a_groups_mixes_reach_autograd_through_one_node(arch):
    """Each group's cached mixes go to its readers through one unbind, whose backward stacks
    their gradients once: no reader's own index node (whose backward writes the reader's
    gradient into a zero tensor of the whole group's size) sits on a group's output."""
    model = swap_in(perturbed(arch, n_layer=5).train(), "cuda")
    idx = sample()
    loss = model(idx[:, :-1], idx[:, 1:]).loss
    seen, stack, parents = set(), [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, set()).add(type(node).__name__)
                stack.append(child)
    groups = [n for n in seen if type(n).__name__ == "GroupMixBackward"]
    assert groups
    for node in groups:
        assert parents[node] == {"UnbindBackward0"}, parents[node]


def _passes(model, idx):
    """A probe-like use of the stepping interface with gradients: the residual read before every
    layer, a fork that skips the layer and runs one more, a main pass that skips layer 2, the
    first read without autograd; every output in one loss."""
    state = model.begin(idx)
    with torch.no_grad():
        loss = 0.0 * model.residual(state).sum()  # phase 1 of the first group made without autograd
    for layer in range(1, model.n_layer + 1):
        loss = loss + (model.residual(state) ** 2).mean() * 0.3 if layer > 1 else loss
        fork = model.skip(state, layer)
        if layer < model.n_layer:
            fork = model.step(fork, layer + 1)
            loss = loss + (model.residual(fork) * 0.7).sin().mean()
        loss = loss + model.logits(fork).logsumexp(-1).mean() * 0.1
        state = model.skip(state, layer) if layer == 2 else model.step(state, layer)
    return loss + model.logits(state).logsumexp(-1).mean()


@pytest.mark.parametrize(
    "arch, n_layer, options",
    [("attnres_full", 9, {}), ("attnres_block", 7, {"n_blocks": 2})],
)
def test_forks_and_skips_mid_group_with_gradients(arch, n_layer, options):
    """Forks resumed mid-group, skipped layers and a first read without autograd, all with
    gradients through the outputs: the definition's loss and every gradient (float64, to
    1e-10)."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=64, n_layer=n_layer, d_model=16, n_head=2,
                      max_seq_len=16, arch_options=options)  # fmt: skip
    definition = build_model(cfg)
    with torch.no_grad():
        for p in definition.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    definition = definition.double().eval()
    fast = swap_in(copy.deepcopy(definition), "cuda")
    idx = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (fast, definition):
        loss = _passes(model, idx)
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        results.append((loss, grads))
    (loss, grads), (ref, ref_grads) = results
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    for (name, _), a, b in zip(definition.named_parameters(), grads, ref_grads):
        assert (a is None) == (b is None), name
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_a_group_made_without_autograd_is_made_again_with_it():
    """Reader 0 read without autograd (as a probe reads h_l), the next readers with it: their
    mixes carry the gradients of the sources and queries that the direct softmax gives."""
    g = torch.Generator().manual_seed(5)
    B, T, d, R = 1, 3, 4, 5
    v0 = torch.randn(B, T, d, dtype=torch.float64, generator=g, requires_grad=True)
    outputs = [torch.randn(B, T, d, dtype=torch.float64, generator=g) for _ in range(R - 1)]
    queries = torch.randn(d, R, dtype=torch.float64, generator=g, requires_grad=True)
    sources = ag.GroupedDepthSources(v0, queries, 1e-6, capacity=R - 1)
    with torch.no_grad():
        sources.current()
    sources.add(outputs[0], 1, False)
    h, _ = sources.current()  # reader 1, in reader 0's group
    ref, _ = direct(v0, outputs, queries, 1e-6)
    for a, b in zip(
        torch.autograd.grad(h.sum(), (v0, queries)),
        torch.autograd.grad(ref[1].sum(), (v0, queries)),
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_readers_cached_mix_is_merged_once():
    """Merging a reader's cached mix a second time would give its cached sources the centring
    term twice: refused."""
    B, T, d, R = 1, 2, 4, 3
    v0, out = torch.randn(B, T, d), torch.randn(B, T, d)
    sources = ag.GroupedDepthSources(v0, torch.randn(d, R), 1e-6, capacity=R - 1)
    sources.current()
    sources.add(out, 1, False)
    sources.current()  # reader 1: its cached mix merged with out
    merge = sources._phase1(1)[3]
    with pytest.raises(RuntimeError, match="merged a second time"):
        merge(torch.zeros(1, B * T), out.reshape(B * T, 1, d), [out])
