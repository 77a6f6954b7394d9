"""The NLL stage: build the tokenized evaluation sets once per tokenizer, then score each run.

`build_sets` writes one Parquet table of documents (set, domain, doc_id, token ids, bytes) for
the experiment's tokenizer; `run_nll` scores one run's final weights on it and writes per-set
and per-domain rows. With `max_docs_per_set` > 0 each set is a seeded random subset of its
source (the same subset for every run); `n_docs_source` keeps the source's full count. Each
row's 95% intervals (depthbench.evals.nll.document_intervals) are a bootstrap over its documents
seeded with the run's seed.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd

from depthbench.spec.schema import schema_defaults
from depthbench.evals.nll import aggregate, score_documents, tokenize_docs
from depthbench.evals.builtin_sets import load_builtin
from depthbench.evals.eval_docs import load_jsonl
from depthbench.util.io import atomic_write


def nll_settings(settings: dict) -> dict:
    """The schema's NLL defaults, then the operational thread count (1 unless the dispatcher
    passes the cores of the job), then `settings`."""
    return {**schema_defaults("nll"), "threads": 1, **settings}


SET_COLUMNS = [
    "level",
    "set",
    "domain",
    "n_docs",
    "n_tokens",
    "n_bytes",
    "nll_sum",
    "nats_per_token",
    "bits_per_byte",
    "ci_low",
    "ci_high",
    "nats_per_token_ci_low",
    "nats_per_token_ci_high",
]


def load_all(settings: dict) -> list:
    settings = nll_settings(settings)
    groups = [load_builtin(name, settings["source"]) for name in settings["sets"]]
    for custom in settings["custom"]:
        groups.append(load_jsonl(custom["name"], custom["path"], custom.get("domain")))
    return groups


def build_sets(
    settings: dict, tokenizer_path: str, eos_token: str | None, out_path: str
) -> pd.DataFrame:
    from tokenizers import Tokenizer

    from depthbench.data.tokenizer import eos_id

    settings = nll_settings(settings)
    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = eos_id(tok, eos_token)
    frames = []
    for docs in load_all(settings):
        n_source = len(docs)
        if settings["max_docs_per_set"] and n_source > settings["max_docs_per_set"]:
            rng = np.random.default_rng(settings["seed"])
            keep = sorted(rng.choice(n_source, size=settings["max_docs_per_set"], replace=False))
            docs = [docs[i] for i in keep]
        df = tokenize_docs(docs, tok, eos)
        df["n_docs_source"] = n_source
        frames.append(df)
    table = pd.concat(frames, ignore_index=True)
    atomic_write(out_path, lambda tmp: table.to_parquet(tmp, index=False))
    return table


def run_nll(spec_dict: dict, run_dir: str, sets_path: str, out_path: str, settings: dict) -> dict:
    """Score one run's final weights on every set and write its Parquet rows."""
    from depthbench.train.runcheck import check_run
    from depthbench.spec.run import RunSpec

    settings = nll_settings(settings)
    spec = RunSpec.from_dict(spec_dict)
    summary = check_run(run_dir, spec)  # identity and weights, before any work
    docs = pd.read_parquet(sets_path)
    start = time.time()
    if summary["status"] == "ok":
        # torch only for a model to score: a diverged run's rows need none (see below)
        import torch

        from depthbench.kernels.swap import swap_in
        from depthbench.train.checkpoint import load_final_model
        from depthbench.train.recipe import resolve_device

        torch.set_num_threads(int(settings["threads"]))
        device = resolve_device(spec.train.device)
        model = swap_in(load_final_model(spec.model, run_dir).to(device).eval())
        window = min(settings["seq_len"] or spec.train.seq_len, spec.model.max_seq_len)
        table = aggregate(
            score_documents(model, docs, window, int(settings["tokens_per_batch"]), device),
            seed=spec.train.seed,
        )
        table["window"] = window
    else:  # a diverged run has no meaningful weights: keep its rows, without numbers
        table = aggregate(docs.assign(nll=math.nan))
        for c in ("nll_sum", "nats_per_token", "bits_per_byte"):
            table[c] = math.nan
        table["window"] = 0
    first = docs.drop_duplicates("set")
    by_set = first.set_index("set")["n_docs_source"]
    by_domain = first.groupby("domain")["n_docs_source"].sum()
    is_set = table["level"] == "set"
    table["n_docs_source"] = np.where(
        is_set, table["set"].map(by_set), table["domain"].map(by_domain)
    ).astype("int64")
    table.insert(0, "run_id", spec.run_id)
    table["status"] = summary["status"]
    atomic_write(out_path, lambda tmp: table.to_parquet(tmp, index=False))
    return {
        "run_id": spec.run_id,
        "rows": len(table),
        "seconds": round(time.time() - start, 2),
        "device": str(device) if summary["status"] == "ok" else None,  # None: no model scored
    }
