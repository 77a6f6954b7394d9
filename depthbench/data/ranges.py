"""Byte ranges of large local JSONL / text files, aligned to document boundaries and read by
streaming.

A cut at byte c moves forward to the first document boundary at or after c: for JSON lines, just
after the first b"\\n" at or after c; for text (documents separated by blank lines, as the
`datasets` text builder with sample_by="paragraph" reads them), just after the first blank-line
separator that starts at or after c. The aligned cuts b_0 = 0 <= b_1 <= ... <= b_N = size are
computed once (the index job), and range p is [b_p, b_{p+1}): every document lies in exactly one
range, and the documents of the ranges in order are the documents `datasets` reads from the file
(same text, same order, same empty-document filtering), so the pieces' union equals the
single-job tokenization.

Memory: boundaries are found with a sliding buffer of CHUNK bytes, and documents are read one
line (JSONL) or one CHUNK (text) at a time; a document is never held with more than its own
size, whatever the file's size.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import re
from typing import Iterator

from depthbench.util.errors import ConfigError, DataError

BYTE_RANGE_FORMATS = ("jsonl", "text")
CHUNK = 1 << 20
# One newline as Python's universal newlines read it ("\r\n", "\r" or "\n"); a separator is the
# first two newlines of a run that starts after a non-newline byte (the split on "\n\n" of the
# decoded text is greedy from the left, so a run's first pair is always a split point).
_NL = rb"(?:\r\n|\r(?!\n)|\n)"  # a "\r\n" is never split into two newlines
_SEPARATOR = re.compile(rb"(?<![\r\n])" + _NL + _NL)


def _jsonl_boundary(f, c: int, size: int) -> int:
    f.seek(c)
    pos = c
    while True:
        chunk = f.read(CHUNK)
        if not chunk:
            return size
        k = chunk.find(b"\n")
        if k >= 0:
            return pos + k + 1
        pos += len(chunk)


def _text_boundary(f, c: int, size: int) -> int:
    # one byte of context before c, for the look-behind; a match that ends in "\r" at the
    # buffer's end is only final at EOF (the "\r" may be the first half of "\r\n")
    base = c - 1
    f.seek(base)
    buf = f.read(CHUNK)
    while True:
        at_eof = base + len(buf) >= size
        m = _SEPARATOR.search(buf, 1)
        if m and (m.end() < len(buf) or at_eof or buf[m.end() - 1] == 0x0A):
            return base + m.end()
        if at_eof:
            return size
        # a separator not yet final starts in the last 3 bytes; plus the look-behind byte
        keep = min(4, len(buf))
        base += len(buf) - keep
        buf = buf[-keep:] + f.read(CHUNK)


def _check_format(path: str, fmt: str) -> None:
    if fmt not in BYTE_RANGE_FORMATS or path.endswith(".gz"):
        raise DataError(
            f"corpus.path: {path}: byte ranges need an uncompressed "
            f"{' or '.join(BYTE_RANGE_FORMATS)} file, not {fmt!r}"
        )


def aligned_cut(path: str, fmt: str, c: int) -> int:
    """The first document boundary of `path` at or after byte c (0 and the size are boundaries)."""
    _check_format(path, fmt)
    size = os.path.getsize(path)
    if c <= 0 or c >= size:
        return min(max(c, 0), size)
    with open(path, "rb") as f:
        return (_jsonl_boundary if fmt == "jsonl" else _text_boundary)(f, c, size)


def byte_boundaries(path: str, fmt: str, n: int) -> list[int]:
    """N + 1 aligned cut offsets of `path`, from 0 to its size (equal offsets: an empty range)."""
    _check_format(path, fmt)
    size = os.path.getsize(path)
    cuts = [0]
    for p in range(1, n):
        cuts.append(max(aligned_cut(path, fmt, p * size // n), cuts[-1]))
    return cuts + [size]


class _RangeReader(io.RawIOBase):
    """The bytes [start, end) of a file as a raw stream (what TextIOWrapper decodes)."""

    def __init__(self, path: str, start: int, end: int):
        self.file = open(path, "rb")
        self.file.seek(start)
        self.left = end - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.file.readinto(memoryview(buffer)[: min(len(buffer), self.left)])  # no copy
        self.left -= n
        return n

    def close(self) -> None:
        self.file.close()
        super().close()


def _jsonl_documents(path: str, start: int, end: int, text_field: str) -> Iterator[str]:
    with io.BufferedReader(_RangeReader(path, start, end), CHUNK) as f:
        offset = start
        for line in f:
            if offset == 0 and line.startswith(codecs.BOM_UTF8):  # datasets drops a leading BOM too
                line = line[len(codecs.BOM_UTF8) :]
            where, offset = offset, offset + len(line)
            if not line.strip():  # blank lines are skipped, as pyarrow's JSON reader does
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(
                    f"corpus.path: {path}: the line at byte {where} is not valid UTF-8 JSON ({exc})"
                ) from None
            if isinstance(record, dict) and text_field not in record:
                # `datasets` names a field that no record has; corpus_checks refuses a record
                # without it before any job reads the corpus
                raise ConfigError(
                    "corpus.text_field",
                    f"{text_field!r} is not a key of {path} at byte {where}; "
                    f"keys: {sorted(record)[:20]}",
                )
            text = record.get(text_field) if isinstance(record, dict) else None
            if text is not None and not isinstance(text, str):
                raise DataError(
                    f"corpus.path: {path}: the line at byte {where}: "
                    f"{text_field!r} is a {type(text).__name__}, not text"
                )
            if text:
                yield text


def _text_documents(path: str, start: int, end: int) -> Iterator[str]:
    # The datasets text builder's paragraph loop (universal newlines, split on "\n\n", empty
    # paragraphs dropped), on the range's bytes only; the range starts right after a separator.
    with io.TextIOWrapper(
        io.BufferedReader(_RangeReader(path, start, end), CHUNK), encoding="utf-8"
    ) as f:
        carry = ""
        try:
            while True:
                chunk = f.read(CHUNK)
                if not chunk:
                    break
                parts = (carry + chunk + f.readline()).split("\n\n")
                yield from (p for p in parts[:-1] if p)
                carry = parts[-1]
        except UnicodeDecodeError as exc:
            raise DataError(
                f"corpus.path: {path}: bytes {start}..{end} are not UTF-8 ({exc.reason}); "
                "re-encode the file as UTF-8"
            ) from None
        if carry:
            yield carry


def range_documents(
    path: str, fmt: str, start: int, end: int, text_field: str = "text"
) -> Iterator[str]:
    """The documents of bytes [start, end) of `path` (a range from byte_boundaries), in order."""
    if fmt == "jsonl":
        return _jsonl_documents(path, start, end, text_field)
    return _text_documents(path, start, end)
