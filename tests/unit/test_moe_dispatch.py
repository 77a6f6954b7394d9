"""MoE dispatch (depthbench.models.moe) without host syncs: the grouped and the dense path equal a
per-expert loop in outputs and gradients, an expert without tokens gets a zero gradient, the layer
compiles as one graph, and the memory estimate's meta trace runs it."""

import pytest
import torch


def _moe(d=32, d_ff=48, k=2, experts=4):
    from depthbench.models.config import ModelConfig
    from depthbench.models.moe import MoESwiGLU

    cfg = ModelConfig(
        arch="pre_ln",
        vocab_size=64,
        d_model=d,
        n_layer=2,
        n_head=2,
        d_ff=d_ff,
        moe={"n_experts": experts, "top_k": k},
    )
    torch.manual_seed(0)
    m = MoESwiGLU(cfg)
    m.init_weights(0.1)
    return m


def _loop_moe(m, x):
    """MoESwiGLU's update as a loop over the experts (a host sync per expert), as the reference."""
    import torch.nn.functional as F

    flat = x.reshape(-1, x.shape[-1])
    probs = F.softmax(m.router(flat).float(), dim=-1)
    top_p, top_e = probs.topk(m.top_k, dim=-1)
    top_p = (top_p / top_p.sum(-1, keepdim=True)).to(flat.dtype)
    out = torch.zeros_like(flat)
    for e in range(m.n_experts):
        token, slot = (top_e == e).nonzero(as_tuple=True)
        if token.numel():
            gate, up = (flat[token] @ m.w13[e]).chunk(2, dim=-1)
            out.index_add_(0, token, ((F.silu(gate) * up) @ m.w2[e]) * top_p[token, slot, None])
    fraction = torch.bincount(top_e.reshape(-1), minlength=m.n_experts).float() / top_e.numel()
    return out.view(x.shape), m.aux_loss_coef * m.n_experts * (fraction * probs.mean(0)).sum()


def _out_and_grads(m, x, g, fn):
    x = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    y, aux = fn(m, x)
    ((y * g).sum() + aux).backward()
    return [y.detach(), aux.detach(), x.grad] + [p.grad for p in m.parameters()]


def _module_moe(m, x):
    return m(x), m.aux_loss


@pytest.mark.parametrize(
    "d, d_ff, k, dense",
    [(32, 48, 2, False), (36, 45, 3, False), (32, 48, 1, True), (36, 45, 3, True)],
)
def test_moe_without_host_syncs_equals_the_per_expert_loop(monkeypatch, d, d_ff, k, dense):
    from depthbench.models import moe

    if dense:  # the fallback where F.grouped_mm does not serve
        monkeypatch.setattr(moe, "_grouped_mm_serves", lambda device, dtype: False)
    m = _moe(d, d_ff, k)
    x, g = torch.randn(3, 17, d), torch.randn(3, 17, d)
    ref = _out_and_grads(m, x, g, _loop_moe)
    for name in ("nonzero", "item", "tolist", "__bool__", "__int__"):
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda *a, **kw: pytest.fail("host read in the MoE forward/backward"),
        )
    got = _out_and_grads(m, x, g, _module_moe)
    monkeypatch.undo()
    for a, b in zip(got, ref):  # to a few ulps: the two paths' products may sum in other orders
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dense", [False, True])
def test_an_expert_without_tokens_gets_a_zero_gradient(monkeypatch, dense):
    from depthbench.models import moe

    if dense:
        monkeypatch.setattr(moe, "_grouped_mm_serves", lambda device, dtype: False)
    m = _moe()
    x = torch.randn(2, 9, 32) + 3.0  # every token has a large positive mean ...
    with torch.no_grad():
        m.router.weight[3] = -1.0  # ... so expert 3's router logit is always far below the others
    m(x).square().sum().backward()
    assert m.w13.grad is not None and m.w2.grad is not None
    assert torch.all(m.w13.grad[3] == 0) and torch.all(m.w2.grad[3] == 0)
    assert all(m.w13.grad[e].abs().sum() > 0 for e in range(3))


def test_moe_compiles_as_one_graph_under_bf16_autocast():
    """fullgraph=True fails on any graph break: a host read, a data-dependent shape."""
    m = _moe()
    x = torch.randn(2, 9, 32)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = compiled(x), m(x)
    y.float().square().sum().backward()
    assert torch.equal(y, ref) and m.w13.grad is not None


def test_the_memory_estimate_traces_an_moe_model_on_meta():
    """The estimate's meta trace cannot run data-dependent shapes (a `.nonzero()` dispatch); the
    dense fallback it takes there bounds the grouped path's saved activations from above."""
    from depthbench.models.config import ModelConfig
    from depthbench.models.registry import build_model
    from depthbench.train.activation_trace import trace_activations
    from depthbench.train.memory import estimate_memory

    cfg = ModelConfig(
        arch="pre_ln",
        vocab_size=256,
        n_head=2,
        max_seq_len=32,
        n_layer=2,
        d_model=64,
        d_ff=160,
        moe={"n_experts": 4, "top_k": 2},
    )
    estimate = estimate_memory(cfg, 2, 32, bf16=False)
    torch.manual_seed(0)
    measured = trace_activations(
        build_model(cfg), torch.randint(0, 256, (2, 32)), bf16=False
    )  # real tensors: grouped path
    assert measured.total <= estimate.activations
