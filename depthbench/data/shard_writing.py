"""Writing token shards (the format is in depthbench.data.shards): train.bin / val.bin with
their document offsets from a tokenizer's output, the pieces of a sharded tokenization and their
merge, and meta.json for shards made elsewhere. meta.json is written last, atomically, so its
presence means the shards are complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from depthbench.data.shards import META_VERSION, shard_dtype, unigram_loss
from depthbench.data.tokenizer import batched
from depthbench.util.errors import DataError
from depthbench.util.io import atomic_write_json


class _ShardWriter:
    """Appends documents to `<name>.bin.tmp`; `finish` renames into place (atomic per file).

    Memory stays bounded whatever the corpus size: document start offsets go to a raw int64
    side file as they come (a Python list of them would grow with the document count), and the
    (n, 2) offsets array is written from it in blocks."""

    def __init__(self, path: Path, dtype: np.dtype, vocab_size: int):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.starts_tmp = path.with_name(path.name + ".starts.tmp")
        self.starts = open(self.starts_tmp, "wb")
        self.dtype = dtype
        self.n_tokens = 0
        self.n_documents = 0
        self.counts = np.zeros(vocab_size, dtype=np.int64)

    def add_batch(self, docs: list[np.ndarray]) -> None:
        if not docs:
            return
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        starts = self.n_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        arr = np.concatenate(docs).astype(self.dtype, copy=False)
        self.starts.write(starts.astype("<i8").tobytes())
        self.file.write(arr.tobytes())
        # one bincount per batch: per document it would cost O(vocab_size) each time
        self.counts += np.bincount(arr, minlength=len(self.counts))[: len(self.counts)]
        self.n_tokens += int(lengths.sum())
        self.n_documents += len(docs)

    def _write_offsets(self, offsets_path: Path) -> None:
        tmp_offsets = offsets_path.with_name(offsets_path.name + ".tmp.npy")
        n, block = self.n_documents, 1 << 20
        if n == 0:
            np.save(tmp_offsets, np.zeros((0, 2), dtype=np.int64))
        else:
            starts = np.memmap(self.starts_tmp, dtype="<i8", mode="r", shape=(n,))
            out = np.lib.format.open_memmap(tmp_offsets, mode="w+", dtype=np.int64, shape=(n, 2))
            for a in range(0, n, block):
                b = min(a + block, n)
                out[a:b, 0] = starts[a:b]
                out[a : b - 1, 1] = starts[a + 1 : b]
                out[b - 1, 1] = starts[b] if b < n else self.n_tokens
            out.flush()
            del out, starts
        os.replace(tmp_offsets, offsets_path)

    def finish(self, allow_empty: bool = False) -> dict:
        self.file.close()
        self.starts.close()
        try:
            if self.n_tokens == 0 and not allow_empty:
                self.tmp.unlink()
                raise DataError(
                    f"{self.path}: the split has no documents; "
                    "adjust corpus.val_fraction or the corpus"
                )
            offsets_path = self.path.with_suffix(".docs.npy")
            self._write_offsets(offsets_path)
        finally:
            self.starts_tmp.unlink()
        os.replace(self.tmp, self.path)
        return {
            "file": self.path.name,
            "n_tokens": self.n_tokens,
            "n_documents": self.n_documents,
            "doc_offsets": offsets_path.name,
        }


def _write_splits(
    documents,
    encode_batch,
    eos: int,
    vocab_size: int,
    out: Path,
    batch_size: int,
    allow_empty: bool = False,
):
    """Stream (is_validation, text) pairs into out/train.bin and out/val.bin (memory: one batch)."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = shard_dtype(vocab_size)
    writers = {
        False: _ShardWriter(out / "train.bin", dtype, vocab_size),
        True: _ShardWriter(out / "val.bin", dtype, vocab_size),
    }
    for batch in batched(documents, batch_size):
        encoded = encode_batch([text for _, text in batch])
        docs: dict[bool, list[np.ndarray]] = {False: [], True: []}
        for (is_val, _), ids in zip(batch, encoded):
            arr = np.append(np.asarray(ids, dtype=np.int64), eos)
            if arr.max() >= vocab_size:
                raise DataError(
                    f"token id {arr.max()} >= vocab_size {vocab_size}: "
                    "the tokenizer and vocab_size disagree"
                )
            docs[is_val].append(arr)
        for is_val, arrays in docs.items():
            writers[is_val].add_batch(arrays)
    infos = {"train": writers[False].finish(allow_empty), "val": writers[True].finish(allow_empty)}
    return dtype, infos, writers[False].counts, writers[True].counts


def _meta(
    dtype, vocab_size: int, eos: int, train: dict, val: dict, train_counts, val_counts, extra: dict
) -> dict:
    return {
        "version": META_VERSION,
        "dtype": dtype.name,
        "byte_order": "little",
        "vocab_size": vocab_size,
        "eos_id": eos,
        "train": train,
        "val": val,
        "unigram_val_loss": unigram_loss(train_counts, val_counts),
        "unigram_smoothing": "add-one",
        **extra,
    }


def write_token_shards(
    documents: Iterable[tuple[bool, str]],
    encode_batch,
    eos: int,
    vocab_size: int,
    out_dir: str | os.PathLike,
    meta_extra: dict,
    batch_size: int = 1000,
) -> dict:
    """Tokenize (is_validation, text) pairs into train.bin / val.bin and write meta.json last."""
    out = Path(out_dir)
    dtype, infos, train_counts, val_counts = _write_splits(
        documents, encode_batch, eos, vocab_size, out, batch_size
    )
    meta = _meta(
        dtype, vocab_size, eos, infos["train"], infos["val"], train_counts, val_counts, meta_extra
    )
    atomic_write_json(out / "meta.json", meta)
    return meta


def write_piece(
    documents,
    encode_batch,
    eos: int,
    vocab_size: int,
    piece_dir,
    piece_extra: dict,
    batch_size: int = 1000,
) -> dict:
    """One piece of a sharded tokenization: its train/val files, offsets, unigram counts, and
    piece.json last (atomic), whose presence means the piece is complete. A split may be empty."""
    out = Path(piece_dir)
    dtype, infos, train_counts, val_counts = _write_splits(
        documents, encode_batch, eos, vocab_size, out, batch_size, allow_empty=True
    )
    tmp = out / "counts.tmp.npy"
    np.save(tmp, np.stack([train_counts, val_counts]))
    os.replace(tmp, out / "counts.npy")
    info = {"dtype": dtype.name, "vocab_size": vocab_size, "eos_id": eos, **infos, **piece_extra}
    atomic_write_json(out / "piece.json", info)
    return info


def merge_pieces(piece_dirs: list, out_dir, meta_extra: dict) -> dict:
    """meta.json over the pieces, in piece order: file lists (relative to out_dir), summed token
    and document counts, and the unigram floor from the summed counts."""
    out = Path(out_dir)
    pieces = [json.loads((Path(d) / "piece.json").read_text()) for d in piece_dirs]
    first = pieces[0]
    if any(
        (p["dtype"], p["vocab_size"], p["eos_id"])
        != (first["dtype"], first["vocab_size"], first["eos_id"])
        for p in pieces
    ):
        raise DataError(
            f"{out}: the pieces were tokenized with different tokenizers; "
            f"delete {out}/pieces and rerun"
        )
    counts = sum(np.load(Path(d) / "counts.npy") for d in piece_dirs)
    splits = {}
    for split in ("train", "val"):
        # empty files cannot be mapped
        kept = [(Path(d), p[split]) for d, p in zip(piece_dirs, pieces) if p[split]["n_tokens"] > 0]
        if not kept:
            raise DataError(
                f"{out}: the {split} split has no documents in any piece; "
                "adjust corpus.val_fraction or the corpus"
            )
        splits[split] = {
            "files": [os.path.relpath(d / i["file"], out) for d, i in kept],
            "doc_offsets": [os.path.relpath(d / i["doc_offsets"], out) for d, i in kept],
            "n_tokens": sum(i["n_tokens"] for _, i in kept),
            "n_documents": sum(i["n_documents"] for _, i in kept),
        }
    meta = _meta(
        np.dtype(first["dtype"]),
        first["vocab_size"],
        first["eos_id"],
        splits["train"],
        splits["val"],
        counts[0],
        counts[1],
        {"pieces": len(pieces), **meta_extra},
    )
    atomic_write_json(out / "meta.json", meta)
    return meta


def describe_external_shards(
    train_paths: list[str],
    val_paths: list[str],
    dtype: str,
    eos: int,
    vocab_size: int,
    out_dir,
    meta_extra: dict,
) -> dict:
    """meta.json for shards made elsewhere (OLMo-core, dolma): counts, offsets and the floor."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(dtype).newbyteorder("<")

    def summarize(paths: list[str]) -> tuple[dict, np.ndarray]:
        counts = np.zeros(vocab_size, dtype=np.int64)
        n_tokens = n_docs = 0
        for p in paths:
            arr = np.memmap(p, dtype=np_dtype, mode="r")
            for start in range(0, len(arr), 1 << 24):
                chunk = np.asarray(arr[start : start + (1 << 24)])
                if chunk.size and chunk.max() >= vocab_size:
                    raise DataError(f"{p}: token id {int(chunk.max())} >= vocab_size {vocab_size}")
                counts += np.bincount(chunk, minlength=vocab_size)
                n_docs += int((chunk == eos).sum())
            n_tokens += len(arr)
        return {
            "files": [os.path.abspath(p) for p in paths],
            "n_tokens": n_tokens,
            "n_documents": n_docs,
        }, counts

    train_info, train_counts = summarize(train_paths)
    val_info, val_counts = summarize(val_paths)
    meta = {
        "version": META_VERSION,
        "dtype": np.dtype(dtype).name,
        "byte_order": "little",
        "vocab_size": vocab_size,
        "eos_id": eos,
        "train": train_info,
        "val": val_info,
        "unigram_val_loss": unigram_loss(train_counts, val_counts),
        "unigram_smoothing": "add-one",
        **meta_extra,
    }
    atomic_write_json(out / "meta.json", meta)
    return meta
