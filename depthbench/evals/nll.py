"""Teacher-forced negative log-likelihood of gold continuations, per set and per domain.

Per document, NLL = -sum_t log p(y_t | context, y_<t) over the continuation's tokens. Reported:
  nats_per_token = sum NLL / continuation tokens
  bits_per_byte  = sum NLL / (ln 2 * UTF-8 bytes of the continuation)   (lm-evaluation-harness)
Per domain the sums are pooled over the domain's sets (a token- and byte-weighted average).
Each row's 95% intervals (`ci_low`, `ci_high` of bits_per_byte; `nats_per_token_ci_low`,
`nats_per_token_ci_high`) are a percentile bootstrap over its documents: the two ratios of sums
recomputed on resamples of the documents (depthbench.util.resample), seeded, so a rerun gives the
same table bit for bit.

Tokenization follows lm-evaluation-harness's pair encoding: trailing whitespace of the context
moves to the front of the continuation, the pair is encoded as one string and split at the
length of the encoded context. An empty context is replaced by the EOS token.

Windows longer than the model's context (W tokens): the continuation's tokens are scored in
disjoint chunks of at most W, in order. The first chunk is conditioned on as much of the
context as fits (the context is truncated on the left); each later chunk is conditioned on
the W - len(chunk) tokens before it, so that every input is exactly W long at most. This is
lm-evaluation-harness's rolling log-likelihood applied to the continuation: every token is
scored once, with the longest left context the window allows (a full chunk keeps one token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from depthbench.evals.eval_docs import EvalDoc
from depthbench.util.resample import percentile_interval, resample_counts, resampled_sums


def encode_pair(
    tokenizer, context: str, continuation: str, eos_id: int
) -> tuple[list[int], list[int], int]:
    """Token ids of (context, continuation) and the continuation's UTF-8 byte count."""
    n_space = len(context) - len(context.rstrip())
    if n_space:
        continuation = context[-n_space:] + continuation
        context = context[:-n_space]
    n_bytes = len(continuation.encode("utf-8"))
    if not context:
        return [eos_id], tokenizer.encode(continuation).ids, n_bytes
    whole = tokenizer.encode(context + continuation).ids
    n_ctx = len(tokenizer.encode(context).ids)
    return whole[:n_ctx], whole[n_ctx:], n_bytes


@dataclass
class Window:
    doc: int  # index of the document
    inputs: list[int]  # model input, at most W tokens
    targets: list[int]  # the tokens scored: predicted from the last len(targets) input positions


def rolling_windows(
    context: Sequence[int], continuation: Sequence[int], window: int, doc: int = 0
) -> list[Window]:
    """Split the scoring of `continuation` given `context` into inputs of at most `window`."""
    if not context:
        raise ValueError("context must hold at least one token (use EOS for an empty context)")
    seq = list(context) + list(continuation)
    n_ctx, out = len(context), []
    for a in range(n_ctx, len(seq), window):
        b = min(a + window, len(seq))
        start = max(0, b - 1 - window)  # inputs seq[start : b-1] predict seq[start+1 : b]
        out.append(Window(doc, seq[start : b - 1], seq[a:b]))
    return out


def score_windows(model, windows: list[Window], tokens_per_batch: int, device) -> np.ndarray:
    """Summed NLL (nats) of every window's targets, float64, in the windows' order.

    Windows are batched by length (right-padded: causal attention keeps padding out of every
    scored position) with at most `tokens_per_batch` input tokens per batch.
    """
    # torch here, not at the top: the nll_sets job tokenizes with this module, and the NLL job
    # of a diverged run writes its rows without a model (torch's import is most of either job)
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        order = sorted(range(len(windows)), key=lambda i: len(windows[i].inputs))
        result = np.zeros(len(windows), dtype=np.float64)
        sums, slots = [], []
        i = 0
        while i < len(order):
            longest = len(windows[order[i]].inputs)
            batch = [order[i]]
            while i + len(batch) < len(order):
                nxt = order[i + len(batch)]
                longest_next = max(longest, len(windows[nxt].inputs))
                if longest_next * (len(batch) + 1) > tokens_per_batch:
                    break
                batch.append(nxt)
                longest = longest_next
            idx = torch.zeros(len(batch), longest, dtype=torch.long)
            for row, w in enumerate(batch):
                idx[row, : len(windows[w].inputs)] = torch.tensor(windows[w].inputs)
            # the batch's targets in one host-to-device copy; each window's sum stays on the
            # device, and every sum is read once at the end (no wait on the device per window)
            flat = torch.tensor([t for w in batch for t in windows[w].targets], dtype=torch.long)
            flat = flat.to(device)
            logits = model(idx.to(device)).logits
            start = 0
            for row, w in enumerate(batch):
                win = windows[w]
                n_in, n_t = len(win.inputs), len(win.targets)
                rows = logits[row, n_in - n_t : n_in].float()
                target = flat[start : start + n_t]
                start += n_t
                sums.append(F.cross_entropy(rows, target, reduction="sum").double())
                slots.append(w)
            i += len(batch)
        if sums:
            result[slots] = torch.stack(sums).cpu().numpy()
        return result


def tokenize_docs(docs: Iterable[EvalDoc], tokenizer, eos_id: int) -> pd.DataFrame:
    rows = []
    for d in docs:
        ctx, cont, n_bytes = encode_pair(tokenizer, d.context, d.continuation, eos_id)
        rows.append(
            {
                **d.to_dict(),
                "context_ids": ctx,
                "continuation_ids": cont,
                "n_bytes": n_bytes,
                "n_tokens": len(cont),
            }
        )
    return pd.DataFrame(rows)


def score_documents(
    model, docs: pd.DataFrame, window: int, tokens_per_batch: int, device
) -> pd.DataFrame:
    """Per-document NLL sums for a tokenized set table (columns of `tokenize_docs`)."""
    windows: list[Window] = []
    for i, (ctx, cont) in enumerate(zip(docs["context_ids"], docs["continuation_ids"])):
        windows.extend(rolling_windows(list(ctx), list(cont), window, doc=i))
    sums = score_windows(model, windows, tokens_per_batch, device)
    per_doc = np.zeros(len(docs), dtype=np.float64)
    np.add.at(per_doc, np.array([w.doc for w in windows], dtype=np.int64), sums)
    out = docs[["set", "domain", "doc_id", "n_tokens", "n_bytes"]].copy()
    out["nll"] = per_doc
    return out


def document_intervals(group: pd.DataFrame, seed: int) -> dict[str, float]:
    """The 95% intervals of bits_per_byte (`ci_low`, `ci_high`) and nats_per_token of a group of
    scored documents, from resamples of its documents: each resample's summed NLL over its
    summed bytes (tokens). NaN with fewer than 2 documents or without NLL (a diverged run)."""
    counts = resample_counts(len(group), seed)
    nll, tokens, nbytes = (
        resampled_sums(group[c].to_numpy(np.float64), counts)
        for c in ("nll", "n_tokens", "n_bytes")
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        bpb = percentile_interval(nll / (math.log(2) * nbytes))
        npt = percentile_interval(nll / tokens)
    return {
        "ci_low": float(bpb[0]),
        "ci_high": float(bpb[1]),
        "nats_per_token_ci_low": float(npt[0]),
        "nats_per_token_ci_high": float(npt[1]),
    }


def aggregate(per_doc: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Rows per set (level 'set') and per domain (level 'domain', sets pooled), each with its
    bootstrap intervals over documents (`document_intervals`, seeded by `seed`)."""

    def summarize(group: pd.DataFrame) -> pd.Series:
        nll, tokens, nbytes = group["nll"].sum(), group["n_tokens"].sum(), group["n_bytes"].sum()
        return pd.Series(
            {
                "n_docs": len(group),
                "n_tokens": int(tokens),
                "n_bytes": int(nbytes),
                "nll_sum": nll,
                "nats_per_token": nll / tokens if tokens else math.nan,
                "bits_per_byte": nll / (math.log(2) * nbytes) if nbytes else math.nan,
                **document_intervals(group, seed),
            }
        )

    sets = per_doc.groupby(["set", "domain"]).apply(summarize, include_groups=False).reset_index()
    sets.insert(0, "level", "set")
    domains = per_doc.groupby("domain").apply(summarize, include_groups=False).reset_index()
    domains.insert(0, "level", "domain")
    domains["set"] = domains["domain"]
    out = pd.concat([sets, domains[sets.columns]], ignore_index=True)
    out[["n_docs", "n_tokens", "n_bytes"]] = out[["n_docs", "n_tokens", "n_bytes"]].astype("int64")
    return out
