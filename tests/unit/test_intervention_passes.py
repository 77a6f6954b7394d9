"""A bound on the passes of each intervention family (`max_passes`, what `depthbench rehearse`
asks for): the first k passes of a family give exactly the entries the unbounded computation
gives them, and every other entry is NaN."""

from __future__ import annotations

import pytest
import torch

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.probes import interventions

L, VOCAB = 4, 64


@pytest.fixture(scope="module")
def model_and_sample():
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="pre_ln", vocab_size=VOCAB, d_model=32, n_layer=L, n_head=2, max_seq_len=16
    )
    model = build_model(cfg).eval()
    return model, torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def same_or_nan(bounded: torch.Tensor, full: torch.Tensor, kept: torch.Tensor) -> None:
    """`bounded` equals `full` where `kept`, and is NaN everywhere else."""
    torch.testing.assert_close(bounded[kept], full[kept], rtol=0, atol=0, equal_nan=True)
    assert bounded[~kept].isnan().all()


@pytest.mark.parametrize("k", [1, 2])
def test_the_first_passes_of_each_family_and_nothing_else(model_and_sample, k):
    model, idx = model_and_sample
    # causal: pass s skips layer s and fills row s (s = 1 .. L - 1, in order)
    full = interventions.causal_scores(model, idx[:, :-1])
    rows = torch.zeros(L + 1, L + 1, dtype=torch.bool)
    rows[1 : k + 1] = True
    same_or_nan(interventions.causal_scores(model, idx[:, :-1], max_passes=k), full, rows)
    # permutation: one pass per pair (a, b), a < b, in the order (1, 2), (1, 3), ...
    full = interventions.permutation_scores(model, idx)
    pairs = [(a, b) for a in range(1, L + 1) for b in range(a + 1, L + 1)][:k]
    kept = torch.zeros(L + 1, L + 1, dtype=torch.bool)
    for a, b in pairs:
        kept[a, b] = True
    same_or_nan(interventions.permutation_scores(model, idx, max_passes=k), full, kept)
    # usefulness: one pass per layer, 1 .. L
    full = interventions.usefulness_ratios(model, idx)
    kept = torch.zeros(L + 1, dtype=torch.bool)
    kept[1 : k + 1] = True
    same_or_nan(interventions.usefulness_ratios(model, idx, max_passes=k), full, kept)


def test_a_bound_past_the_passes_changes_nothing(model_and_sample):
    model, idx = model_and_sample
    torch.testing.assert_close(
        interventions.permutation_scores(model, idx, max_passes=100),
        interventions.permutation_scores(model, idx),
        rtol=0,
        atol=0,
        equal_nan=True,
    )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bound_that_is_not_a_positive_integer_is_refused(model_and_sample, bad):
    model, idx = model_and_sample
    with pytest.raises(ValueError, match="max_passes must be a positive integer"):
        interventions.usefulness_ratios(model, idx, max_passes=bad)
