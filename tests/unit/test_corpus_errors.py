"""A corpus that is empty, not UTF-8, not valid JSON or without the text field is refused with an
error naming the file and line: at config validation for the head of the file, and before the
tokenizer is trained for the rest."""

from __future__ import annotations

import re

import pytest

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError, DataError
from tests.conftest import tiny_config


CORPUS_CASES = {
    "empty.jsonl": (b"", "is empty"),
    "blank.jsonl": (b"\n  \n\n", "no non-empty document"),
    "latin1.jsonl": (
        b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
        "line 2 (byte offset 28) is not UTF-8",
    ),
    "broken.jsonl": (b'{"text": "ok"}\n{"text": "cut\n', "line 2, column 10: not valid JSON"),
    "latin1.txt": (
        b"first paragraph\n\nsecond \xe9t\xe9\n",
        "line 3 (byte offset 24) is not UTF-8",
    ),
}


@pytest.mark.parametrize("name", sorted(CORPUS_CASES))
def test_bad_corpus_is_refused_at_validation_naming_file_and_line(wiki_jsonl, tmp_path, name):
    data, message = CORPUS_CASES[name]
    path = tmp_path / name
    path.write_bytes(data)
    config = tiny_config(wiki_jsonl)
    config["corpus"]["path"] = str(path)
    with pytest.raises(DataError, match=re.escape(str(path)) + ".*" + re.escape(message)):
        expand_grid(load_config(config))


def test_bad_bytes_past_the_checked_head_fail_before_the_tokenizer_is_trained(
    wiki_jsonl, tmp_path, monkeypatch
):
    from depthbench.data import prepare

    from depthbench.data.corpus_checks import HEAD_BYTES

    head = wiki_jsonl.read_bytes() * (1 + HEAD_BYTES // len(wiki_jsonl.read_bytes()))
    path = tmp_path / "big.jsonl"
    path.write_bytes(head + b'{"text": "\xff"}\n')
    lines = head.count(b"\n")
    config = load_config(tiny_config(path))
    expand_grid(config)  # only the head is read at config time
    monkeypatch.setattr(prepare, "train_bpe", lambda *a: pytest.fail("the tokenizer was trained"))
    with pytest.raises(DataError, match=re.escape(str(path)) + f".*line {lines + 1} .*not UTF-8"):
        prepare.build_tokenizer(config, str(tmp_path / "tok.json"))


def test_missing_text_field_names_the_field_and_line(wiki_jsonl, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"body": "text"}\n')
    config = tiny_config(wiki_jsonl)
    config["corpus"]["path"] = str(path)
    with pytest.raises(ConfigError, match=r"corpus\.text_field.*line 1"):
        expand_grid(load_config(config))
