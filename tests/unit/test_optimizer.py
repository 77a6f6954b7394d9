"""depthbench.train.optimizer.AdamW is torch.optim.AdamW, update for update, and a training job
that uses it does not import torch._dynamo (1.2-1.6 s of every short job)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from depthbench.train.optimizer import AdamW
from tests.conftest import REPO


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


@pytest.mark.slow
def test_training_every_architecture_imports_no_dynamo(tiny_data, tmp_path):
    """In a fresh interpreter, as a Snakemake job runs it: a few steps of every registered
    architecture (no checkpoint inside them) leave torch._dynamo unimported."""
    import depthbench.models.archs  # noqa: F401  (registers every architecture)
    from depthbench.grid.config import expand_grid
    from depthbench.models.registry import ARCHITECTURES
    from depthbench.spec.schema import load_config

    config, _, shards = tiny_data
    specs = {}
    for arch in ARCHITECTURES:
        (spec,) = expand_grid(load_config({**config, "architectures": [arch]})).runs.values()
        spec_dict = spec.to_dict()
        spec_dict["train"].update(total_steps=3, checkpoint_every=100, eval_every=100)
        specs[arch] = spec_dict
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    code = (
        "import json, sys\n"
        "from depthbench.spec.run import RunSpec\n"
        "from depthbench.train.loop import train\n"
        "from depthbench.train.recipe import RunPaths\n"
        "specs = json.load(open(sys.argv[1]))\n"
        "out = {}\n"
        "for arch, spec in specs.items():\n"
        "    root = sys.argv[3] + '/' + arch\n"
        "    summary = train(RunSpec.from_dict(spec), sys.argv[2], RunPaths(root + '/run', "
        "root + '/work'), progress=False)\n"
        "    out[arch] = [summary['status'], 'torch._dynamo' in sys.modules]\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "specs.json"), str(shards), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == set(ARCHITECTURES)
    assert all(status == "ok" for status, _ in result.values()), result
    # in order: the first architecture whose training pulled torch._dynamo in is named
    with_dynamo = [arch for arch, (_, imported) in result.items() if imported]
    assert not with_dynamo, f"torch._dynamo imported while training {with_dynamo[0]}"
