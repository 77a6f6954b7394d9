"""Sharded checkpoint folders (depthbench.train.checkpoint) in one process: what they hold, what a
resume may not silently do. Faults and crafted files: tests/unit/test_checkpoint_faults.py;
several ranks and strategies: tests/integration/test_distributed.py; the requeue signal:
tests/integration/test_requeue.py."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from depthbench.util.errors import CheckpointError
from depthbench.train.checkpoint import load_latest, save_checkpoint
from depthbench.train.checkpoint_folder import list_checkpoints


def _tensors(value: float) -> dict:
    return {
        "model": {"a.weight": torch.full((3, 4), value)},
        "optim": {"a.weight": {"step": torch.tensor(7.0), "exp_avg": torch.full((3, 4), -value)}},
    }


def test_a_checkpoint_holds_the_tensors_the_rank_state_and_the_json_meta(tmp_path):
    rng = torch.get_rng_state()
    path = save_checkpoint(
        tmp_path,
        3,
        "r",
        _tensors(1.5),
        {"wall_seconds": 2.5, "betas": (0.9, 0.95)},
        rank_tensors={"torch": rng},
    )
    state = json.loads((path / "state.json").read_text())
    assert state["step"] == 3 and state["run_id"] == "r" and state["world_size"] == 1
    assert state["meta"] == {"wall_seconds": 2.5, "betas": [0.9, 0.95]}
    for name, digest in state[
        "files"
    ].items():  # recomputed here, independently of the code under test
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest, name
    assert torch.equal(load_file(path / "rank_0.safetensors")["torch"], rng)
    template = {
        "model": {"a.weight": torch.zeros(3, 4)},
        "optim": {"a.weight": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3, 4)}},
    }
    found = load_latest(tmp_path, "r", template)
    assert (
        found.step == 3
        and found.meta["wall_seconds"] == 2.5
        and torch.equal(found.rank_tensors["torch"], rng)
    )
    assert torch.equal(template["model"]["a.weight"], torch.full((3, 4), 1.5))
    assert template["optim"]["a.weight"]["step"].item() == 7.0
    assert torch.equal(template["optim"]["a.weight"]["exp_avg"], torch.full((3, 4), -1.5))


def test_the_same_step_saved_again_replaces_the_old_folder(tmp_path):
    save_checkpoint(tmp_path, 2, "r", _tensors(1.0))
    save_checkpoint(tmp_path, 2, "r", _tensors(4.0))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2] and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["step_00000002"]
    template = _tensors(0.0)
    load_latest(tmp_path, "r", template)
    assert torch.equal(template["model"]["a.weight"], torch.full((3, 4), 4.0))


def test_a_checkpoint_of_another_model_is_an_error_not_a_silent_restart(tmp_path):
    save_checkpoint(tmp_path, 2, "r", _tensors(1.0))
    with pytest.raises(
        CheckpointError, match=r"does not fit this run's model.*Size mismatch.*a\.weight"
    ):
        load_latest(tmp_path, "r", {"model": {"a.weight": torch.zeros(5, 4)}})
    with pytest.raises(CheckpointError, match=r"does not fit this run's model.*b\.weight"):
        load_latest(tmp_path, "r", {"model": {"b.weight": torch.zeros(3, 4)}})


def test_meta_that_is_not_json_is_refused_at_the_call(tmp_path):
    with pytest.raises(CheckpointError, match="must be JSON"):
        save_checkpoint(tmp_path, 1, "r", _tensors(1.0), {"lr": torch.tensor(0.1)})
    assert list_checkpoints(tmp_path) == []


def test_a_fresh_run_starts_adamw_at_step_zero_as_plain_pytorch_does(tmp_path):
    """Looking for a checkpoint builds DCP's state-dict template, which fills an empty AdamW state
    by an lr-0 step; with no checkpoint found the state must be empty again, or the run's first
    update uses the bias correction of step 2 (found when a restart from step 0 differed)."""
    from types import SimpleNamespace

    from depthbench.train import resume
    from depthbench.train.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = SimpleNamespace(
        model=model,
        optimizer=opt,
        checkpointer=Checkpointer(tmp_path),
        spec=SimpleNamespace(run_id="r"),
    )
    assert resume.restore(trainer) is False and not opt.state
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    for net, o in ((model, opt), (reference, ref_opt)):
        net(x).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert opt.state[model.weight]["step"].item() == 1.0
