"""The rehearsal's checkpoint round trip: save a trainer's state through its checkpointer, scramble
it, resume, and compare fingerprints (a digest per tensor of the model and optimizer state), so a
shape that cannot restore its own checkpoint is caught before a cluster runs it."""

from __future__ import annotations

import hashlib
import json
import time

import torch

from depthbench.train.checkpoint_folder import list_checkpoints


def save_state(trainer) -> None:
    trainer.snapshot()


def resume_state(trainer) -> bool:
    return trainer.restore()


def _digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().data)
    return h.hexdigest()


def state_fingerprint(trainer) -> dict[str, str]:
    """SHA-256 of every tensor the trainer resumes from, by name, plus the step."""
    prints = {f"model.{k}": _digest(v) for k, v in trainer.model.state_dict().items()}
    optim = trainer.optimizer.state_dict()
    for i, state in optim["state"].items():
        for k, v in state.items():
            prints[f"optimizer.{i}.{k}"] = _digest(v) if isinstance(v, torch.Tensor) else repr(v)
    # as JSON: the hyperparameters' values, not their containers (a resume returns betas as a list)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]]
    prints["optimizer.param_groups"] = json.dumps(groups, sort_keys=True, default=repr)
    prints["rng"] = _digest(torch.get_rng_state())
    prints["step"] = str(trainer.step)
    return prints


@torch.no_grad()
def _overwrite(trainer) -> None:
    """Destroy the live state so that a resume which loads nothing cannot pass the check."""
    for v in trainer.model.state_dict().values():
        if v.is_floating_point():
            v.zero_()
    for state in trainer.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.zero_()
    torch.manual_seed(12345)
    trainer.step = 0


def checkpoint_roundtrip(trainer) -> dict:
    """Save, overwrite, resume; the entries whose fingerprint changed (none when it works)."""
    before = state_fingerprint(trainer)
    t0 = time.time()
    save_state(trainer)
    # a checkpoint is a folder of per-rank parts (depthbench.train.checkpoint_folder): its bytes
    # are theirs
    saved = sum(
        f.stat().st_size
        for _, folder in list_checkpoints(trainer.paths.checkpoints)
        for f in folder.iterdir()
    )
    t1 = time.time()
    _overwrite(trainer)
    loaded = resume_state(trainer)
    after = state_fingerprint(trainer)
    diff = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return {
        "resume_equal": loaded and not diff,
        "resume_mismatch": diff[:5],
        "checkpoint_bytes": saved,
        "save_s": round(t1 - t0, 1),
        "resume_s": round(time.time() - t1, 1),
    }
