"""Byte-range pieces of one large local file, hub datasets cut by data file, and bad piece settings.

The references are `datasets` itself (what the single job reads) and the single-job
tokenization; neither shares the byte-range reader or the piece plan under test."""

import json
import os

import numpy as np
import pytest

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.data import ranges
from depthbench.data.pieces import piece_plan
from depthbench.data.prepare import build_index, build_piece, build_shards, build_tokenizer
from depthbench.data.shards import read_meta
from depthbench.util.errors import ConfigError
from tests.conftest import tiny_config
from tests.unit.test_tokenize_pieces import _pieces, _tokens


def _datasets_documents(path, fmt):
    import datasets

    extra = {"sample_by": "paragraph"} if fmt == "text" else {}
    rows = datasets.load_dataset(
        "json" if fmt == "jsonl" else "text",
        data_files=[str(path)],
        split="train",
        streaming=True,
        **extra,
    )
    return [r["text"] for r in rows if r["text"]]


# Edge cases of both formats: blank and whitespace lines, empty and null texts, a BOM, "\r\n" and
# lone "\r" line ends, newline runs of every length, a multi-byte character next to a cut, and a
# last line without a newline.
_EDGE_FILES = {
    "a.jsonl": (
        b'\xef\xbb\xbf{"text": "\\u00e9t\\u00e9"}\r\n\n   \n'
        b'{"text": ""}\n{"text": null}\n{"text": "  "}\n'
        + b"".join(b'{"text": "doc %d \xc3\xa9"}\n' % i for i in range(9))
        + b'{"text": "last, no newline"}'
    ),
    "b.txt": (
        b"p1 l1\r\np1 l2\r\n\r\np2\r\r\r\np3\n\n\n\n\nq\n\n\n\xc3\xa9a\r\n\nb\n\r\nc \n\n\n\nend"
    ),
    "c.txt": b"\n\none\n\n\n\ntwo\r\r\rthree\n" * 5,
}


def test_byte_ranges_are_the_documents_datasets_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name, data in _EDGE_FILES.items():
        path, fmt = tmp_path / name, "jsonl" if name.endswith(".jsonl") else "text"
        path.write_bytes(data)
        want = _datasets_documents(path, fmt)
        for chunk in (ranges.CHUNK, 3, 5):  # tiny buffers: separators and lines across reads
            monkeypatch.setattr(ranges, "CHUNK", chunk)
            for n in (1, 2, 3, 5, 8, 40):  # 40 ranges: more ranges than documents
                cuts = ranges.byte_boundaries(str(path), fmt, n)
                assert cuts[0] == 0 and cuts[-1] == len(data) and cuts == sorted(cuts)
                if fmt == "jsonl":
                    assert all(data[c - 1 : c] == b"\n" for c in cuts[1:-1] if 0 < c < len(data))
                got = [
                    d
                    for a, b in zip(cuts, cuts[1:])
                    for d in ranges.range_documents(str(path), fmt, a, b)
                ]
                assert got == want, (name, chunk, n)


def _single_and_pieces(wiki_jsonl, tmp_path, corpus, pieces):
    single = load_config(tiny_config(wiki_jsonl, corpus=dict(corpus)))
    tok = tmp_path / "tok.json"
    build_tokenizer(single, str(tok))
    exp = expand_grid(single)
    build_shards(single, str(tok), str(tmp_path / "one"), exp.data_id, exp.tokenizer_id)
    sharded = load_config(tiny_config(wiki_jsonl, corpus={**corpus, "pieces": pieces}))
    meta = _pieces(sharded, tok, tmp_path / "many", pieces)
    one = read_meta(tmp_path / "one")
    for split in ("train", "val"):
        assert np.array_equal(
            _tokens(tmp_path / "many", split), _tokens(tmp_path / "one", split)
        ), split
        assert (
            meta[split]["n_documents"] == one[split]["n_documents"]
            and meta[split]["n_tokens"] == one[split]["n_tokens"]
        )
    assert meta["unigram_val_loss"] == one["unigram_val_loss"]
    return sharded, json.loads((tmp_path / "many" / "index.json").read_text())


def test_one_jsonl_file_in_byte_ranges_equals_the_single_job(wiki_jsonl, tmp_path):
    # one file (piece_by defaults to bytes), its last line without a newline
    path = tmp_path / "big.jsonl"
    path.write_bytes(wiki_jsonl.read_bytes().rstrip(b"\n"))
    config, index = _single_and_pieces(
        wiki_jsonl,
        tmp_path,
        {"name": "t", "source": "local", "path": str(path), "val_fraction": 0.1},
        5,
    )
    assert index["kind"] == "bytes" and sum(index["counts"]) == 400 and min(index["counts"]) > 0
    data, size = path.read_bytes(), path.stat().st_size
    for p, unit in enumerate(index["units"][1:], start=1):
        start = unit[0][1]
        assert data[start - 1 : start] == b"\n"  # a range starts on a line
        assert (
            start != p * size // 5
        )  # the raw cut fell inside a document, which went to one piece only
    assert [pl["start"] for pl in piece_plan(config["corpus"], index)] == [
        sum(index["counts"][:p]) for p in range(5)
    ]


def test_text_files_and_a_tiny_file_in_byte_ranges(wiki_jsonl, tmp_path):
    # text paragraphs over two files, cut by bytes across the file boundary
    docs = [json.loads(line)["text"] for line in wiki_jsonl.read_text().splitlines()[:120]]
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    paths[0].write_text("\n\n".join(d.replace("\n\n", "\n") for d in docs[:70]) + "\n")
    paths[1].write_text("\n\n\n".join(d.replace("\n\n", "\n") for d in docs[70:]))
    corpus = {
        "name": "t",
        "source": "local",
        "path": [str(p) for p in paths],
        "val_fraction": 0.3,
        "piece_by": "bytes",
    }
    _, index = _single_and_pieces(wiki_jsonl, tmp_path / "text", corpus, 3)
    assert any(
        len(unit) == 2 for unit in index["units"]
    )  # one piece reads the end of a and the start of b
    # a file of 4 documents in 9 ranges: empty pieces are fine, the union is still the whole
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:4]))
    _, index = _single_and_pieces(
        wiki_jsonl,
        tmp_path / "tiny",
        {"name": "t", "source": "local", "path": str(tiny), "val_fraction": 0.3},
        9,
    )
    assert index["counts"].count(0) >= 5 and sum(index["counts"]) == 4


def _hub_layout(wiki_jsonl, root, n_files):
    """A local directory laid out like a hub dataset: data/train-0000k-of-0000n.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [json.loads(line)["text"] for line in wiki_jsonl.read_text().splitlines()]
    (root / "data").mkdir(parents=True)
    step = -(-len(docs) // n_files)
    for k in range(n_files):
        part = docs[k * step : (k + 1) * step] + (
            [""] if k == 1 else []
        )  # an empty text is skipped, as in the single job
        pq.write_table(
            pa.table({"text": part, "id": list(range(len(part)))}),
            root / "data" / f"train-{k:05d}-of-{n_files:05d}.parquet",
        )
    return root


def test_hub_dataset_in_pieces_by_data_file(wiki_jsonl, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hub = _hub_layout(wiki_jsonl, tmp_path / "hub", 5)
    corpus = {"name": "t", "source": "hub", "dataset": str(hub), "val_fraction": 0.1}
    config, index = _single_and_pieces(wiki_jsonl, tmp_path, corpus, 3)
    assert index["kind"] == "files" and [os.path.basename(u[0]) for u in index["units"]] == sorted(
        os.listdir(hub / "data")
    )
    assert sum(index["counts"]) == 400
    plan = piece_plan(config["corpus"], index)
    assert sorted(f for p in plan for u in p["units"] for f in u) == sorted(
        u[0] for u in index["units"]
    )
    too_many = load_config(tiny_config(wiki_jsonl, corpus={**corpus, "pieces": 6}))
    with pytest.raises(ConfigError, match="corpus.pieces.*at most 5"):
        build_index(too_many, str(tmp_path / "index6.json"))
    with pytest.raises(ConfigError, match="corpus.split.*'train'"):
        build_index(
            load_config(tiny_config(wiki_jsonl, corpus={**corpus, "pieces": 2, "split": "test"})),
            str(tmp_path / "i.json"),
        )


@pytest.mark.parametrize(
    "corpus, field, words",
    [
        (
            {"source": "local", "path": "PARQUET", "piece_by": "bytes"},
            "corpus.piece_by",
            "jsonl or text",
        ),
        ({"source": "local", "path": "GZ"}, "corpus.piece_by", "compressed"),
        (
            {"source": "local", "path": ["JSONL", "JSONL2"], "piece_by": "files"},
            "corpus.pieces",
            "at most 2",
        ),
        ({"source": "hub", "dataset": "x/y", "piece_by": "bytes"}, "corpus.piece_by", "data files"),
        ({"source": "wiki_offline", "piece_by": "files"}, "corpus.piece_by", "local"),
    ],
)
def test_bad_piece_settings_fail_at_config_time(wiki_jsonl, tmp_path, corpus, field, words):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b c"] * 3}), tmp_path / "c.parquet")
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(wiki_jsonl.read_bytes()))
    (tmp_path / "c2.jsonl").write_bytes(wiki_jsonl.read_bytes())
    names = {
        "PARQUET": str(tmp_path / "c.parquet"),
        "GZ": str(tmp_path / "c.jsonl.gz"),
        "JSONL": str(wiki_jsonl),
        "JSONL2": str(tmp_path / "c2.jsonl"),
    }
    if "path" in corpus:
        corpus = {
            **corpus,
            "path": [names[p] for p in corpus["path"]]
            if isinstance(corpus["path"], list)
            else names[corpus["path"]],
        }
    with pytest.raises(ConfigError, match=field) as info:
        expand_grid(
            load_config(tiny_config(wiki_jsonl, corpus={"name": "t", "pieces": 3, **corpus}))
        )
    assert words in str(info.value)


def _traced_piece_peak(config, tok, out) -> int:
    """Peak Python-heap bytes (tracemalloc) of the tokenize_piece job for piece 0, over what was
    allocated before it started."""
    import tracemalloc

    build_index(config, str(out / "index.json"))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        build_piece(config, str(tok), str(out / "index.json"), 0, str(out / "piece0"))
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_piece_job_memory_does_not_grow_with_the_corpus(wiki_jsonl, tmp_path, monkeypatch):
    """Each kind at two corpus sizes, 2x apart: the larger piece's peak stays within a small
    fraction of the extra bytes it reads (a reader or writer that kept documents, lines or
    offsets would grow by at least that much). Batches of 16 documents and a 4 kB read buffer,
    so that both sizes span many of each; `datasets` reads each ~90 kB file in one chunk (10 MB
    at most). The larger corpus has more files, not larger ones, so the reading libraries keep
    a little per file (paths, cache entries: up to 8 kB a file in a worker that ran other tests
    first); the files are large enough that this stays well under the threshold. The RSS at
    4-48 MB corpora is measured in docs/benchmarks.md."""
    import functools

    import pyarrow as pa
    import pyarrow.parquet as pq

    from depthbench.data import prepare

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(
        prepare, "write_piece", functools.partial(prepare.write_piece, batch_size=16)
    )
    monkeypatch.setattr(
        ranges, "CHUNK", 4096
    )  # the byte-range reader's buffer, 1 MiB, would hold both sizes whole
    docs = [json.loads(line)["text"][:300] for line in wiki_jsonl.read_text().splitlines()]
    tok = tmp_path / "tok.json"
    build_tokenizer(load_config(tiny_config(wiki_jsonl)), str(tok))
    peaks = {}
    for n_files in (8, 8, 16):  # the first run warms caches and lazy imports up and is not counted
        root = tmp_path / f"n{n_files}-{len(peaks)}"
        (root / "hub" / "data").mkdir(parents=True)
        paths = []
        for k in range(n_files):
            part = (
                docs[(k * 50) % 400 : (k * 50) % 400 + 50] * 6
            )  # 300 documents, about 90 kB a file
            paths.append(root / f"f{k}.jsonl")
            paths[-1].write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
            pq.write_table(
                pa.table({"text": part}),
                root / "hub" / "data" / f"train-{k:05d}-of-{n_files:05d}.parquet",
            )
        big = root / "big.jsonl"
        big.write_bytes(b"".join(p.read_bytes() for p in paths))
        corpora = {
            "bytes": {"source": "local", "path": str(big)},
            "files": {"source": "local", "path": [str(p) for p in paths]},
            "hub": {"source": "hub", "dataset": str(root / "hub")},
        }
        for kind, corpus in corpora.items():
            config = load_config(
                tiny_config(
                    wiki_jsonl, corpus={"name": "m", "val_fraction": 0.1, "pieces": 2, **corpus}
                )
            )
            (root / f"out-{kind}").mkdir()
            peaks[(kind, n_files, len(peaks) < 3)] = _traced_piece_peak(
                config, tok, root / f"out-{kind}"
            )
    extra_bytes = big.stat().st_size // 4  # piece 0 reads half of each corpus: 8 files' worth vs 4
    for kind in ("bytes", "files", "hub"):
        small, large = peaks[(kind, 8, False)], peaks[(kind, 16, False)]
        assert large - small < 0.25 * extra_bytes, (kind, small, large, extra_bytes)


def test_hub_subset_from_readme_configs_in_pieces(tmp_path, monkeypatch):
    """A dataset whose README lists configs (as many hub datasets do): corpus.subset picks one,
    and its data files, in pieces, are the documents the single streaming job reads."""
    from depthbench.data.corpus import iter_documents
    from depthbench.data.pieces import document_index, piece_documents

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    front = "".join(
        f"- config_name: {lang}\n  data_files:\n  - split: train\n    path: {lang}/*.jsonl\n"
        for lang in ("en", "fr")
    )
    (tmp_path / "README.md").write_text(f"---\nconfigs:\n{front}---\n")
    for lang in ("en", "fr"):
        (tmp_path / lang).mkdir()
        for k in range(3):
            (tmp_path / lang / f"p{k}.jsonl").write_text(
                "".join(json.dumps({"text": f"{lang} {k} {j}"}) + "\n" for j in range(k + 1))
            )
    corpus = {"source": "hub", "dataset": str(tmp_path), "subset": "en", "pieces": 2}
    index = document_index(corpus)
    assert index["counts"] == [1, 2, 3]
    docs = [(i, d) for p in piece_plan(corpus, index) for i, d in piece_documents(corpus, p)]
    assert docs == list(enumerate(iter_documents(corpus))) and docs[-1] == (5, "en 2 2")
