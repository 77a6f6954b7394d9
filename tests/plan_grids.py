"""The grid and the plan summary shared by the plan cache's tests (tests/unit/test_plan_cache.py,
tests/integration/test_start_up_imports.py): a tiny config of two architectures and two learning
rates, and what a plan holds (its validated config, run specs, ids and figures) as plain data."""

from __future__ import annotations

from tests.conftest import tiny_config


def two_architecture_grid(wiki_jsonl, **overrides) -> dict:
    """The tiny config on `wiki_jsonl` with architectures pre_ln and hc and two learning rates,
    `overrides` replacing its sections."""
    return tiny_config(
        wiki_jsonl, architectures=["pre_ln", "hc"], learning_rates=[3e-3, 1e-2], **overrides
    )


def plan_summary(plan) -> dict:
    """A plan's validated config, run specs, ids and figures, as JSON-ready data."""
    exp = plan.experiment
    return {
        "config": exp.config,
        "runs": {rid: spec.to_dict() for rid, spec in exp.candidate_runs.items()},
        "ids": [exp.vocab_size, exp.tokenizer_id, exp.data_id],
        "figures": plan.figures,
    }
