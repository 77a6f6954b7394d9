"""lm-evaluation-harness's loglikelihood on an exported model equals our NLL stage (offline).

Our side is the stage itself (build_sets + run_nll on the run folder, DepthBench's model);
lm-eval's side is `simple_evaluate` on a local task written from the same set table, through
its HF backend on the transformers export. Nothing is shared but the documents.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pandas as pd
import pytest

from depthbench.evals.run import build_sets, run_nll
from depthbench.hf.export import export_run
from depthbench.hf.lmeval import fits_window, lmeval_loglikelihoods, write_task
from tests.unit.test_hf_export import eager_models, fake_run, random_model, tokenizer_file  # noqa: F401 (fixtures)

WINDOW = 32  # the fake run's training seq_len: the stage's window
CUSTOM = [  # what the pair encoding must get right: whitespace moved, empty context, unicode, \n
    {
        "context": "Question: how deep is the model?\nAnswer:",
        "continuation": " four layers",
        "domain": "code",
    },
    {"context": "", "continuation": "The quick brown fox", "domain": "code"},
    {"context": "def f(x):\n    ", "continuation": "return x * 2", "domain": "code"},
    {
        "context": "Numbers 0123 and punctuation; ",
        "continuation": "wörds ✓ and more",
        "domain": "code",
    },
    {"context": "The cat sleeps " * 8, "continuation": "in the sun.", "domain": "code"},
]


@pytest.fixture(scope="module")
def sets_table(tmp_path_factory, tokenizer_file):  # noqa: F811
    """The stage's set table: 6 SciQ documents (long contexts, truncated on the left to the
    window) and the custom ones, restricted to continuations that fit in the window."""
    root = tmp_path_factory.mktemp("sets")
    custom = root / "custom.jsonl"
    custom.write_text("".join(json.dumps(d) + "\n" for d in CUSTOM))
    settings = {
        "sets": ["sciq"],
        "max_docs_per_set": 6,
        "custom": [{"name": "mine", "path": str(custom)}],
    }
    table = build_sets(settings, str(tokenizer_file), None, str(root / "all.parquet"))
    table = table[fits_window(table, WINDOW)].reset_index(drop=True)
    assert len(table) >= 9 and table["context"].eq("").any()
    assert (
        table["context_ids"].map(len) + table["continuation_ids"].map(len) > WINDOW + 1
    ).any()  # truncation
    path = root / "sets.parquet"
    table.to_parquet(path, index=False)
    return table, path


@pytest.mark.parametrize("arch", ["pre_ln", "attnres_full"])
def test_lmeval_loglikelihood_equals_our_nll_stage(arch, tmp_path, tokenizer_file, sets_table):  # noqa: F811
    table, sets_path = sets_table
    model = random_model(arch, seed=3)
    run_dir = fake_run(tmp_path, model, tokenizer_file)
    export_run(run_dir, tmp_path / "export")
    spec = json.loads((run_dir / "summary.json").read_text())["spec"]
    run_nll(
        spec, str(run_dir), str(sets_path), str(tmp_path / "nll.parquet"), {"tokens_per_batch": 512}
    )
    ours = pd.read_parquet(tmp_path / "nll.parquet")
    assert set(ours["window"]) == {WINDOW}

    theirs = lmeval_loglikelihoods(
        tmp_path / "export", write_task(table, tmp_path / "task"), max_length=WINDOW, batch_size=4
    )
    assert len(theirs) == len(table)
    # lm-eval tokenizes each request as the stage did (pair encoding, EOS for an empty context)
    assert [list(c) for c, _ in theirs["token_ids"]] == [list(c) for c in table["context_ids"]]
    assert [list(x) for _, x in theirs["token_ids"]] == [list(x) for x in table["continuation_ids"]]
    lm_nll = -theirs.assign(set=table["set"]).groupby("set")["loglikelihood"].sum()
    by_set = ours[ours["level"] == "set"].groupby("set")["nll_sum"].sum()
    assert sorted(lm_nll.index) == sorted(by_set.index) == ["mine", "sciq"]
    for name in by_set.index:
        assert abs(lm_nll[name] - by_set[name]) <= 1e-4 * abs(by_set[name]), name
    total = ours[ours["level"] == "domain"]["nll_sum"].sum()
    assert total > 10 and abs(-theirs["loglikelihood"].sum() - total) <= 1e-4 * total
