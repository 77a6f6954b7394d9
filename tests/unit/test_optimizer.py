"""depthbench.train.optimizer.AdamW is torch.optim.AdamW, update for update, and its step records
no autograd graph."""

from __future__ import annotations

import pytest
import torch

from depthbench.train.optimizer import AdamW


def _model_and_groups(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )
    groups = [
        {"params": [model[0].weight, model[3].weight], "weight_decay": 0.1},
        {"params": [model[0].bias, model[1].weight, model[1].bias, model[3].bias]},
    ]
    return model, groups


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for_loop"])
def test_updates_and_state_equal_torchs_adamw_bit_for_bit(fused):
    """Two groups (one with decay, one with the default 0.01 filled in by add_param_group), the LR
    changed before every step as the schedule does, and gradients zeroed to None: weights, moments
    and step counters equal torch.optim.AdamW's after every step, and so does the state_dict a
    checkpoint would save."""
    ours_model, ours_groups = _model_and_groups(0)
    ref_model, ref_groups = _model_and_groups(0)
    kwargs = dict(
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused, foreach=False if not fused else None
    )
    ours, ref = AdamW(ours_groups, **kwargs), torch.optim.AdamW(ref_groups, **kwargs)
    assert [g["weight_decay"] for g in ours.param_groups] == [0.1, 0.01]
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for step in range(6):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (step + 1) / 6
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert all(p.grad is None for p in model.parameters())
        for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(a, b), step
    ours_state, ref_state = ours.state_dict(), ref.state_dict()
    assert ours_state["param_groups"] == ref_state["param_groups"]
    for i, state in ref_state["state"].items():
        assert state.keys() == ours_state["state"][i].keys()
        assert all(torch.equal(v, ours_state["state"][i][k]) for k, v in state.items())


def test_the_step_runs_without_recording_autograd():
    model, groups = _model_and_groups(0)
    opt = AdamW(groups, lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert all(p.grad_fn is None and p.is_leaf for p in model.parameters())
