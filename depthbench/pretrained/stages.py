"""The workflow stages of a pretrained run: no training; a summary (family, shape, parameters),
the validation text tokenized with the model's own tokenizer, the probes through the adapter,
and NLL on the evaluation sets tokenized with the model's own tokenizer.

Tokenization choices (docs/design/pretrained.md): text is encoded without the tokenizer's special
tokens
(no BOS added), as DepthBench's own shards and lm-evaluation-harness's loglikelihood encode it;
validation documents are separated by the model's EOS token, as in DepthBench's shards; an
empty NLL context is replaced by the BOS token where the tokenizer has one, else EOS (the prefix
token of lm-evaluation-harness's HFLM).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from depthbench.util.io import atomic_write, atomic_write_json
from depthbench.pretrained.adapter import PretrainedAdapter
from depthbench.pretrained.loading import load_model, load_tokenizer

STATUS = "pretrained"


class PlainEncoder:
    """`encode(text).ids` without special tokens: what depthbench.evals.nll.encode_pair calls."""

    def __init__(self, tokenizer):
        self.backend = tokenizer.backend_tokenizer  # a tokenizers.Tokenizer

    def encode(self, text: str):
        return self.backend.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]


def eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"{tokenizer.name_or_path}: the tokenizer has no EOS token to separate documents with"
        )
    return int(tokenizer.eos_token_id)


def prefix_id(tokenizer) -> int:
    return int(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else eos_id(tokenizer)


def device() -> torch.device:
    """Where the stages run a pretrained model: the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)


# -- the validation sample ------------------------------------------------------------------------
def validation_tokens(corpus: dict, tokenizer) -> np.ndarray:
    """The corpus's validation split (depthbench.data.corpus), each document followed by EOS."""
    from depthbench.data.corpus import split_documents

    enc, eos = PlainEncoder(tokenizer), eos_id(tokenizer)
    docs = list(split_documents(corpus, want_validation=True))
    ids = [t for doc in enc.encode_batch(docs) for t in doc + [eos]]
    return np.asarray(ids, dtype=np.int64)


def token_sample(tokens: np.ndarray, n_sequences: int, seq_len: int, seed: int) -> np.ndarray:
    """n seeded windows of seq_len + 1 tokens, drawn as depthbench.probes.run.probe_sample draws
    them from DepthBench's own validation shard (the same windows for the same token stream)."""
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"validation split shorter than one probe window of {seq_len + 1} tokens")
    rng = np.random.default_rng(seed)
    picks = rng.choice(n_windows, size=min(n_sequences, n_windows), replace=False)
    return np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in sorted(picks)])


def write_sample(model_dir: str, corpus: dict, settings: dict, seq_len: int, out_path: str) -> dict:
    """The probe sample of a pretrained run, (N, seq_len + 1) token ids, as a .npy file."""
    tokenizer = load_tokenizer(model_dir)
    sample = token_sample(
        validation_tokens(corpus, tokenizer), settings["n_sequences"], seq_len, settings["seed"]
    )

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would add .npy to a path
            np.save(f, sample)

    atomic_write(out_path, write)
    return {"shape": list(sample.shape)}


# -- the run's summary -----------------------------------------------------------------------------
def cost_fields(model) -> dict:
    """What depthbench.models.cost.pretrained_cost needs, counted on the loaded transformers model:
    `matmul_params`, the weights of every nn.Linear (the LM head included, also when it is tied
    to the embedding: its product is done either way), the embedding parameters (the input
    embedding, plus the LM head when it is a separate matrix) and the attention width
    n_head x head_dim (Gemma's head_dim is not d_model / n_head)."""
    config = model.config
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "matmul_params": int(sum(w.numel() for w in linear)),
        "params_embedding": int(embed.numel() + (0 if head is embed else head.numel())),
        "head_dim": int(head_dim),
    }


def write_summary(run_id: str, name: str, model_dir: str, source: str, out_path: str) -> dict:
    """summary.json of a pretrained run: what the runs table needs
    (depthbench.pretrained.tables)."""
    adapter = PretrainedAdapter(load_model(model_dir))
    summary = {
        "run_id": run_id,
        "name": name,
        "status": STATUS,
        "source": source,
        "transformers_class": type(adapter.model).__name__,
        "arch": adapter.arch_name,
        "n_layer": adapter.n_layer,
        "d_model": adapter.d_model,
        "d_ff": getattr(adapter.model.config, "intermediate_size", None),
        "n_head": adapter.model.config.num_attention_heads,
        "n_kv_head": getattr(adapter.model.config, "num_key_value_heads", None)
        or adapter.model.config.num_attention_heads,
        "n_params": adapter.num_parameters(),
        "vocab_size": adapter.model.config.vocab_size,
        "context_length": context_length(adapter.model),
        **cost_fields(adapter.model),
    }
    atomic_write_json(out_path, summary)
    return summary


# -- probes and NLL --------------------------------------------------------------------------------
def run_pretrained_probes(
    run_id: str, model_dir: str, sample_path: str, out_path: str, settings: dict
) -> dict:
    """Every probe that applies (adapter.probes) on the sample, stage 'trained', as tidy rows in
    the probe stage's format (depthbench.probes.run), status 'pretrained'."""
    from depthbench.probes.measure import probe_model
    from depthbench.probes.run import probe_settings

    settings = probe_settings(settings)
    torch.set_num_threads(int(settings["threads"]))
    idx = torch.from_numpy(np.load(sample_path)).long().to(device())
    start = time.time()
    rows = probe_model(
        PretrainedAdapter(load_model(model_dir)).to(idx.device), idx, "trained", settings, full=True
    )
    df = pd.DataFrame(rows, columns=["probe", "stage", "i", "j", "value", "ci_low", "ci_high"])
    df.insert(0, "run_id", run_id)
    df["status"] = STATUS
    atomic_write(out_path, lambda tmp: df.to_parquet(tmp, index=False))
    return {"run_id": run_id, "rows": len(df), "seconds": round(time.time() - start, 2)}


def evaluation_documents(tokenizer, settings: dict) -> pd.DataFrame:
    """The NLL stage's documents (depthbench.evals.run's selection, the same seeded subsets),
    tokenized with the model's own tokenizer (columns of depthbench.evals.nll.tokenize_docs)."""
    from depthbench.evals.nll import tokenize_docs
    from depthbench.evals.run import load_all

    frames = []
    for docs in load_all(settings):
        n_source = len(docs)
        if settings["max_docs_per_set"] and n_source > settings["max_docs_per_set"]:
            keep = sorted(
                np.random.default_rng(settings["seed"]).choice(
                    n_source, size=settings["max_docs_per_set"], replace=False
                )
            )
            docs = [docs[i] for i in keep]
        frames.append(
            tokenize_docs(docs, PlainEncoder(tokenizer), prefix_id(tokenizer)).assign(
                n_docs_source=n_source
            )
        )
    return pd.concat(frames, ignore_index=True)


def run_pretrained_removal(
    run_id: str,
    model_dir: str,
    probes_path: str,
    corpus: dict,
    out_path: str,
    settings: dict,
    probe_settings: dict,
    nll_settings: dict,
    seq_len: int,
) -> dict:
    """The removal rows of a pretrained run (depthbench.probes.removal_run): rankings from its probe
    rows, losses on validation windows of the corpus outside its probe sample and on the NLL
    documents, both tokenized with its own tokenizer, windows of `seq_len` tokens."""
    from depthbench.evals.run import nll_settings as with_nll_defaults
    from depthbench.probes.removal import ScoredTokens
    from depthbench.probes.removal_run import (
        domain_documents,
        held_apart_windows,
        removal_rows,
        removal_settings,
    )

    settings = removal_settings(settings)
    torch.set_num_threads(int(settings["threads"]))
    tokenizer, adapter = (
        load_tokenizer(model_dir),
        PretrainedAdapter(load_model(model_dir)).to(device()),
    )
    seq_len = min(seq_len, context_length(adapter.model))
    start = time.time()
    val = held_apart_windows(
        validation_tokens(corpus, tokenizer),
        seq_len,
        probe_settings["n_sequences"],
        probe_settings["seed"],
        settings["n_sequences"],
        settings["seed"],
    )
    data = {"val": ScoredTokens.windows(val.to(device()))}
    docs = evaluation_documents(tokenizer, with_nll_defaults(nll_settings))
    for domain, group in domain_documents(
        docs, settings["docs_per_domain"], settings["seed"]
    ).items():
        scored = ScoredTokens.documents(group, seq_len)
        data[domain] = ScoredTokens(
            scored.inputs.to(device()), scored.targets.to(device()), scored.scored.to(device())
        )
    df = removal_rows(adapter, pd.read_parquet(probes_path), data, settings)
    df.insert(0, "run_id", run_id)
    df["status"] = STATUS
    atomic_write(out_path, lambda tmp: df.to_parquet(tmp, index=False))
    return {"run_id": run_id, "rows": len(df), "seconds": round(time.time() - start, 2)}


def run_pretrained_nll(
    run_id: str, model_dir: str, out_path: str, settings: dict, window: int
) -> dict:
    """NLL in bits per byte on the evaluation sets (depthbench.evals.run's selection, the same
    seeded subsets), tokenized with the model's tokenizer and scored in windows of `window`
    tokens at most (capped by the model's context): the rows of depthbench.evals.run.run_nll."""
    from depthbench.evals.nll import aggregate, score_documents
    from depthbench.evals.run import nll_settings

    settings = nll_settings(settings)
    torch.set_num_threads(int(settings["threads"]))
    tokenizer, adapter = (
        load_tokenizer(model_dir),
        PretrainedAdapter(load_model(model_dir)).to(device()),
    )
    window = min(window, context_length(adapter.model))
    start = time.time()
    docs = evaluation_documents(tokenizer, settings)
    table = aggregate(
        score_documents(adapter, docs, window, int(settings["tokens_per_batch"]), device())
    )
    table["window"] = window
    first = docs.drop_duplicates("set")
    by_set, by_domain = (
        first.set_index("set")["n_docs_source"],
        first.groupby("domain")["n_docs_source"].sum(),
    )
    is_set = table["level"] == "set"
    table["n_docs_source"] = np.where(
        is_set, table["set"].map(by_set), table["domain"].map(by_domain)
    ).astype("int64")
    table.insert(0, "run_id", run_id)
    table["status"] = STATUS
    atomic_write(out_path, lambda tmp: table.to_parquet(tmp, index=False))
    return {"run_id": run_id, "rows": len(table), "seconds": round(time.time() - start, 2)}


def read_summary(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
