"""Cross-check of the NLL stage with lm-evaluation-harness, on an exported model, offline.

The NLL stage (depthbench.evals) scores -log p(continuation | context) with its own pair
encoding and batching; lm-eval's `loglikelihood` (its HF backend, `HFLM`) computes the same
quantity from the transformers export. `write_task` turns an NLL set table (the Parquet file of
`depthbench.evals.run.build_sets`: one row per document with `context` and `continuation`) into
a local lm-eval task: the documents as JSON lines, read by `datasets`' json builder, and a YAML
task of output type `loglikelihood` whose request is exactly (context, continuation):
doc_to_text and doc_to_target are the two columns, zero-shot, no description, no delimiter.
`lmeval_loglikelihoods` runs it through lm-eval's `evaluate` and returns the per-document
log-likelihoods (lm-eval's logged samples), in nats.

Comparable only where lm-eval and the stage score the same tokens: a continuation that fits in
the window (lm-eval truncates the context on the left, as the stage's first window does; a
continuation longer than the window is scored in chunks by the stage, which lm-eval's
`loglikelihood` does not do). `fits_window` selects those documents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import yaml

from depthbench.util.io import atomic_write_text

TASK = "depthbench_nll"


def fits_window(docs: pd.DataFrame, window: int) -> pd.Series:
    """Documents whose continuation lm-eval's loglikelihood scores whole in a `window`-token
    input."""
    return docs["continuation_ids"].map(len) <= window


def write_task(docs: pd.DataFrame, task_dir: str | os.PathLike, name: str = TASK) -> Path:
    """Write `docs` (columns set, domain, doc_id, context, continuation) as a local lm-eval task."""
    missing = {"set", "domain", "doc_id", "context", "continuation"} - set(docs.columns)
    if missing:
        raise ValueError(
            f"NLL set table lacks columns {sorted(missing)}: "
            "build it with depthbench.evals.run.build_sets"
        )
    task_dir = Path(task_dir)
    data = task_dir / f"{name}.jsonl"
    rows = docs[["set", "domain", "doc_id", "context", "continuation"]].to_dict("records")
    atomic_write_text(
        data,
        "".join(json.dumps({"row": i, **r}, ensure_ascii=False) + "\n" for i, r in enumerate(rows)),
    )
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": "loglikelihood",
        "doc_to_text": "context",
        "doc_to_target": "continuation",
        "target_delimiter": "",
        "fewshot_delimiter": "",
        "num_fewshot": 0,
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}
        ],
    }
    atomic_write_text(task_dir / f"{name}.yaml", yaml.safe_dump(task, sort_keys=False))
    return task_dir


def lmeval_loglikelihoods(
    model_dir: str | os.PathLike,
    task_dir: str | os.PathLike,
    max_length: int,
    batch_size: int = 8,
    name: str = TASK,
    device: str = "cpu",
) -> pd.DataFrame:
    """Per-document log-likelihood (nats) of the task's continuations under the exported model,
    computed by lm-eval's HF backend in float32 on `device`; rows in the task's document order."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model_dir = Path(model_dir)
    remote = (model_dir / "modeling_depthbench.py").exists()
    lm = HFLM(
        pretrained=str(model_dir),
        backend="causal",
        dtype="float32",
        device=device,
        batch_size=batch_size,
        max_length=max_length,
        trust_remote_code=remote,
    )
    # lm-eval's evaluate() on the loaded task (what simple_evaluate calls, without its environment
    # report: torch's collect_env runs pip and other subprocesses for a minute on 2 cores).
    # include_defaults=False: only our task is indexed, not lm-eval's ~14,000 built-in YAMLs
    # (2 min).
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False).load([name])
    tasks["tasks"][name].set_fewshot_seed(seed=0)
    results = evaluate(lm=lm, task_dict=tasks, log_samples=True, bootstrap_iters=0)
    samples = results["samples"][name]
    out = pd.DataFrame(
        {
            "row": [s["doc"]["row"] for s in samples],
            "doc_id": [s["doc"]["doc_id"] for s in samples],
            "set": [s["doc"]["set"] for s in samples],
            "loglikelihood": [float(s["resps"][0][0][0]) for s in samples],
            # lm-eval's own encoding of each request (its prefix token for an empty context)
            "token_ids": [_encode(lm, *s["arguments"][0]) for s in samples],
        }
    )
    return out.sort_values("row").reset_index(drop=True)


def _encode(lm, context: str, continuation: str) -> tuple[list[int], list[int]]:
    if context == "":
        return [lm.prefix_token_id], lm.tok_encode(continuation)
    return lm._encode_pair(context, continuation)
