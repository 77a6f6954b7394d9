"""AttnRes's depth state resumed by the probes (DepthSources.fork through the model adapter's
`step`): a pass resumed after a later reader's pseudo-query or key-norm gain changed in place
mixes with the new queries, and one resumed with nothing changed keeps the pending logits it
computed; the model's key (AttnResFull.reader_key) tells the two apart without reading a
value."""

from __future__ import annotations

import pytest
import torch

from depthbench.models.archs.attnres_sources import same_key
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model


def _model(arch: str):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=64, d_model=32, n_layer=3, n_head=4, max_seq_len=16)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _resumed_logits(model, idx, change=None):
    """Logits of a pass stepped layer by layer, `change` applied after layer 1."""
    state = model.step(model.begin(idx), 1)
    if change is not None:
        change()
    for layer in (2, 3):
        state = model.step(state, layer)
    return model.logits(state)


@pytest.mark.parametrize("arch", ["attnres_full", "attnres_block"])
@pytest.mark.parametrize("part", ["query", "gain"])
def test_a_pass_resumed_after_a_pseudo_query_changes_mixes_with_the_new_one(arch, part):
    model, idx = _model(arch), torch.randint(0, 64, (2, 9))
    depth = model.blocks[2].attn_depth
    target = depth.query if part == "query" else depth.key_norm.weight
    with torch.no_grad():
        before = model(idx).logits
        torch.testing.assert_close(_resumed_logits(model, idx), before)

        def change():
            target.mul_(-3.0)

        after = _resumed_logits(model, idx, change)
        torch.testing.assert_close(after, model(idx).logits)  # the changed model's own pass
        assert not torch.allclose(after, before)


def test_keys_compare_parameters_by_identity_and_version():
    model = _model("attnres_full")
    key = model.reader_key()
    assert same_key(key, model.reader_key())
    with torch.no_grad():
        model.final_depth.query.add_(0.0)  # in place: a new version, even with the same values
    assert not same_key(key, model.reader_key())
    other = _model("attnres_full")  # equal values, other parameters
    assert not same_key(other.reader_key(), model.reader_key())
