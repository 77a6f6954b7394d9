"""Tokenization into OLMo-style shards, the document split and the unigram floor."""

import json

import numpy as np
import pandas as pd
import pytest
from tokenizers import Tokenizer

from depthbench.grid.config import expand_grid
from depthbench.grid.ids import data_id
from depthbench.spec.schema import load_config
from depthbench.data.corpus import is_validation, iter_documents, split_documents
from depthbench.util.errors import ConfigError
from depthbench.data.loader import ShuffledSampler, TokenWindows, TrainBatches
from depthbench.data.prepare import build_shards, build_tokenizer
from depthbench.data.shards import read_meta, shard_dtype, unigram_loss
from tests.conftest import tiny_config


def test_shards_are_raw_little_endian_with_eos_per_document(tiny_data, wiki_jsonl):
    config, exp, shards = tiny_data
    meta = read_meta(shards)
    tok = Tokenizer.from_file(str(shards.parent / "tokenizer.json"))
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512
    train = np.fromfile(shards / "train.bin", dtype="<u2")
    val = np.fromfile(shards / "val.bin", dtype="<u2")
    assert len(train) == meta["train"]["n_tokens"] and len(val) == meta["val"]["n_tokens"]
    n_docs = meta["train"]["n_documents"] + meta["val"]["n_documents"]
    assert n_docs == 400
    eos = meta["eos_id"]
    assert int((train == eos).sum()) == meta["train"]["n_documents"]
    assert train[-1] == eos and val[-1] == eos
    # offsets delimit documents; the first train document decodes back to the source text
    offsets = np.load(shards / "train.docs.npy")
    assert offsets.shape == (meta["train"]["n_documents"], 2)
    first_train = next(
        d for i, d in enumerate(iter_documents(config["corpus"])) if not is_validation(i, 0.1, 1234)
    )
    start, end = offsets[0]
    assert tok.decode(train[start : end - 1].tolist()) == first_train
    assert meta["tokenizer_sha256"] and meta["tokenizer_id"] == exp.tokenizer_id


def test_unigram_floor_is_the_cross_entropy_from_token_counts(tiny_data):
    _, _, shards = tiny_data
    meta = read_meta(shards)
    train = np.fromfile(shards / "train.bin", dtype="<u2")
    val = np.fromfile(shards / "val.bin", dtype="<u2")
    V = meta["vocab_size"]
    counts = np.bincount(train, minlength=V).astype(float)
    p = (counts + 1) / (counts.sum() + V)
    direct = -np.mean(np.log(p[val]))
    assert meta["unigram_val_loss"] == pytest.approx(direct, rel=1e-9)
    # without smoothing on a set where every token is seen, it is the entropy H(p)
    c = np.array([5.0, 3.0, 2.0])
    assert unigram_loss(c * 1e6, c) == pytest.approx(-(c / 10 * np.log(c / 10)).sum(), rel=1e-5)


def test_dtype_follows_the_vocabulary():
    assert shard_dtype(50280) == np.dtype("<u2")
    assert shard_dtype(65536) == np.dtype("<u2")
    assert shard_dtype(65537) == np.dtype("<u4")
    assert shard_dtype(151936) == np.dtype("<u4")


def test_split_is_deterministic_and_disjoint(wiki_jsonl):
    corpus = {"source": "local", "path": str(wiki_jsonl), "val_fraction": 0.2, "split_seed": 7}
    val = list(split_documents(corpus, True))
    train = list(split_documents(corpus, False))
    assert len(val) + len(train) == 400
    assert 40 < len(val) < 120
    assert not set(val) & set(train)
    assert val == list(split_documents(corpus, True))


@pytest.mark.parametrize("fmt", ["parquet", "text"])
def test_local_formats_read_the_same_documents(tmp_path, wiki_jsonl, fmt):
    docs = [json.loads(line)["text"] for line in wiki_jsonl.read_text().splitlines()[:20]]
    if fmt == "parquet":
        path = tmp_path / "c.parquet"
        pd.DataFrame({"body": docs}).to_parquet(path)
        corpus = {"source": "local", "path": str(path), "text_field": "body"}
        assert list(iter_documents(corpus)) == docs
    else:
        path = tmp_path / "c.txt"
        path.write_text("\n\n".join(d.replace("\n\n", " ") for d in docs) + "\n")
        got = list(iter_documents({"source": "local", "path": str(path), "format": "text"}))
        assert [g.strip() for g in got] == [d.replace("\n\n", " ") for d in docs]


def test_wrong_text_field_is_named(wiki_jsonl):
    with pytest.raises(ConfigError, match="corpus.text_field"):
        next(iter_documents({"source": "local", "path": str(wiki_jsonl), "text_field": "content"}))


def test_tokenizer_file_and_external_shards(tmp_path, tiny_data, wiki_jsonl):
    """Shards made elsewhere (OLMo-core layout) are described, not copied, and train the same."""
    config, exp, shards = tiny_data
    tok_path = shards.parent / "tokenizer.json"
    cfg = load_config(
        tiny_config(
            wiki_jsonl,
            corpus={
                "name": "ext",
                "source": "shards",
                "train_paths": [str(shards / "train.bin")],
                "val_paths": [str(shards / "val.bin")],
                "dtype": "uint16",
                "eos_id": read_meta(shards)["eos_id"],
            },
            tokenizer={"kind": "file", "path": str(tok_path)},
        )
    )
    ext_exp = expand_grid(cfg)
    assert ext_exp.vocab_size == 512
    out = tmp_path / "tok.json"
    build_tokenizer(cfg, str(out))
    meta = build_shards(cfg, str(out), str(tmp_path / "ext"), ext_exp.data_id, ext_exp.tokenizer_id)
    ref = read_meta(shards)
    assert meta["train"]["n_tokens"] == ref["train"]["n_tokens"]
    assert meta["train"]["n_documents"] == ref["train"]["n_documents"]
    assert meta["unigram_val_loss"] == pytest.approx(ref["unigram_val_loss"])


def test_bpe_tokenizer_is_trained_on_the_training_split_only(tmp_path, wiki_jsonl):
    config = load_config(tiny_config(wiki_jsonl))
    path = tmp_path / "t.json"
    build_tokenizer(config, str(path))
    tok = Tokenizer.from_file(str(path))
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id("<|endoftext|>") is not None
    # a corpus of only validation documents would give a different tokenizer: train split only
    assert data_id(config) != data_id(
        {**config, "corpus": {**config["corpus"], "val_fraction": 0.5}}
    )


def test_batches_are_deterministic_disjoint_across_ranks_and_cover_an_epoch(tiny_data):
    _, _, shards = tiny_data
    meta = read_meta(shards)
    windows = TokenWindows([str(shards / "train.bin")], meta["dtype"], 16)
    one = TrainBatches(windows, seed=3, global_batch=8, micro_batch=4)
    x, y = one.get(5, 1)
    assert torch_equal(x[:, 1:], y[:, :-1])
    x2, _ = TrainBatches(windows, seed=3, global_batch=8, micro_batch=4).get(5, 1)
    assert torch_equal(x, x2)
    # two ranks each take a disjoint half of the same global batch
    full = [one.get(5, m)[0] for m in range(2)]
    r0 = TrainBatches(windows, 3, 8, 4, rank=0, world=2).get(5, 0)[0]
    r1 = TrainBatches(windows, 3, 8, 4, rank=1, world=2).get(5, 0)[0]
    rows_full = {tuple(r.tolist()) for b in full for r in b}
    assert {tuple(r.tolist()) for r in r0} | {tuple(r.tolist()) for r in r1} == rows_full
    # rank r's micro-batch m is the single rank's micro-batch m * world + r, whole
    assert torch_equal(r0, full[0]) and torch_equal(r1, full[1])
    sampler = ShuffledSampler(len(windows), 3)
    assert sorted(sampler(g) for g in range(len(windows))) == list(range(len(windows)))


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_hub_source_reads_through_the_same_interface_on_a_local_dataset_folder(
    tmp_path, wiki_jsonl
):
    """`source: hub` calls datasets.load_dataset(name, subset, split, streaming); a local dataset
    folder stands in for a hub repository here (no network)."""
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text(wiki_jsonl.read_text())
    corpus = {
        "source": "hub",
        "dataset": str(folder),
        "subset": None,
        "split": "train",
        "streaming": True,
        "max_documents": 25,
    }
    hub_docs = list(iter_documents(corpus))
    local_docs = list(
        iter_documents({"source": "local", "path": str(wiki_jsonl), "max_documents": 25})
    )
    assert len(hub_docs) == 25 and hub_docs == local_docs


def test_a_seq_len_is_refused_naming_train_seq_len_exactly_when_a_split_has_no_window(tiny_data):
    from depthbench.data.shards import check_seq_len, split_files

    _, _, shards = tiny_data
    meta = read_meta(shards)
    n_train, n_val = meta["train"]["n_tokens"], meta["val"]["n_tokens"]
    assert n_val < n_train
    files = {split: split_files(shards, meta, split) for split in ("train", "val")}
    check_seq_len(shards, n_val - 1)  # the longest that fills one validation window
    assert len(TokenWindows(files["val"], meta["dtype"], n_val - 1)) == 1
    with pytest.raises(ValueError):  # what the loader would meet one token later
        TokenWindows(files["val"], meta["dtype"], n_val)
    with pytest.raises(
        ConfigError, match=rf"validation split .* has {n_val} tokens; valid: at most {n_val - 1}"
    ) as exc:
        check_seq_len(shards, n_val)
    assert exc.value.field == "train.seq_len" and str(exc.value).startswith(
        "config field 'train.seq_len': "
    )
    with pytest.raises(
        ConfigError, match=rf"training split .* has {n_train} tokens; valid: at most {n_train - 1}"
    ):
        check_seq_len(shards, n_train)
