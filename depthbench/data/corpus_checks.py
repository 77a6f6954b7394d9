"""Content checks of a local corpus, before any tokenizer is trained: every file readable,
UTF-8, its JSON records parse and carry the text field, and it holds a non-empty document.

At config time (every Snakemake start) only the first HEAD_BYTES of the first HEAD_FILES files
are read (every file is stat'ed for emptiness); the tokenizer stage reads them all. The readers
that yield the documents are in depthbench.data.corpus.
"""

from __future__ import annotations

import json
import os
from typing import Any

from depthbench.util.errors import ConfigError, DataError

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
            f"corpus.path: {path}: line {lineno} ({where} offset {offset + exc.start}) "
            f"is not UTF-8: {exc.reason}; re-encode the file as UTF-8"
        ) from None


def _check_record(record: Any, text_field: str, path: str, where: str) -> bool:
    """Whether a parsed JSON record is a document (a non-empty string under text_field)."""
    if not isinstance(record, dict):
        raise DataError(
            f"corpus.path: {path}: {where}: a JSON object per record is expected, "
            f"got {type(record).__name__}"
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
                    f"corpus.path: {path}: line {lineno}, column {exc.colno}: "
                    f"not valid JSON ({exc.msg})"
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
        # names line and offset
        return _check_lines(path, "jsonl" if not is_array else "text", text_field, None)
    except json.JSONDecodeError as exc:
        if is_array:
            raise DataError(
                f"corpus.path: {path}: line {exc.lineno}, column {exc.colno}: "
                f"not valid JSON ({exc.msg})"
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
    tokenizer is trained and before tokenizing) reads everything. Errors name the file and line
    or offset."""
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
