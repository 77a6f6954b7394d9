"""`depthbench export`: every architecture loads in transformers (offline) with DepthBench's logits;
pre_ln as a plain LlamaForCausalLM; the tokenizer, special tokens, card and CLI."""

from __future__ import annotations

import json
import os

os.environ.setdefault(
    "HF_HUB_OFFLINE", "1"
)  # before transformers reads it: nothing here may go online

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from depthbench.commands.cli import main
from depthbench.data.tokenizer import BPE_EOS, train_bpe
from depthbench.util.errors import ConfigError, DataError
from depthbench.hf.export import export_run
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.spec.training import TrainConfig
from depthbench.train.listing import file_sha256
from depthbench.models.registry import PACKAGE_ARCHITECTURES

ARCHS = list(PACKAGE_ARCHITECTURES)  # every architecture of the package
OPTIONS = {"attnres_block": {"n_blocks": 2}, "hc": {"n_streams": 2}, "mhc": {"n_streams": 2}}
TEXT = [
    "Depth in a transformer is a stack of residual layers; some of them do little.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Numbers 0123456789 and punctuation: commas, periods; colons! question marks?",
    "def f(x):\n    return x * 2  # code has indentation and symbols like {} [] ()",
] * 20
VOCAB = 320


@pytest.fixture(autouse=True)
def eager_models(monkeypatch):
    """The eager path of hc/mhc (their C++ kernels are checked in test_cpu_kernels.py): an export
    wraps whatever DecoderLM computes, and these tests need not wait for a kernel build."""
    monkeypatch.setenv("DEPTHBENCH_CPU_KERNELS", "0")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(TEXT, VOCAB).save(str(path))
    return path


def tiny_config(arch: str) -> ModelConfig:
    return ModelConfig(
        arch=arch,
        vocab_size=VOCAB,
        d_model=32,
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        max_seq_len=64,
        norm_eps=1e-5,
        rope_theta=500.0,
        arch_options=OPTIONS.get(arch, {}),
    )


def random_model(arch: str, seed: int = 0):
    """Random weights far from the init (norm gains and static mixing weights included), so that
    every parameter moves the logits and a wrong mapping shows."""
    torch.manual_seed(seed)
    model = build_model(tiny_config(arch))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def fake_run(root, model, tokenizer_file, status: str = "ok"):
    """results/{runs/<id>, tokenizers/<tid>, data/<did>} as training and the Snakefile leave
    them."""
    cfg = model.cfg
    run_id = f"{cfg.arch}-test"
    train = TrainConfig(seq_len=32, total_steps=10)
    spec = {
        "run_id": run_id,
        "arch": cfg.arch,
        "lr": 3e-3,
        "seed": 0,
        "knobs": {},
        "shape": {
            "n_layer": cfg.n_layer,
            "d_model": cfg.d_model,
            "d_ff": cfg.d_ff,
            "n_head": cfg.n_head,
            "n_kv_head": cfg.n_kv_head,
            "n_params": model.num_parameters(),
        },
        "model": cfg.to_dict(),
        "train": train.to_dict(),
        "data_id": "tiny-abc",
        "tokenizer_id": "bpe-xyz",
    }
    run_dir = root / "results" / "runs" / run_id
    run_dir.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(run_dir / "model.safetensors"),
    )
    summary = {
        "run_id": run_id,
        "status": status,
        "steps": 10,
        "tokens_seen": 2560,
        "final_val_loss": 4.25,
        "n_params": model.num_parameters(),
        "spec": spec,
        "weights_sha256": file_sha256(run_dir / "model.safetensors"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 10, "train_loss": 4.5}) + "\n")
    tok_dir = root / "results" / "tokenizers" / "bpe-xyz"
    tok_dir.mkdir(parents=True)
    (tok_dir / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    data_dir = root / "results" / "data" / "tiny-abc"
    data_dir.mkdir(parents=True)
    eos = json.loads(tokenizer_file.read_text())["added_tokens"][0]["id"]
    (data_dir / "meta.json").write_text(
        json.dumps(
            {
                "eos_id": eos,
                "corpus": {"name": "tiny", "source": "local"},
                "train": {"n_tokens": 1000},
                "val": {"n_tokens": 100},
                "licence": "CC0",
            }
        )
    )
    return run_dir


@pytest.mark.parametrize("arch", ARCHS)
def test_export_loads_in_transformers_with_depthbench_logits(arch, tmp_path, tokenizer_file):
    model = random_model(arch)
    run_dir = fake_run(tmp_path, model, tokenizer_file)
    out = tmp_path / "export"
    info = export_run(run_dir, out)
    loaded = AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=arch != "pre_ln", local_files_only=True, dtype=torch.float32
    ).eval()
    if arch == "pre_ln":  # no remote code: transformers' own Llama
        assert type(loaded) is LlamaForCausalLM and info["class"] == "LlamaForCausalLM"
        assert not list(out.glob("*.py")) and "auto_map" not in json.loads(
            (out / "config.json").read_text()
        )
    else:
        assert type(loaded).__name__ == "DepthBenchForCausalLM"
        assert sorted(p.name for p in out.glob("*.py")) == [
            "configuration_depthbench.py",
            "modeling_depthbench.py",
        ]
    idx = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx).logits
        theirs = loaded(input_ids=idx).logits
    assert ours.std() > 0.25  # logits that differ per token: a wrong mapping could not hide
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_exported_tokenizer_and_special_tokens(tmp_path, tokenizer_file):
    from tokenizers import Tokenizer

    run_dir = fake_run(tmp_path, random_model("pre_ln"), tokenizer_file)
    out = tmp_path / "export"
    export_run(run_dir, out)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    raw = Tokenizer.from_file(str(tokenizer_file))
    eos = raw.token_to_id(BPE_EOS)
    for text in TEXT[:4] + ["  leading spaces and unseen wörds ✓"]:
        assert tok.encode(text, add_special_tokens=False) == raw.encode(text).ids
        assert tok.decode(raw.encode(text).ids) == text
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (
        BPE_EOS,
        eos,
        eos,
        eos,
    )
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == eos
    card = (out / "README.md").read_text()
    for fact in (
        "pre_ln",
        "LlamaForCausalLM",
        "validation: 4.2500",
        "training loss: 4.5000",
        "corpus: tiny",
        "lr 0.003",
        f"{random_model('pre_ln').num_parameters():,}",
    ):
        assert fact in card, fact


def test_pre_ln_with_other_architectures_options_exports_as_llama(tmp_path, tokenizer_file):
    """A pre_ln run whose arch_options hold another architecture's option (the shared section of
    a grid, e.g. the default's n_blocks: 4 for attnres_block) is still plain Llama, with equal
    logits, and its card lists no option."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(**{**tiny_config("pre_ln").to_dict(), "arch_options": {"n_blocks": 4}})
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    out = tmp_path / "export"
    info = export_run(fake_run(tmp_path, model.eval(), tokenizer_file), out)
    assert info["class"] == "LlamaForCausalLM"
    loaded = AutoModelForCausalLM.from_pretrained(
        out, local_files_only=True, dtype=torch.float32
    ).eval()
    assert type(loaded) is LlamaForCausalLM
    idx = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=idx).logits, model(idx).logits, rtol=0, atol=1e-5
        )
    card = (out / "README.md").read_text()
    assert "n_blocks" not in card and "- arch_options: none;" in card


def test_default_grid_pre_ln_runs_are_plain_llama_and_cards_list_their_own_options():
    from depthbench.grid.config import expand_grid
    from depthbench.spec.schema import load_config
    from depthbench.hf.llama import is_plain_llama

    runs = expand_grid(load_config("config/config.yaml")).runs.values()
    assert all(is_plain_llama(s.model, s.arch) for s in runs if s.arch == "pre_ln")
    assert not any(is_plain_llama(s.model, s.arch) for s in runs if s.arch != "pre_ln")


@pytest.mark.parametrize("arch", ["pre_ln", "hc"])
def test_exported_tokenizer_loads_without_remote_code_or_a_prompt(
    arch, tmp_path, tokenizer_file, monkeypatch
):
    """AutoTokenizer.from_pretrained with no trust_remote_code: transformers asks on stdin
    (`input`) before running remote code, so any call of `input` is a prompt. A Llama export
    loads from its folder, a remote-code export from its tokenizer/ folder."""
    import builtins

    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a, **k: asked.append(a) or "n")
    out = tmp_path / "export"
    info = export_run(fake_run(tmp_path, random_model(arch), tokenizer_file), out)
    where = out if info["class"] == "LlamaForCausalLM" else out / "tokenizer"
    assert (arch == "pre_ln") == (where == out)
    tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
    assert not asked, f"AutoTokenizer prompted: {asked[0][0][:200]}"
    assert not (where / "config.json").exists() or arch == "pre_ln"
    assert not list(where.glob("*.py"))
    top = AutoTokenizer.from_pretrained(
        out, local_files_only=True, trust_remote_code=arch != "pre_ln"
    )
    for text in TEXT[:2]:
        assert tok.encode(text) == top.encode(text)
    assert tok.eos_token_id == top.eos_token_id and tok.pad_token_id == top.pad_token_id


def test_registered_depthbench_loads_export_folder_without_remote_code_or_a_prompt(
    tmp_path, tokenizer_file, monkeypatch
):
    """After `import depthbench.hf.auto`, a remote-code export's own folder loads with
    AutoTokenizer and AutoModelForCausalLM and no trust_remote_code: no prompt (`input` is never
    called), the model is depthbench's local class (not the export's copy, not a Llama with random
    weights) and its logits are DepthBench's. Without the registration AutoTokenizer asks first."""
    import builtins
    import importlib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    # The registration is process-wide: restore transformers' tables after this test.
    monkeypatch.setattr(CONFIG_MAPPING, "_extra_content", dict(CONFIG_MAPPING._extra_content))
    monkeypatch.setattr(
        MODEL_FOR_CAUSAL_LM_MAPPING,
        "_extra_content",
        dict(MODEL_FOR_CAUSAL_LM_MAPPING._extra_content),
    )
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a, **k: asked.append(a) or "n")
    model = random_model("hc")
    out = tmp_path / "export"
    export_run(fake_run(tmp_path, model, tokenizer_file), out)
    AutoTokenizer.from_pretrained(out, local_files_only=True)  # unregistered: it asks first
    assert asked, "AutoTokenizer did not ask: the registration below proves nothing"
    asked.clear()

    import depthbench.hf.auto as auto

    importlib.reload(auto)  # registers again in this test's tables (a no-op when present)
    card = (out / "README.md").read_text()
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert "trust_remote_code" not in snippet and "import depthbench.hf.auto" in snippet
    names = {"path": str(out)}
    exec(snippet, names)  # the card's own loading code
    tok, loaded = names["tokenizer"], names["model"]
    assert not asked, f"a load prompted: {asked[0][0][:200]}"
    assert type(loaded) is auto.DepthBenchForCausalLM
    bare = AutoTokenizer.from_pretrained(out / "tokenizer", local_files_only=True)
    assert tok.encode(TEXT[0]) == bare.encode(TEXT[0]) and tok.eos_token_id == bare.eos_token_id
    ids = torch.tensor([tok.encode(TEXT[0])[:32]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    auto.register()  # idempotent
    assert CONFIG_MAPPING["depthbench"] is auto.DepthBenchConfig


def test_remote_code_model_generates_greedily_like_depthbench(tmp_path, tokenizer_file):
    model = random_model("hc")
    out = tmp_path / "export"
    export_run(fake_run(tmp_path, model, tokenizer_file), out)
    loaded = AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, local_files_only=True
    )
    prompt = torch.tensor([[5, 17, 42, 99]])
    generated = loaded.generate(prompt, max_new_tokens=6, do_sample=False)
    ids = prompt
    with torch.no_grad():
        for _ in range(6):  # DepthBench's greedy continuation, one full pass per token
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert generated.tolist() == ids.tolist()
    with pytest.raises(ValueError, match="right padding"):
        loaded(input_ids=prompt, attention_mask=torch.tensor([[0, 1, 1, 1]]))


def test_export_errors_name_the_problem(tmp_path, tokenizer_file):
    run_dir = fake_run(tmp_path, random_model("post_ln"), tokenizer_file, status="diverged")
    with pytest.raises(DataError, match="status 'diverged'"):
        export_run(run_dir, tmp_path / "out")
    with pytest.raises(DataError, match="summary.json: no such file"):
        export_run(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "ok"}))
    with pytest.raises(ConfigError, match="OUT_DIR"):
        export_run(run_dir, tmp_path / "busy")
    assert (
        not list(tmp_path.glob(".out*")) and not (tmp_path / "out").exists()
    )  # nothing half-written


def test_cli_export(tmp_path, tokenizer_file, capsys):
    run_dir = fake_run(tmp_path, random_model("keel"), tokenizer_file)
    assert main(["export", str(run_dir), str(tmp_path / "out")]) == 0
    assert "DepthBenchForCausalLM" in capsys.readouterr().out
    assert (
        main(["export", str(run_dir), str(tmp_path / "out")]) == 2
    )  # exists: refused, naming OUT_DIR
    assert "OUT_DIR" in capsys.readouterr().err
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--overwrite"]) == 0


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize(
    "arch", ["pre_ln", "keel"]
)  # a plain LlamaForCausalLM and one with remote code
def test_every_file_of_an_export_gets_the_mode_the_umask_allows(
    tmp_path, tokenizer_file, umask, arch
):
    run_dir = fake_run(tmp_path, random_model(arch), tokenizer_file)
    old = os.umask(umask)
    try:
        export_run(run_dir, tmp_path / "out")
    finally:
        os.umask(old)
    written = sorted((tmp_path / "out").rglob("*"))
    assert "model.safetensors" in {p.name for p in written}
    modes = {
        str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in [tmp_path / "out", *written]
    }
    want = {name: (0o777 if (tmp_path / name).is_dir() else 0o666) & ~umask for name in modes}
    assert modes == want
