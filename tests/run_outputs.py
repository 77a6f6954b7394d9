"""Checkpoints and run outputs written as training writes them, for the tests that damage, read or
report on them: checkpoint faults, file modes, summary checks, table stages, `depthbench status`;
and the tiny grid's run with fewer steps, the weights digest its summary records, and how far two
runs' final weights are apart, for the tests that train it."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from depthbench.spec.run import RunSpec
from depthbench.spec.schema import load_config
from depthbench.train.checkpoint import load_latest, save_checkpoint
from depthbench.train.recipe import RunPaths
from depthbench.train.runcheck import WEIGHTS_DIGEST
from tests.conftest import tiny_config


def step_state(step: int) -> dict:
    """A model state of 256 weights, each equal to `step`."""
    return {"model": {"w": torch.full((256,), float(step))}}


def save_step(folder: Path, step: int, run_id: str = "r", keep: int = 5) -> Path:
    """A checkpoint of step_state(step) at `step`, with a rank's RNG state; its folder."""
    return save_checkpoint(
        folder,
        step,
        run_id,
        step_state(step),
        {"last_val": float("nan")},
        rank_tensors={"torch": torch.get_rng_state()},
        keep=keep,
    )


def load_newest(folder: Path, run_id: str = "r", size: int = 256):
    """(step, loaded weights) of the checkpoint load_latest picks, or None."""
    template = {"model": {"w": torch.zeros(size)}}
    found = load_latest(folder, run_id, template)
    return None if found is None else (found.step, template["model"]["w"])


def fake_summary(results: Path, spec: RunSpec, status: str = "ok", **extra) -> Path:
    """A run's summary.json, metrics.jsonl and weights file under `results`/runs/; the summary's
    path. The summary names the run, its spec hash and its weights' digest, as training writes
    it."""
    run = results / "runs" / spec.run_id
    run.mkdir(parents=True, exist_ok=True)
    summary = {
        "run_id": spec.run_id,
        "status": status,
        "steps": 3,
        "total_steps": 10,
        "tokens_seen": 768,
        "final_val_loss": 5.0 if status == "ok" else math.nan,
        "wall_seconds": 1.0,
        "tokens_per_s": 768.0,
        "n_params": spec.shape.n_params,
        "device": "cpu",
        "world_size": 1,
        "spec": spec.to_dict(),
        "spec_hash": spec.spec_hash(),
        "weights_sha256": hashlib.sha256(b"weights").hexdigest(),
        **extra,
    }
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 2, "train_loss": 5.5, "val_loss": 5.4}) + "\n"
    )
    (run / "model.safetensors").write_bytes(b"weights")
    return run / "summary.json"


def grid_config(wiki_jsonl: Path, **kw) -> dict:
    """The validated tiny config on the corpus `wiki_jsonl`, with `kw` overriding its sections."""
    return load_config(tiny_config(wiki_jsonl, **kw))


def only_run(exp) -> RunSpec:
    """The one run of an expanded grid that has one."""
    (spec,) = exp.runs.values()
    return spec


def with_steps(spec: RunSpec, steps: int, **train_kw) -> RunSpec:
    """A copy of `spec` that trains `steps` steps, with `train_kw` set on its train section."""
    spec = copy.deepcopy(spec)
    spec.train.total_steps = steps
    for k, v in train_kw.items():
        setattr(spec.train, k, v)
    return spec


def weights_digest(paths: RunPaths) -> str:
    """The weights digest the run's summary records, after checking it is the file's."""
    digest = json.loads(paths.summary.read_text())[WEIGHTS_DIGEST]
    actual = hashlib.sha256(paths.weights.read_bytes()).hexdigest()
    assert digest == actual, f"the summary records {digest}, {paths.weights} hashes to {actual}"
    return digest


# Final weights of runs whose gradients sum in another order (another rank count, FSDP2's
# reduce-scatters) agree to a few ulps of the gradients, which AdamW turns into up to ~1e-6 of the
# weights wherever a gradient is next to zero (2 ranks against 1 with torch's unvectorised
# kernels: 1.7e-6; with its AVX2 or AVX-512 ones: 0); a wrong data split or a lost step moves them
# by the order of the tiny grid's learning rate (3e-3)
WEIGHT_TOLERANCE = 1e-5


def max_weight_diff(run_a: Path, run_b: Path) -> float:
    """The largest difference between two runs' final weights (model.safetensors)."""
    wa, wb = load_file(run_a / "model.safetensors"), load_file(run_b / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)
