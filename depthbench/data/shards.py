"""Token shards: raw little-endian 1-D memmaps of token ids with EOS appended to every document.

This is the OLMo-core / dolma convention (headerless, dtype the smallest unsigned type that holds
vocab_size - 1), so shards made by those tools can be used directly. Next to the shards,
`meta.json` records the tokenizer identity and hash, dtype, token and document counts, the
document offset files and the unigram loss floor of the validation split. This module reads
shards and their metadata; depthbench.data.shard_writing writes them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from depthbench.util.errors import ConfigError, DataError

META_VERSION = 1


def shard_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size - 1 <= np.iinfo(np.uint16).max else np.dtype("<u4")


def unigram_loss(train_counts: np.ndarray, val_counts: np.ndarray) -> float:
    """Cross-entropy (nats/token) of validation tokens under the add-one smoothed train unigram.

    Add-one (Laplace) smoothing keeps the loss finite when a validation token never occurs in
    training; with millions of training tokens it changes the value negligibly.
    """
    p = (train_counts + 1.0) / (train_counts.sum() + len(train_counts))
    return float(-(val_counts * np.log(p)).sum() / val_counts.sum())


def read_meta(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise DataError(
            f"{path} is missing: the tokenization stage has not finished for this corpus"
        )
    meta = json.loads(path.read_text())
    if meta.get("version") != META_VERSION:
        raise DataError(
            f"{path}: shard metadata version {meta.get('version')}, expected {META_VERSION}"
        )
    return meta


def split_files(data_dir: str | os.PathLike, meta: dict, split: str) -> list[str]:
    info = meta[split]
    if "files" in info:  # external shards (absolute) or pieces (relative to the data directory)
        return [str(Path(data_dir) / f) for f in info["files"]]
    return [str(Path(data_dir) / info["file"])]


def check_seq_len(data_dir: str | os.PathLike, seq_len: int, meta: dict | None = None) -> None:
    """ConfigError naming `train.seq_len` unless both splits of the shards in `data_dir` hold a
    window of seq_len + 1 tokens (inputs and their next-token targets), which training and
    validation need (depthbench.data.loader.TokenWindows: no window spans two files). Reads only
    meta.json and the files' sizes."""
    meta = read_meta(data_dir) if meta is None else meta
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split, name in (("train", "training"), ("val", "validation")):
        lengths = [os.path.getsize(f) // itemsize for f in split_files(data_dir, meta, split)]
        if not any(n >= seq_len + 1 for n in lengths):
            longest = max(lengths, default=0)
            several = (
                f" (no window spans its {len(lengths)} files; the longest has {longest})"
                if len(lengths) > 1
                else ""
            )
            raise ConfigError(
                "train.seq_len",
                f"{seq_len} needs windows of seq_len + 1 = {seq_len + 1} tokens, "
                f"but the {name} split in {data_dir} has {sum(lengths)} tokens{several}; "
                f"valid: at most {max(longest - 1, 0)}, or a larger corpus",
            )


def unigram_floor(data_dir) -> float:
    value = read_meta(data_dir)["unigram_val_loss"]
    if not math.isfinite(value):
        raise DataError(f"{data_dir}: unigram floor is not finite")
    return value
