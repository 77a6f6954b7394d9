"""The logit lens (depthbench.probes.lens) against computations that do not share its code: the
models' own forward passes, and transformers' own forward for pretrained families."""

from __future__ import annotations

import math

import pytest
import torch

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model, registered_architectures
from depthbench.probes import lens
from depthbench.probes.measure import probe_model
from depthbench.probes.run import probe_settings

V = 64


def perturbed(arch: str, n_layer: int = 3) -> torch.nn.Module:
    """A small model whose weights are moved off their initialisation (zero-initialised mixing
    weights, gates and scales then take part), in float32, eval mode."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(arch=arch, vocab_size=V, n_layer=n_layer, d_model=32, n_head=2, max_seq_len=16)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def sample(n: int = 3, t: int = 13, vocab: int = V, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def by_hand(per_layer_logits: list[torch.Tensor], targets: torch.Tensor) -> dict[str, list[float]]:
    """Cross-entropy, KL(final || layer) and top-1 agreement written out per position, in
    float64."""
    final = per_layer_logits[-1].double().reshape(-1, per_layer_logits[-1].shape[-1])
    out = {"lens_cross_entropy": [], "lens_kl_to_final": [], "lens_top1_agreement": []}
    flat_targets = targets.reshape(-1).tolist()
    for z in per_layer_logits:
        z = z.double().reshape(-1, z.shape[-1])
        ce = kl = agree = 0.0
        for row, final_row, target in zip(z, final, flat_targets):
            logp = row - torch.logsumexp(row, 0)
            final_logp = final_row - torch.logsumexp(final_row, 0)
            ce -= float(logp[target])
            kl += float((final_logp.exp() * (final_logp - logp)).sum())
            agree += float(int(row.argmax()) == int(final_row.argmax()))
        n = len(flat_targets)
        out["lens_cross_entropy"].append(ce / n)
        out["lens_kl_to_final"].append(kl / n)
        out["lens_top1_agreement"].append(agree / n)
    return out


@pytest.mark.parametrize("arch", registered_architectures())
def test_lens_at_the_last_layer_is_the_models_own_output(arch):
    """For every architecture the lens curve ends at the model's own cross-entropy (its forward
    pass, not the adapter's fold), with KL 0 and full top-1 agreement at l = L."""
    model = perturbed(arch)
    idx = sample()
    got = lens.logit_lens(model, idx)
    with torch.no_grad():
        own = model(idx[:, :-1]).logits.float()
    own_ce = float(torch.nn.functional.cross_entropy(own.reshape(-1, V), idx[:, 1:].reshape(-1)))
    assert got["lens_cross_entropy"].shape == (model.n_layer + 1,)
    assert math.isclose(float(got["lens_cross_entropy"][-1]), own_ce, rel_tol=1e-5)
    assert (
        abs(float(got["lens_kl_to_final"][-1])) < 1e-6
        and float(got["lens_top1_agreement"][-1]) == 1.0
    )
    assert float(got["lens_kl_to_final"][0]) > 1e-4  # the embedding's prediction is not the model's


def test_lens_equals_the_norm_and_head_on_the_models_hidden_states():
    """pre_ln: the lens at every layer equals the final norm and LM head applied by hand to the
    hidden states the model's forward returns, scored by the per-position code above."""
    model = perturbed("pre_ln", n_layer=4)
    idx = sample()
    with torch.no_grad():
        hidden = model(idx[:, :-1], return_hidden=True).hidden
        per_layer = [model.lm_head(model.final_norm(h)) for h in hidden]
    expected = by_hand(per_layer, idx[:, 1:])
    got = lens.logit_lens(model, idx)
    for name, values in expected.items():
        torch.testing.assert_close(
            got[name].double(), torch.tensor(values, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )


class PostNormLens(torch.nn.Module):
    """An adapter whose residual is the final norm's output (the hidden_states[-1] trap): the lens
    then applies the norm twice, and the self-check must refuse it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    def residual(self, state):
        return self.model.final_norm(self.model.residual(state))


def test_self_check_refuses_a_lens_that_reads_the_post_norm_state():
    model = perturbed("pre_ln")
    with torch.no_grad():  # a non-unit norm gain, so that norming twice changes the logits
        model.final_norm.weight.mul_(3.0)
    with pytest.raises(RuntimeError, match="logit lens at the last layer differs"):
        lens.logit_lens(PostNormLens(model), sample())


def test_probe_rows_carry_the_lens_per_layer():
    model = perturbed("hc")
    rows = probe_model(model, sample(), "trained", probe_settings({}), full=True)
    for name in ("lens_cross_entropy", "lens_kl_to_final", "lens_top1_agreement"):
        layers = sorted(r["i"] for r in rows if r["probe"] == name)
        assert layers == list(range(model.n_layer + 1)), name


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "olmo2", "gpt_neox", "gemma2", "gemma3"]
)
def test_lens_of_pretrained_families_ends_at_transformers_logits(family):
    """Every supported family: the lens at l = L equals transformers' own logits (final norm,
    head and Gemma's soft cap as *ForCausalLM.forward applies them), and its l < L entries are the
    norm and head on transformers' hidden_states[l] for l < L (those are pre-norm for l < L)."""
    from depthbench.pretrained.adapter import PretrainedAdapter
    from tests.unit.test_pretrained import V as HF_V
    from tests.unit.test_pretrained import tiny_model

    model = tiny_model(family)
    adapter = PretrainedAdapter(model)
    idx = sample(n=2, t=10, vocab=HF_V)
    got = lens.logit_lens(adapter, idx)
    with torch.no_grad():
        out = model(input_ids=idx[:, :-1], output_hidden_states=True, use_cache=False)
    own_ce = float(
        torch.nn.functional.cross_entropy(
            out.logits.float().reshape(-1, HF_V), idx[:, 1:].reshape(-1)
        )
    )
    assert math.isclose(float(got["lens_cross_entropy"][-1]), own_ce, rel_tol=1e-5)
    norm, head = adapter.family.parts(model)[2:]
    with torch.no_grad():
        first = head(norm(out.hidden_states[0])).float()
    cap = getattr(model.config, "final_logit_softcapping", None) if adapter.family.softcap else None
    if cap:
        first = torch.tanh(first / cap) * cap
    first_ce = float(
        torch.nn.functional.cross_entropy(first.reshape(-1, HF_V), idx[:, 1:].reshape(-1))
    )
    assert math.isclose(float(got["lens_cross_entropy"][0]), first_ce, rel_tol=1e-5)


def test_lens_table_has_one_row_per_run_and_layer_with_the_three_scores():
    from depthbench.analysis.stage_tables import lens_table
    from tests.analysis_tables import synthetic_tables

    probes = synthetic_tables(archs=("pre_ln", "hc"), depths=(2, 4))["probes"]
    table = lens_table(probes)
    trained = probes[(probes["stage"] == "trained") & (probes["probe"] == "lens_cross_entropy")]
    assert len(table) == len(trained) and set(table["run_id"]) == set(trained["run_id"])
    for run_id, g in table.groupby("run_id"):
        L = int(g["n_layer"].iloc[0])
        assert list(g["layer"]) == list(range(L + 1))
        assert g["top1_agreement"].tolist() == [l / L for l in range(L + 1)]  # the synthetic lens
        assert g["cross_entropy"].notna().all() and g["kl_to_final"].notna().all()


def test_lens_table_of_many_runs_with_distinct_config_columns_stays_small():
    """A pivot over every config column forms their product (18 runs of the default asked for
    18.6 GiB); the table pivots on (run, layer) alone. Here 40 runs differ in 10 columns: a
    product over them has 40^11 rows."""
    import pandas as pd

    from depthbench.analysis.stage_tables import lens_table

    rows = []
    for r in range(40):
        config = {f"c{c}": float(r * 10 + c) for c in range(10)}
        for layer in range(3):
            for probe, value in (
                ("lens_cross_entropy", 5.0 - layer),
                ("lens_kl_to_final", 2.0 - layer),
                ("lens_top1_agreement", layer / 2),
            ):
                rows.append(
                    {
                        "run_id": f"run{r}",
                        "probe": probe,
                        "stage": "trained",
                        "i": layer,
                        "j": -1,
                        "value": value,
                        **config,
                    }
                )
    table = lens_table(pd.DataFrame(rows))
    assert len(table) == 40 * 3 and table.groupby("run_id")["c3"].nunique().eq(1).all()
    assert table.loc[table["layer"] == 2, "top1_agreement"].eq(1.0).all()
