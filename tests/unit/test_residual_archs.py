"""Hyper-Connections, mHC, Attention Residuals, MoDA, GQA and MoE: their defining properties."""

import copy
import math
import types

import pytest
import torch

from depthbench import kernels
from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model, count_parameters
from depthbench.models.archs.hc import HyperConnection
from depthbench.models.archs.attnres_block import block_ends
from depthbench.models.archs.attnres_sources import DepthAttention, DepthSources, rms_unit
from depthbench.kernels.swap import swap_in, swapped
from depthbench.models.streams import mix_matrix
from depthbench.models.sinkhorn import sinkhorn_knopp
from depthbench.models.archs.moda import joint_depth_attention
from depthbench.models.moe import MoESwiGLU
from depthbench.spec.shapes import solve_width
from depthbench.models.registry import registered_architectures
from depthbench.train import distributed
from depthbench.spec.training import TrainConfig
from depthbench.train.recipe import RunPaths, param_groups, resolve_dtype
from depthbench.train.hook_base import Hook
from depthbench.train.trainer import Trainer

from tests.bf16_checks import assert_bf16_matches_fp32, train_briefly

NEW = ["hc", "mhc", "attnres_full", "attnres_block", "moda"]


def cfg(arch, **kw):
    base = dict(arch=arch, vocab_size=61, d_model=32, n_layer=3, n_head=4, max_seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def test_hc_with_one_stream_and_zero_dynamic_weights_is_pre_ln():
    torch.manual_seed(0)
    pre = build_model(cfg("pre_ln"))
    hc = build_model(cfg("hc", arch_options={"n_streams": 1}))
    missing, unexpected = hc.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected and all("_hc." in k for k in missing)
    idx = torch.randint(0, 61, (2, 12))
    torch.testing.assert_close(hc(idx).logits, pre(idx).logits, rtol=1e-5, atol=1e-6)
    # and the dynamic part is really there: non-zero dynamic weights change the output
    with torch.no_grad():
        hc.blocks[0].attn_hc.dynamic.weight.normal_()
    assert not torch.allclose(hc(idx).logits, pre(idx).logits)


def _hc_sublayer_reference(h, H, F):
    """HC's sublayer written out (HC paper, eqs. of depthbench/models/archs/hc.py), with the
    module's parameters: per-stream RMSNorm with gain, p = N(H_i) W^T, a_m = static_read +
    s_alpha tanh(p_0), A_r = static_mix + s_alpha tanh(p_1..n), b = static_write + s_beta
    tanh(p_n+1); H' = A_r^T H + b F(a_m^T H)."""
    n = H.shape[-2]
    Hn = H * torch.rsqrt(H.pow(2).mean(-1, keepdim=True) + h.norm.eps) * h.norm.weight
    p = torch.tanh(Hn @ h.dynamic.weight.T)  # (B, T, n, n + 2)
    a_m = h.static_read + h.s_alpha * p[..., 0]
    A_r = h.static_mix + h.s_alpha * p[..., 1 : n + 1]
    b = h.static_write + h.s_beta * p[..., n + 1]
    out = F(torch.einsum("bti,btid->btd", a_m, H))
    return torch.einsum("btij,btid->btjd", A_r, H) + b.unsqueeze(-1) * out.unsqueeze(-2)


@pytest.mark.parametrize("use_kernels", [True, False])
def test_hc_learnable_scales_match_the_written_out_sublayer(use_kernels):
    """s_alpha scales the read and mixing weights' tanh, s_beta the write weights': the module's
    output and the gradients of every parameter, both scales included, equal the sublayer
    written out in the test (float64), through the C++ kernels (the CPU's implementation, swapped
    in) and through the definition."""
    if use_kernels and kernels.unavailable_reason() is not None:
        pytest.skip(f"CPU kernels cannot be built here: {kernels.unavailable_reason()}")
    torch.manual_seed(0)
    h = HyperConnection(16, 3, 1, 1e-6).double()
    if use_kernels:
        swap_in(h, "cpu")
        assert swapped(h)
    with torch.no_grad():
        for prm in h.parameters():
            prm.copy_(torch.randn_like(prm))
        h.s_alpha.fill_(0.3)
        h.s_beta.fill_(-0.7)
    lin = torch.nn.Linear(16, 16, dtype=torch.float64)
    H = torch.randn(2, 5, 3, 16, dtype=torch.float64)
    got, mixing = h(H, lambda x: torch.tanh(lin(x)))
    expected = _hc_sublayer_reference(h, H, lambda x: torch.tanh(lin(x)))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(got)
    params = list(h.parameters())
    got_grads = torch.autograd.grad(got, params, grad)
    expected_grads = torch.autograd.grad(expected, params, grad)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    grads = dict(zip([name for name, _ in h.named_parameters()], got_grads))
    assert grads["s_alpha"].abs().item() > 1e-3 and grads["s_beta"].abs().item() > 1e-3


def test_hc_scales_start_at_0_01_and_are_not_weight_decayed():
    model = build_model(cfg("hc"))
    groups = param_groups(model, weight_decay=0.1)
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    for h in (m for b in model.blocks for m in (b.attn_hc, b.ffn_hc)):
        assert torch.equal(h.s_alpha, torch.tensor([0.01])) and torch.equal(
            h.s_beta, torch.tensor([0.01])
        )
        assert h.s_alpha.requires_grad and h.s_beta.requires_grad
        assert id(h.s_alpha) in no_decay and id(h.s_beta) in no_decay


def test_hc_static_init_and_stream_sum():
    model = build_model(cfg("hc"))
    hcs = [m for b in model.blocks for m in (b.attn_hc, b.ffn_hc)]
    for s, h in enumerate(hcs):
        assert torch.equal(
            h.static_read, torch.nn.functional.one_hot(torch.tensor(s % 4), 4).float()
        )
        assert torch.equal(h.static_mix, torch.eye(4)) and torch.equal(
            h.static_write, torch.ones(4)
        )
        assert torch.count_nonzero(h.dynamic.weight) == 0
    out = model(torch.randint(0, 61, (1, 5)), return_hidden=True, return_internals=True)
    mixing = out.internals["stream_mixing"]
    assert len(mixing) == 6 and mixing[0].shape == (1, 5, 4, 4)


def test_stream_mixing_matmul_gradient_matches_finite_differences_and_the_broadcast_sum():
    """mix_matrix's hand-written backward, fed a contiguous gradient and the stride-0 one a sum
    over streams sends back (the case it makes contiguous)."""
    torch.manual_seed(0)
    M = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    H = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)

    def broadcast_sum(M, H):
        return (M.unsqueeze(-1) * H.unsqueeze(-3)).sum(-2)

    assert torch.autograd.gradcheck(mix_matrix, (M, H))
    torch.testing.assert_close(mix_matrix(M, H), broadcast_sum(M, H))
    for loss in (lambda y: y.sum(-2).sum(), lambda y: (y * torch.arange(6.0, dtype=y.dtype)).sum()):
        got = torch.autograd.grad(loss(mix_matrix(M, H)), (M, H))
        want = torch.autograd.grad(loss(broadcast_sum(M, H)), (M, H))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


# every registered architecture, and pre_ln with an MoE FFN (its router and top-k choice under
# autocast)
BF16_CASES = [pytest.param((arch, {}), id=arch) for arch in registered_architectures()] + [
    pytest.param(("pre_ln", {"moe": {"n_experts": 4, "top_k": 2}}), id="pre_ln-moe"),
]


@pytest.fixture(scope="module", params=BF16_CASES)
def trained_case(request):
    """(model, x, y): a test model of the case trained briefly in fp32 on one fixed batch
    (bf16_checks.train_briefly), so that its logits are far from uniform."""
    arch, extra = request.param
    torch.manual_seed(0)
    model = build_model(cfg(arch, **extra))
    idx = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    x, y = idx[:, :-1], idx[:, 1:]
    train_briefly(model, x, y)
    return model, x, y


def test_bf16_autocast_on_cpu_matches_fp32_on_trained_weights(trained_case):
    """bf16 autocast on the CPU against fp32 on trained weights (fp32 loss below 0.8 log V):
    loss, centred logits and gradients within tolerances 3-12x the measured bf16 error
    (tests/bf16_checks.py), the residual stream h_0..h_L fp32. Catches constant or otherwise
    signal-free logits (off by more than 1 nat), a residual stream left in bf16 (its dtype), a
    backward that is wrong or detached under mixed dtypes (a norm gain's, a custom autograd
    Function's: the gradient checks, per tensor), and bf16 or non-finite gradients."""
    model, x, y = trained_case
    assert_bf16_matches_fp32(model, x, y, "cpu")


class _RecordUpdate(Hook):
    """Parameters and gradients just before the optimizer step (after clipping)."""

    def on_gradients(self, trainer, step, stats):
        self.before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        self.grads = {
            n: p.grad.detach().clone()
            for n, p in trainer.model.named_parameters()
            if p.grad is not None
        }
        self.groups = [
            {k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups
        ]


class _OneBatch:
    accum_steps = 1

    def __init__(self, x, y):
        self.x, self.y = x, y

    def get(self, step, micro):
        return self.x, self.y


def test_bf16_autocast_training_step_updates_the_fp32_master_weights(trained_case, tmp_path):
    """One step of the real Trainer under CPU bf16 autocast (train.dtype bfloat16) on trained
    weights: parameters and gradients stay fp32, and every parameter after the step equals an
    independent float64 AdamW step from the parameters and gradients the trainer had, to 1% of
    the learning rate. The reference takes its hyperparameters from the TrainConfig and decays
    what the recipe says (nn.Linear weights and MoE expert matrices, the 3-D parameters), with a
    weight decay of 10, whose lr * wd * |w| (1e-2 |w|) is far above the tolerance. Catches
    master weights kept in bf16 (the parameters' and gradients' dtype), an optimizer step that
    does not reach the model's parameters (a copy, or skipped under autocast), and an update
    from bf16 gradients or with a wrong learning rate, betas, epsilon or weight decay (its value,
    or the wrong parameters decayed)."""
    trained, x, y = trained_case
    model = build_model(trained.cfg)  # a copy (deepcopy refuses an MoE's stored aux loss)
    model.load_state_dict(trained.state_dict())
    lr = 1e-3
    tc = TrainConfig(
        lr=lr,
        total_steps=4,
        warmup_fraction=0.0,
        global_batch_size=4,
        micro_batch_size=4,
        seq_len=x.shape[1],
        dtype="bfloat16",
        device="cpu",
        weight_decay=10.0,
    )
    spec = types.SimpleNamespace(train=tc, run_id="bf16_master_weights", model=model.cfg)
    device = torch.device("cpu")
    trainer = Trainer(
        spec,
        RunPaths(tmp_path / "run", tmp_path / "work"),
        model,
        _OneBatch(x, y),
        distributed.DistContext(),
        device,
        torch.autocast("cpu", dtype=resolve_dtype(tc.dtype, device)),
    )
    record = _RecordUpdate()
    trainer.hooks = [record]
    assert trainer._one_step() and trainer.step == 1
    assert record.grads and all(g.dtype == torch.float32 for g in record.grads.values())
    params = dict(model.named_parameters())
    reference = {n: record.before[n].double().requires_grad_() for n in record.grads}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    decayed = {n for n, p in params.items() if id(p) in linear or p.ndim == 3}
    groups = [
        {"params": [p for n, p in reference.items() if n in decayed], "weight_decay": 10.0},
        {"params": [p for n, p in reference.items() if n not in decayed], "weight_decay": 0.0},
    ]
    ref_opt = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=lr,
        betas=(tc.beta1, tc.beta2),
        eps=tc.adam_eps,
        foreach=False,
    )
    for n, p in reference.items():
        p.grad = record.grads[n].double()
    ref_opt.step()
    assert record.groups[0]["lr"] == lr
    for n, p in params.items():
        assert p.dtype == torch.float32, n
        if n in reference:
            torch.testing.assert_close(
                p.detach().double(), reference[n].detach(), rtol=0, atol=1e-2 * lr, msg=n
            )
    moved = sum(int((params[n].detach() != record.before[n]).sum()) for n in reference)
    assert moved > 0.9 * sum(record.before[n].numel() for n in reference)


@pytest.mark.parametrize(
    "res_init, phi_std, gain",
    [
        *[("hc_static", *regime) for regime in [(0.0, 0.01), (1.0, 0.01), (1.0, 0.04), (0.1, 0.3)]],
        # near the identity (a vertex of the Birkhoff polytope) 20 iterations leave row errors of
        # the order of the off-diagonal mass: within 1e-3 up to a logit noise of about 0.1
        # (docs/design/architectures.md)
        *[("identity", *regime) for regime in [(0.0, 0.01), (1.0, 0.01)]],
    ],
)
def test_mhc_mixing_matrices_are_doubly_stochastic(phi_std, gain, res_init):
    torch.manual_seed(0)
    model = build_model(cfg("mhc", arch_options={"res_init": res_init}))
    with torch.no_grad():
        for b in model.blocks:
            for m in (b.attn_mhc, b.ffn_mhc):
                m.phi.weight.normal_(0, phi_std)
                m.gains.fill_(gain)
    out = model(torch.randint(0, 61, (2, 9)), return_internals=True)
    for res in out.internals["stream_mixing"]:
        assert (res >= 0).all()
        torch.testing.assert_close(res.sum(-1), torch.ones(res.shape[:-1]), atol=1e-3, rtol=0)
        torch.testing.assert_close(res.sum(-2), torch.ones(res.shape[:-1]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("res_init", [None, "identity", "hc_static"])
def test_mhc_init_values(res_init):
    options = {} if res_init is None else {"res_init": res_init}
    model = build_model(cfg("mhc", arch_options=options))
    m = model.blocks[1].ffn_mhc  # sublayer 3
    assert torch.equal(m.b_pre, torch.tensor([0.0, 0.0, 0.0, 1.0])) and torch.equal(
        m.b_post, torch.ones(4)
    )
    assert (
        torch.allclose(m.gains, torch.full((3,), 0.01)) and torch.count_nonzero(m.phi.weight) == 0
    )
    if res_init == "hc_static":
        assert torch.equal(m.b_res, torch.eye(4))
    else:  # identity, the default: logit 0 on the diagonal, -8 off it
        assert torch.equal(m.b_res, torch.full((4, 4), -8.0).fill_diagonal_(0.0))


def _erank_of_residual_product(stream_mixing) -> torch.Tensor:
    """Per token: singular values of M_2L ... M_1, p = s / sum(s), erank = exp(-sum p log p);
    averaged over tokens."""
    product = torch.eye(stream_mixing[0].shape[-1], dtype=torch.float64)
    for M in stream_mixing:
        product = M.double() @ product
    s = torch.linalg.svdvals(product.reshape(-1, *product.shape[-2:]))
    p = s / s.sum(-1, keepdim=True)
    return torch.exp(-(p * p.log()).sum(-1)).mean()


@pytest.mark.parametrize("n_layer", [2, 4])
def test_mhc_identity_start_keeps_the_residual_product_at_full_rank(n_layer):
    """identity: H_res ~ I in every sublayer, so the product over depth has erank n (4) within
    1e-3; hc_static: the product is already near rank 1 at init (the issue's 1.15 / 1.00)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 61, (2, 7))
    ranks = {}
    for start in ("identity", "hc_static"):
        model = build_model(cfg("mhc", n_layer=n_layer, arch_options={"res_init": start}))
        with torch.no_grad():
            mixing = model(idx, return_internals=True).internals["stream_mixing"]
        assert len(mixing) == 2 * n_layer
        for res in mixing:
            torch.testing.assert_close(res.sum(-1), torch.ones(res.shape[:-1]), atol=1e-3, rtol=0)
            torch.testing.assert_close(res.sum(-2), torch.ones(res.shape[:-1]), atol=1e-3, rtol=0)
        ranks[start] = _erank_of_residual_product(mixing).item()
    assert ranks["identity"] == pytest.approx(4.0, abs=1e-3)
    assert ranks["hc_static"] < 1.2


def test_mhc_res_init_rejects_unknown_values():
    with pytest.raises(ConfigError, match=r"model\.arch_options\.res_init.*identity.*hc_static"):
        build_model(cfg("mhc", arch_options={"res_init": "eye"}))


def test_sinkhorn_convergence_in_twenty_iterations():
    """Columns are exact (the last step normalises them); rows are within 1e-3 while the
    logits' spread around the identity bias stays below ~0.5. Wider spreads converge slower
    (rows off by up to ~1e-2 at spread 1): a property of 20 iterations, reported by the probes."""
    torch.manual_seed(0)
    logits = torch.randn(2000, 4, 4, dtype=torch.float64) * 0.5 + torch.eye(4, dtype=torch.float64)
    m = sinkhorn_knopp(logits, 20)
    assert (m.sum(-2) - 1).abs().max() < 1e-12
    assert (m.sum(-1) - 1).abs().max() < 1e-3


def test_sinkhorn_gradient_matches_finite_differences():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn_knopp(t, 20), (x,))


def test_sinkhorn_in_place_inference_path_equals_the_autograd_path():
    """Without autograd the iterations normalise in place: the same numbers, input untouched."""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 4, 4) * 0.5 + torch.eye(4)
    x_before = x.clone()
    with torch.no_grad():
        inferred = sinkhorn_knopp(x, 20)
    trained = sinkhorn_knopp(x.clone().requires_grad_(), 20)
    assert trained.requires_grad and torch.equal(inferred, trained.detach())
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("arch", ["mhc", "attnres_full", "attnres_block", "moda", "hc"])
def test_inference_forward_equals_the_training_forward(arch):
    """The no-grad fast paths (in-place Sinkhorn, fused MoDA kernel) give the training path's
    logits."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(arch=arch, vocab_size=64, n_layer=3, d_model=32, n_head=2, max_seq_len=16)
    ).eval()
    with (
        torch.no_grad()
    ):  # move the zero-initialised pseudo-queries and dynamic weights off their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        inferred = model(idx).logits
    trained = model(idx).logits
    torch.testing.assert_close(inferred, trained.detach(), rtol=1e-5, atol=1e-5)


def test_sinkhorn_under_compile_is_one_custom_op_and_equals_eager():
    """torch.compile keeps the iterations as one call (no unrolled loop) with the same numbers
    and gradient."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    x = torch.randn(5, 4, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.arange(16.0, dtype=torch.float64).view(4, 4)
    eager = sinkhorn_knopp(x, 20)
    (g_eager,) = torch.autograd.grad((eager * weight).sum(), x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: sinkhorn_knopp(t, 20), backend=counter, fullgraph=True)
    out = compiled(x)
    (g_compiled,) = torch.autograd.grad((out * weight).sum(), x)
    torch.testing.assert_close(out, eager, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_compiled, g_eager, rtol=1e-12, atol=1e-14)
    graph = counter.graphs[0].graph
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert ops.count("depthbench.sinkhorn_normalize.default") == 1
    assert not any("div" in op for op in ops), ops  # no normalisation outside the op


def test_sinkhorn_custom_ops_pass_opcheck():
    torch.manual_seed(0)
    m = torch.rand(3, 3, 5, dtype=torch.float64) + 0.1
    torch.library.opcheck(torch.ops.depthbench.sinkhorn_normalize, (m.requires_grad_(), 4))
    _, results, sums = torch.ops.depthbench.sinkhorn_normalize(m.detach(), 4)
    grad = torch.randn(3, 3, 5, dtype=torch.float64)
    torch.library.opcheck(
        torch.ops.depthbench.sinkhorn_normalize_backward, (grad, results, sums)
    )


def test_attnres_full_zero_queries_give_uniform_weights_over_earlier_outputs():
    torch.manual_seed(0)
    L = 3
    model = build_model(cfg("attnres_full", n_layer=L))
    out = model(torch.randint(0, 61, (2, 7)), return_internals=True)
    weights = out.internals["depth_weights"]
    assert [len(w) for w in weights] == list(range(1, 2 * L + 1)) + [2 * L + 1]
    for w in weights:
        torch.testing.assert_close(w, torch.full_like(w, 1.0 / len(w)))


def reference_block_attnres_uniform(model, idx):
    """Block AttnRes with zero pseudo-queries, written out by hand: every read is a plain mean."""
    rope = model.rope(idx.shape[1])
    v0 = model.embed(idx)
    ends = block_ends(model.cfg.n_layer, model.cfg.arch_options.get("n_blocks", 8))
    blocks, partial = [], None
    for layer, block in enumerate(model.blocks, start=1):
        for is_ffn in (False, True):
            sources = [v0, *blocks] + ([partial] if partial is not None else [])
            h = torch.stack(sources).mean(0)
            out = block.ffn(block.ffn_norm(h)) if is_ffn else block.attn(block.attn_norm(h), rope)
            partial = out if partial is None else partial + out
        if layer in ends:
            blocks.append(partial)
            partial = None
    h = torch.stack([v0, *blocks]).mean(0)
    return model.lm_head(model.final_norm(h))


@pytest.mark.parametrize(
    "n_layer, n_blocks, counts",
    [
        (3, 2, [1, 2, 2, 2, 2, 3, 3]),  # blocks: layers 1-2, layer 3
        (3, 8, [1, 2, 2, 3, 3, 4, 4]),  # more blocks than layers: each layer is a block
    ],
)
def test_attnres_block_reads_exactly_the_allowed_sources(n_layer, n_blocks, counts):
    torch.manual_seed(0)
    model = build_model(cfg("attnres_block", n_layer=n_layer, arch_options={"n_blocks": n_blocks}))
    idx = torch.randint(0, 61, (2, 7))
    out = model(idx, return_internals=True)
    weights = out.internals["depth_weights"]
    assert [len(w) for w in weights] == counts
    for w in weights:
        torch.testing.assert_close(w, torch.full_like(w, 1.0 / len(w)))
    torch.testing.assert_close(
        out.logits, reference_block_attnres_uniform(model, idx), rtol=1e-5, atol=1e-5
    )


def test_block_boundaries():
    assert block_ends(16, 8) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert block_ends(70, 8) == [9, 18, 26, 35, 44, 53, 61, 70]  # round(k*70/8) half up
    assert block_ends(3, 8) == [1, 2, 3]


def test_depth_attention_gradient_matches_finite_differences():
    torch.manual_seed(0)
    depth = DepthAttention(5, 1e-6).double()
    mix = DepthSources.mix
    with torch.no_grad():
        depth.query.normal_()
        depth.key_norm.weight.uniform_(0.5, 1.5)
    v = torch.randn(4, 2, 3, 5, dtype=torch.float64, requires_grad=True)
    # logits w . N(v_i) through the effective query q = w * g, then the softmax mixture
    assert torch.autograd.gradcheck(
        lambda t: mix(t, rms_unit(t, 1e-6) @ depth.effective_query())[0], (v,)
    )
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q: mix(v.detach(), rms_unit(v.detach(), 1e-6) @ q)[1], (w,)
    )
    # the mixture itself through the weights, with the sources as a list of separate tensors
    sources = list(v.detach().unbind(0))
    assert torch.autograd.gradcheck(
        lambda q: mix(sources, rms_unit(v.detach(), 1e-6) @ q)[0], (w,)
    )
    # the effective-query logit is the design's w . N(v)
    torch.testing.assert_close(
        rms_unit(v, 1e-6) @ depth.effective_query(), depth.key_norm(v) @ depth.query
    )


def dense_moda_reference(q, k, v, dk, dv):
    B, H, T, hd = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = torch.cat([k[b, h, : t + 1], dk[b, h, t]])
                values = torch.cat([v[b, h, : t + 1], dv[b, h, t]])
                p = torch.softmax(keys @ q[b, h, t] / math.sqrt(hd), dim=0)
                out[b, h, t] = p @ values
    return out


def test_moda_joint_softmax_equals_dense_reference():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64) for _ in range(3))
    dk, dv = (torch.randn(2, 3, 5, 2, 4, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(
        joint_depth_attention(q, k, v, dk, dv), dense_moda_reference(q, k, v, dk, dv)
    )
    args = [t.clone().requires_grad_() for t in (q, k, v, dk, dv)]
    assert torch.autograd.gradcheck(joint_depth_attention, args)


def test_moda_fused_path_equals_the_dense_reference():
    """The fused joint attention (depthbench/kernels/moda_fused.py) against the per-position
    reference, with and without autograd, MHA and GQA; tests/unit/test_fused_depth.py holds it to
    the explicit path."""
    from depthbench.kernels.moda_fused import fused_joint_attention
    from depthbench.models.archs.moda_depth_keys import DepthKeys

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 4, dtype=torch.float64) for _ in range(3))
    dk, dv = (torch.randn(2, 3, 9, 3, 4, dtype=torch.float64) for _ in range(2))
    depth = DepthKeys()
    for m in range(3):
        depth.append((dk[:, :, :, m], dv[:, :, :, m]))
    torch.testing.assert_close(
        fused_joint_attention(q, k, v, depth.buffer(), 3), dense_moda_reference(q, k, v, dk, dv)
    )
    q6 = torch.randn(2, 6, 9, 4, dtype=torch.float64)
    with torch.no_grad():
        fused = fused_joint_attention(q6, k, v, depth.buffer(), 3)
    rep = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731
    torch.testing.assert_close(fused, dense_moda_reference(q6, rep(k), rep(v), rep(dk), rep(dv)))


def test_moda_first_layer_is_pre_ln_and_later_layers_see_depth_keys():
    torch.manual_seed(0)
    pre = build_model(cfg("pre_ln", n_layer=1))
    moda = build_model(cfg("moda", n_layer=1))
    moda.load_state_dict(pre.state_dict())
    idx = torch.randint(0, 61, (2, 9))
    torch.testing.assert_close(moda(idx).logits, pre(idx).logits)
    pre3, moda3 = build_model(cfg("pre_ln")), build_model(cfg("moda"))
    moda3.load_state_dict(pre3.state_dict())
    assert not torch.allclose(moda3(idx).logits, pre3(idx).logits)


def test_moda_ffn_kv_variant_charges_its_parameters():
    base = count_parameters(cfg("moda", n_layer=4))
    extra = count_parameters(cfg("moda", n_layer=4, arch_options={"variant": "ffn_kv"})) - base
    assert extra == 4 * 2 * 32 * 32  # 2 d^2 / G per layer with MHA (G = 1)
    extra_gqa = count_parameters(
        cfg("moda", n_layer=4, n_kv_head=2, arch_options={"variant": "ffn_kv"})
    ) - count_parameters(cfg("moda", n_layer=4, n_kv_head=2))
    assert extra_gqa == 4 * 2 * 32 * 32 // 2
    with pytest.raises(ConfigError, match="model.arch_options.variant"):
        build_model(cfg("moda", arch_options={"variant": "nope"}))


@pytest.mark.parametrize(
    "arch, variant", [(a, {}) for a in NEW + ["pre_ln"]] + [("moda", {"variant": "ffn_kv"})]
)
def test_no_position_sees_a_later_token_and_no_layer_a_later_layer(arch, variant):
    torch.manual_seed(0)
    model = build_model(cfg(arch, n_layer=4, arch_options=variant)).eval()
    idx = torch.randint(0, 61, (2, 10))
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 61
    with torch.no_grad():
        a, b = model(idx, return_hidden=True), model(changed, return_hidden=True)
        for h_a, h_b in zip(a.hidden, b.hidden):
            torch.testing.assert_close(h_a[:, :6], h_b[:, :6])
        # perturb layers 3..4: h_0..h_2 must not move. (For attnres, h_2 is by definition the
        # input that layer 3's own pseudo-query aggregates from layers <= 2: that query stays.)
        perturbed = copy.deepcopy(model)
        for i, block in enumerate(perturbed.blocks[2:]):
            for name, p in block.named_parameters():
                if not (i == 0 and name.startswith("attn_depth.")):
                    p.add_(torch.randn_like(p))
        c = perturbed(idx, return_hidden=True)
    for l in range(3):
        torch.testing.assert_close(a.hidden[l], c.hidden[l])
    assert not torch.allclose(a.hidden[4], c.hidden[4])


def test_gqa_with_as_many_kv_heads_as_heads_is_mha_for_every_path():
    torch.manual_seed(0)
    for arch in ("pre_ln", "moda"):
        mha = build_model(cfg(arch, n_head=4))
        gqa = build_model(cfg(arch, n_head=4, n_kv_head=4))
        gqa.load_state_dict(mha.state_dict())
        idx = torch.randint(0, 61, (1, 8))
        torch.testing.assert_close(gqa(idx).logits, mha(idx).logits)
    # GQA in MoDA's joint path equals repeating the KV heads explicitly
    g = build_model(cfg("moda", n_head=4, n_kv_head=2))
    assert g.blocks[0].attn.wqkv.weight.shape[0] == 32 + 2 * 16


def test_moe_routes_each_token_to_its_top_k_experts():
    torch.manual_seed(0)
    c = cfg("pre_ln", moe={"n_experts": 4, "top_k": 2, "aux_loss_coef": 0.5})
    layer = MoESwiGLU(c)
    layer.init_weights(0.1)
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randn(3, 5, 32)
    y = layer(x)
    flat = x.reshape(-1, 32)
    probs = torch.softmax(layer.router(flat), -1)
    ref = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        p, e = probs[n].topk(2)
        p = p / p.sum()
        for weight, expert in zip(p, e):
            gate, up = (flat[n] @ layer.w13[expert]).chunk(2)
            ref[n] += weight * ((torch.nn.functional.silu(gate) * up) @ layer.w2[expert])
    torch.testing.assert_close(y.reshape(-1, 32), ref, rtol=1e-5, atol=1e-6)
    # uniform router: the Switch balance loss is exactly 1 (times the coefficient)
    torch.nn.init.zeros_(layer.router.weight)
    layer(x)
    assert layer.aux_loss.item() == pytest.approx(0.5)


def test_moe_parameters_total_and_active():
    dense = build_model(cfg("pre_ln"))
    moe = build_model(cfg("pre_ln", moe={"n_experts": 4, "top_k": 1}))
    ffn = 3 * 32 * dense.cfg.d_ff
    assert moe.num_parameters() == dense.num_parameters() + 3 * (3 * ffn + 32 * 4)
    assert moe.num_active_parameters() == dense.num_parameters() + 3 * 32 * 4
    out = moe(torch.randint(0, 61, (2, 6)), torch.randint(0, 61, (2, 6)))
    assert out.aux_loss is not None and out.aux_loss.item() > 0


@pytest.mark.parametrize("arch", NEW)
def test_shape_solver_charges_extra_parameters(arch):
    base = ModelConfig(arch=arch, vocab_size=2048, n_head=4)
    shape = solve_width(
        base, 4, 8e5, multiple=8, ff_multiple=32, ff_step=4
    )  # the CPU configs' steps
    built = build_model(
        ModelConfig(
            arch=arch, vocab_size=2048, n_head=4, n_layer=4, d_model=shape.d_model, d_ff=shape.d_ff
        )
    )
    assert shape.n_params == built.num_parameters()
