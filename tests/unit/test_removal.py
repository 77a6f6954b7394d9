"""Layer removal (depthbench.probes.removal): the rankings on hand-made inputs, the removal pass
against models with the layers really taken out (ours and transformers' own), effective depth."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import torch

from depthbench.models.registry import registered_architectures
from depthbench.models.adapter import next_token_loss, trunk_states
from depthbench.probes import core, interventions, removal
from depthbench.probes.effective_depth import effective_fraction
from tests.unit.test_logit_lens import perturbed, sample


def test_angular_block_keeps_the_final_layer_and_picks_the_closest_block():
    L = 5
    D = torch.full((L + 1, L + 1), 0.5)
    D[3, 2] = 0.01  # h_3 -> h_5 is closest, but layer 5 is the final one: not allowed
    D[1, 2] = 0.02  # h_1 -> h_3: layers 2, 3
    assert removal.angular_block(D, L, 2) == [2, 3]
    assert all(max(removal.angular_block(D, L, k)) <= L - 1 for k in range(1, L))


def test_block_influence_is_one_minus_the_mean_cosine():
    h0 = torch.tensor([[[1.0, 0.0]]])
    h1 = torch.tensor([[[0.0, 1.0]]])  # orthogonal: BI 1
    h2 = torch.tensor([[[0.0, 2.0]]])  # same direction: BI 0
    assert torch.allclose(
        removal.block_influence([h0, h1, h2]), torch.tensor([1.0, 0.0], dtype=torch.float64)
    )


def test_removal_sets_cover_every_ranking_and_k_and_random_is_seeded():
    model = perturbed("pre_ln", n_layer=4)
    idx = sample()
    hidden = core.residual_stream(model, idx[:, :-1])
    D = core.angular_distance(hidden, last_token_only=True)
    C = interventions.causal_scores(model, idx[:, :-1])
    bi = removal.block_influence(hidden)
    sets = removal.removal_sets(bi, D, C, 4, [1, 2, 3], seed=0)
    assert {(r, k) for r, _, k, _ in sets} == {(r, k) for r in removal.RANKINGS for k in (1, 2, 3)}
    assert all(len(layers) == k and len(set(layers)) == k for _, _, k, layers in sets)
    assert [s for s in sets if s[0] == "last" and s[2] == 2][0][3] == [2, 3]
    assert sets == removal.removal_sets(bi, D, C, 4, [1, 2, 3], seed=0)
    assert all(
        4 not in layers for r, _, _, layers in sets if r in ("angular_block", "causal", "last")
    )


@pytest.mark.parametrize("arch", registered_architectures())
def test_resumed_removal_pass_equals_the_pass_from_the_start(arch):
    """The pass resumed at the first removed layer equals the whole pass with the same layers
    skipped, for every architecture (the states before the first removed layer are unchanged)."""
    model = perturbed(arch, n_layer=4)
    idx = sample()
    states = trunk_states(model, idx[:, :-1])
    for removed in ([2], [2, 4], [1, 3]):
        with torch.no_grad():  # as the removal pass runs
            state = model.begin(idx[:, :-1])
            for layer in range(1, 5):
                state = model.skip(state, layer) if layer in removed else model.step(state, layer)
            whole = next_token_loss(model, state, idx[:, 1:])
        got = removal.loss_without(model, states, removal.ScoredTokens.windows(idx), removed)
        assert math.isclose(got, whole, rel_tol=1e-6), removed


def test_removal_pass_equals_pre_ln_with_the_blocks_taken_out():
    """pre_ln without layers 2 and 3 is the model whose block list lacks them."""
    model = perturbed("pre_ln", n_layer=4)
    idx = sample()
    got = removal.loss_without(
        model, trunk_states(model, idx[:, :-1]), removal.ScoredTokens.windows(idx), [2, 3]
    )
    shorter = copy.deepcopy(model)
    shorter.blocks = torch.nn.ModuleList(
        [b for i, b in enumerate(model.blocks, start=1) if i not in (2, 3)]
    )
    with torch.no_grad():
        expected = float(
            torch.nn.functional.cross_entropy(
                shorter(idx[:, :-1]).logits.reshape(-1, 64), idx[:, 1:].reshape(-1)
            )
        )
    assert math.isclose(got, expected, rel_tol=1e-6)


def test_document_scoring_equals_the_nll_stage():
    """ScoredTokens.documents scores what the NLL stage scores: the same summed NLL over the
    continuations (evals.nll.score_documents on the model's own forward)."""
    from depthbench.evals.nll import score_documents

    model = perturbed("pre_ln")
    g = torch.Generator().manual_seed(3)
    docs = pd.DataFrame(
        {
            "set": "s",
            "domain": "code",
            "doc_id": range(4),
            "n_bytes": 10,
            "context_ids": [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 9, 1, 5)],
            "continuation_ids": [
                torch.randint(0, 64, (n,), generator=g).tolist() for n in (4, 12, 6, 2)
            ],
        }
    )
    docs["n_tokens"] = docs["continuation_ids"].map(len)
    scored = removal.ScoredTokens.documents(docs, window=8)
    states = trunk_states(model, scored.inputs)
    got = removal.loss_without(model, states, scored, [])
    expected = score_documents(model, docs, 8, 10_000, "cpu")
    assert math.isclose(got, expected["nll"].sum() / docs["n_tokens"].sum(), rel_tol=1e-5)


def test_effective_fraction_stops_at_the_first_k_over_the_tolerance():
    curve = {1: 2.02, 2: 2.12, 3: 2.04, 4: 3.0}
    assert effective_fraction(curve, 2.0, 8, 0.05) == 1 / 8  # k = 2 breaks it; k = 3 does not count
    assert effective_fraction(curve, 2.0, 8, 0.10) == 3 / 8  # 2.2: all of k <= 3 within
    assert effective_fraction({1: 2.5}, 2.0, 8, 0.05) == 0.0
    assert removal.layer_counts(8, None) == list(range(1, 8))
    assert removal.layer_counts(30, [0.1, 0.25, 0.5, 0.99]) == [3, 8, 15, 29]


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "olmo2", "gpt_neox", "gemma2", "gemma3"]
)
def test_removal_of_pretrained_layers_equals_transformers_without_them(family):
    """Every supported family: the adapter's removal pass equals transformers' own forward of the
    model whose decoder-layer list lacks the removed layers (written here, sharing no code)."""
    from depthbench.pretrained.adapter import PretrainedAdapter
    from tests.unit.test_pretrained import V as HF_V
    from tests.unit.test_pretrained import tiny_model

    model = tiny_model(family)
    adapter = PretrainedAdapter(model)
    idx = sample(n=2, t=10, vocab=HF_V)
    states = trunk_states(adapter, idx[:, :-1])
    for removed in ([2], [1, 3]):
        got = removal.loss_without(adapter, states, removal.ScoredTokens.windows(idx), removed)
        pruned = copy.deepcopy(model)
        base = pruned.gpt_neox if family == "gpt_neox" else pruned.model
        keep = [i for i in range(len(base.layers)) if i + 1 not in removed]
        base.layers = torch.nn.ModuleList([base.layers[i] for i in keep])
        pruned.config.num_hidden_layers = len(keep)
        if getattr(pruned.config, "layer_types", None):
            pruned.config.layer_types = [pruned.config.layer_types[i] for i in keep]
        with torch.no_grad():
            logits = pruned(input_ids=idx[:, :-1], use_cache=False).logits.float()
        expected = float(
            torch.nn.functional.cross_entropy(logits.reshape(-1, HF_V), idx[:, 1:].reshape(-1))
        )
        assert math.isclose(got, expected, rel_tol=1e-5), (family, removed)


def test_layer_profile_takes_each_models_numbers_from_the_tables():
    from depthbench.analysis.profile import layer_profile, layer_profile_html
    from depthbench.probes.effective_depth import effective_depth
    from depthbench.analysis.stage_tables import with_run_columns
    from tests.analysis_tables import synthetic_tables

    t = synthetic_tables(archs=("pre_ln", "hc"), depths=(4, 8))
    depth = with_run_columns(
        effective_depth(t["removal"].drop(columns=["status"]).assign(status="ok"), 0.05),
        t["runs"],
        t["best_lr"],
    )
    profile = layer_profile(t["probes"], depth)
    assert len(profile) == 4 and list(profile["arch"]) == ["pre_ln", "pre_ln", "hc", "hc"]
    # synthetic curves: change = (k/L)^2 (pre_ln) or 2 (k/L)^2, so within 5%: k/L <= sqrt(0.05)
    # or sqrt(0.025)
    row = profile[(profile["arch"] == "pre_ln") & (profile["n_layer"] == 8)].iloc[0]
    assert row["removable"] == 1 / 8 and row["causal_share"] == 0.05
    assert row["lens_half_agreement"] == 0.5  # the synthetic lens agreement is l / L
    assert (
        profile[(profile["arch"] == "hc") & (profile["n_layer"] == 8)]["removable"].iloc[0] == 1 / 8
    )
    assert "removable (5% tol.)" in layer_profile_html(profile, 0.05)
