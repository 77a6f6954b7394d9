"""corpus.pieces: tokenization in N jobs whose union equals the single-job output token for
token."""

import numpy as np

from depthbench.grid.config import expand_grid
from depthbench.grid.ids import data_id
from depthbench.spec.schema import load_config
from depthbench.data.loader import TokenWindows
from depthbench.data.prepare import (
    build_index,
    build_piece,
    build_shards,
    build_tokenizer,
    merge_shards,
)
from depthbench.data.shards import read_meta, split_files
from tests.conftest import tiny_config
from tests.workflow_runs import split_corpus


def _tokens(data_dir, split):
    meta = read_meta(data_dir)
    return np.concatenate(
        [np.fromfile(f, dtype=meta["dtype"]) for f in split_files(data_dir, meta, split)]
    )


def _pieces(config, tok, out, pieces):
    exp = expand_grid(config)
    build_index(config, str(out / "index.json"))
    dirs = [str(out / "pieces" / f"{p:05d}") for p in range(pieces)]
    for p, d in enumerate(dirs):
        build_piece(config, str(tok), str(out / "index.json"), p, d)
    return merge_shards(config, str(tok), dirs, str(out), exp.data_id, exp.tokenizer_id)


def test_pieces_equal_single_job_local_files_and_wiki(wiki_jsonl, tmp_path):
    files = split_corpus(wiki_jsonl, tmp_path, 5)
    for corpus in (
        {"name": "t", "source": "local", "path": files, "val_fraction": 0.1},
        {"name": "t", "source": "wiki_offline", "max_documents": 300, "val_fraction": 0.1},
    ):
        single = load_config(tiny_config(wiki_jsonl, corpus=dict(corpus)))
        tok = tmp_path / "tok.json"
        build_tokenizer(single, str(tok))
        exp = expand_grid(single)
        build_shards(single, str(tok), str(tmp_path / "one"), exp.data_id, exp.tokenizer_id)
        sharded = load_config(tiny_config(wiki_jsonl, corpus={**corpus, "pieces": 3}))
        meta = _pieces(sharded, tok, tmp_path / "three", 3)
        one = read_meta(tmp_path / "one")
        assert meta["pieces"] == 3 and len(meta["train"]["files"]) == 3
        for split in ("train", "val"):
            assert np.array_equal(
                _tokens(tmp_path / "three", split), _tokens(tmp_path / "one", split)
            ), (corpus["source"], split)
            assert meta[split]["n_documents"] == one[split]["n_documents"]
            assert meta[split]["n_tokens"] == one[split]["n_tokens"]
        assert meta["unigram_val_loss"] == one["unigram_val_loss"]
        assert meta["tokenizer_sha256"] == one["tokenizer_sha256"]
        # windows never cross a piece file: each window lies inside one piece's tokens
        windows = TokenWindows(split_files(tmp_path / "three", meta, "train"), meta["dtype"], 16)
        per_file = [(n - 1) // 16 for n in (len(a) for a in windows.arrays)]
        assert len(windows) == sum(per_file)


def test_pieces_default_keeps_the_data_id(wiki_jsonl):
    base = load_config(tiny_config(wiki_jsonl))
    assert base["corpus"]["pieces"] == 1
    legacy = {**base, "corpus": {k: v for k, v in base["corpus"].items() if k != "pieces"}}
    assert data_id(base) == data_id(legacy)
    assert data_id(
        load_config(tiny_config(wiki_jsonl, corpus={**base["corpus"], "pieces": 2}))
    ) != data_id(base)
