"""Pieces (corpus.pieces > 1): contiguous ranges of the global document order, one Snakemake job
each.

Piece p of P holds the documents i with start_p <= i < start_{p+1} of the same global order that
`iter_documents` yields, and splits them with is_validation(i, ...) on that global i, so the
pieces' outputs in piece order are exactly the single-job output. The corpus is cut into units,
each unit's documents are counted once (the tokenize_index job, one streaming pass without
tokenizing), and the units are grouped into pieces:

- local, piece_by "files" (the default for several files): a unit is a file; file k goes to the
  piece its middle document falls in, balanced by document count.
- local, piece_by "bytes" (the default for one file; JSONL or text): the files' bytes, as one
  concatenation, are cut at P - 1 offsets, each moved to the next document boundary of its file
  (depthbench/data/ranges.py); a unit is a piece's list of (file, start, end) segments.
- hub, by data files: a unit is one of the dataset's data files (parquet/jsonl shards, as
  `datasets` resolves them for corpus.subset and corpus.split, revision-pinned on the hub); a
  local directory laid out like a hub dataset works the same way, offline.
- wiki_offline (one JSON file): cut by document range.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterator

from depthbench.data.corpus import iter_datasets, iter_wiki_offline, iter_documents, local_files
from depthbench.data.ranges import BYTE_RANGE_FORMATS, aligned_cut, range_documents
from depthbench.util.errors import ConfigError


def piece_by(corpus: dict, n_files: int | None = None) -> str:
    """How a corpus is cut: 'files', 'bytes' or 'documents' (wiki_offline)."""
    if corpus["source"] == "wiki_offline":
        return "documents"
    if corpus["source"] == "hub":
        return "files"
    return corpus.get("piece_by") or ("bytes" if n_files == 1 else "files")


def check_pieces(corpus: dict) -> None:
    """Config-time checks of corpus.pieces / corpus.piece_by (cheap: no document is read)."""
    pieces, source, by = corpus.get("pieces", 1), corpus["source"], corpus.get("piece_by")
    if by is not None and source not in ("local", "hub"):
        raise ConfigError(
            "corpus.piece_by",
            "applies to corpus.source local (files or bytes) or hub (files), "
            f"not {source!r}; remove it",
        )
    if by == "bytes" and source == "hub":
        raise ConfigError(
            "corpus.piece_by",
            "a hub dataset is cut by its data files: use piece_by: files (or leave it out)",
        )
    if pieces == 1:
        return
    if source == "shards":
        raise ConfigError(
            "corpus.pieces", "pre-tokenized shards are not tokenized again: set corpus.pieces: 1"
        )
    if source != "local":
        # hub: the data files are listed (online) by the tokenize_index job, before any piece
        return
    files, fmt = local_files(corpus)
    if piece_by(corpus, len(files)) == "files":
        if len(files) < pieces:
            raise ConfigError(
                "corpus.pieces",
                f"{pieces} pieces but corpus.path has {len(files)} files and "
                "corpus.piece_by is 'files' (at most one piece per file): "
                f"use at most {len(files)} pieces, or piece_by: bytes for JSONL/text",
            )
        return
    compressed = [f for f in files if f.endswith(".gz")]
    if fmt not in BYTE_RANGE_FORMATS or compressed:
        what = (
            f"{compressed[0]} is compressed"
            if compressed
            else f"corpus.format is {fmt!r}"
            + (" (set format: jsonl for JSON lines)" if fmt == "json" else "")
        )
        raise ConfigError(
            "corpus.piece_by",
            f"'bytes' needs uncompressed {' or '.join(BYTE_RANGE_FORMATS)} files, but {what}; "
            "use piece_by: files with several files (at most one piece per file), "
            "or corpus.pieces: 1",
        )


def _hub_kwargs(corpus: dict) -> dict:
    if os.path.isdir(os.path.expanduser(corpus["dataset"])):  # a local copy: never ask the hub
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return {"path": os.path.expanduser(corpus["dataset"]), "name": corpus.get("subset")}


def hub_data_files(corpus: dict) -> list[str]:
    """The data files of a hub dataset's split, in the order `datasets` streams them."""
    import datasets

    split = corpus.get("split", "train")
    builder = datasets.load_dataset_builder(**_hub_kwargs(corpus))
    data_files = builder.config.data_files
    if not data_files:
        raise ConfigError(
            "corpus.pieces",
            f"{corpus['dataset']!r} lists no data files (a loading-script dataset?); "
            "set corpus.pieces: 1",
        )
    if split not in data_files:
        raise ConfigError(
            "corpus.split",
            f"{split!r} is not a split of {corpus['dataset']!r}; splits: {sorted(data_files)}",
        )
    return [str(f) for f in data_files[split]]


def _hub_documents(corpus: dict, files: list[str]) -> Iterator[str]:
    split, where = corpus.get("split", "train"), _hub_kwargs(corpus)
    return iter_datasets(
        where["path"],
        corpus.get("text_field", "text"),
        "corpus.dataset",
        name=where["name"],
        split=split,
        streaming=True,
        data_files={split: files},
    )


def _segments(files: list[str], fmt: str, pieces: int) -> list[list[list]]:
    """For each piece, its [file, start, end] segments: byte cuts over the files' concatenation."""
    sizes = [os.path.getsize(f) for f in files]
    total, firsts = sum(sizes), list(itertools.accumulate([0] + sizes))
    cuts = [(0, 0)]  # (file k, aligned offset in file k)
    for p in range(1, pieces):
        c = p * total // pieces
        k = max(j for j in range(len(files)) if firsts[j] <= c)
        cut = (k, aligned_cut(files[k], fmt, c - firsts[k]))
        cuts.append(max(cut, cuts[-1]))
    cuts.append((len(files) - 1, sizes[-1]))
    plan = []
    for (k0, b0), (k1, b1) in zip(cuts, cuts[1:]):
        segs = [
            [files[k], b0 if k == k0 else 0, b1 if k == k1 else sizes[k]] for k in range(k0, k1 + 1)
        ]
        plan.append([s for s in segs if s[2] > s[1]])
    return plan


def _unit_documents(corpus: dict, unit, kind: str, fmt: str | None) -> Iterator[str]:
    if kind == "bytes":
        text_field = corpus.get("text_field", "text")
        return itertools.chain.from_iterable(
            range_documents(f, fmt, a, b, text_field) for f, a, b in unit
        )
    if corpus["source"] == "hub":
        return _hub_documents(corpus, unit)
    return iter_documents({**corpus, "path": unit, "max_documents": None})


def document_index(corpus: dict) -> dict:
    """The corpus's units and their document counts (wiki_offline: the document count)."""
    source, pieces, limit = corpus["source"], corpus.get("pieces", 1), corpus.get("max_documents")
    check_pieces(corpus)
    if source == "wiki_offline":
        n = sum(1 for _ in iter_wiki_offline(corpus))
        return {
            "source": source,
            "kind": "documents",
            "n_documents": n if limit is None else min(n, limit),
        }
    if source == "hub":
        kind, fmt = "files", None
        units = [[f] for f in hub_data_files(corpus)]
    elif source == "local":
        files, fmt = local_files(corpus)
        kind = piece_by(corpus, len(files))
        units = _segments(files, fmt, pieces) if kind == "bytes" else [[f] for f in files]
    else:
        raise ConfigError(
            "corpus.pieces",
            f"corpus.source {source!r} cannot be tokenized in pieces; set corpus.pieces: 1",
        )
    counts = [sum(1 for _ in _unit_documents(corpus, u, kind, fmt)) for u in units]
    return {"source": source, "kind": kind, "format": fmt, "units": units, "counts": counts}


def _group_units(index: dict, pieces: int) -> list[list[int]]:
    """Which units each piece reads: byte ranges one each; files balanced by document count."""
    counts = index["counts"]
    if index["kind"] == "bytes":
        return [[p] for p in range(pieces)]
    if len(counts) < pieces:
        raise ConfigError(
            "corpus.pieces",
            f"{pieces} pieces but the corpus has {len(counts)} files "
            f"(at most one piece per file): use at most {len(counts)}",
        )
    # file k goes to the piece its middle document falls in (by its first document, two equal
    # files in two pieces would both go to the first)
    n, cum = sum(counts), list(itertools.accumulate([0] + counts))
    owner = [
        min(pieces - 1, (2 * cum[k] + counts[k]) * pieces // max(2 * n, 1))
        for k in range(len(counts))
    ]
    groups = [[k for k in range(len(counts)) if owner[k] == p] for p in range(pieces)]
    if not all(groups):
        raise ConfigError(
            "corpus.pieces",
            f"a piece of {pieces} gets no file (files are too unequal in size); "
            "lower corpus.pieces",
        )
    return groups


def piece_plan(corpus: dict, index: dict) -> list[dict]:
    """For each piece: its first global document index, its document count and what it reads."""
    pieces, limit = corpus.get("pieces", 1), corpus.get("max_documents")
    if index["kind"] == "documents":
        n = index["n_documents"]
        starts = [p * n // pieces for p in range(pieces + 1)]
        plan = [
            {"start": starts[p], "n_documents": starts[p + 1] - starts[p]} for p in range(pieces)
        ]
    else:
        cum = list(itertools.accumulate([0] + index["counts"]))
        plan = [
            {
                "start": cum[g[0]],
                "n_documents": cum[g[-1] + 1] - cum[g[0]],
                "units": [index["units"][k] for k in g],
                "kind": index["kind"],
                "format": index["format"],
            }
            for g in _group_units(index, pieces)
        ]
    if limit is not None:
        for p in plan:
            p["n_documents"] = max(0, min(p["n_documents"], limit - p["start"]))
    return plan


def piece_documents(corpus: dict, piece: dict) -> Iterator[tuple[int, str]]:
    """(global document index, text) of one piece, streamed."""
    if piece.get("kind") is None:
        docs = itertools.islice(
            iter_wiki_offline(corpus), piece["start"], piece["start"] + piece["n_documents"]
        )
    elif piece["kind"] == "bytes":
        docs = itertools.islice(
            itertools.chain.from_iterable(
                _unit_documents(corpus, u, "bytes", piece["format"]) for u in piece["units"]
            ),
            piece["n_documents"],
        )
    else:
        files = [f for u in piece["units"] for f in u]
        docs = itertools.islice(_unit_documents(corpus, files, "files", None), piece["n_documents"])
    yield from enumerate(docs, start=piece["start"])
