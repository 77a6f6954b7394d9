"""Training: schedule, decay groups, exact resume after interruption, divergence."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.models.registry import build_model
from depthbench.models.moe import MoESwiGLU
from depthbench.models.registry import registered_architectures
from depthbench.train.checkpoint_folder import list_checkpoints
from depthbench.train.recipe import RunPaths, lr_at, param_groups
from depthbench.train.loop import train
from depthbench.util.errors import CheckpointError
from depthbench.train.trainer import Trainer
from depthbench.models.registry import PACKAGE_ARCHITECTURES
from tests.run_outputs import only_run, weights_digest, with_steps


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    lrs = [lr_at(s, 1.0, 100, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # cosine midpoint
    assert lr_at(100, 1.0, 100, 10, 0.1) == pytest.approx(0.1)


def test_weight_decay_applies_to_matrices_but_not_embeddings_or_gains(tiny_data):
    _, exp, _ = tiny_data
    model = build_model(only_run(exp).model)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert any(p is model.lm_head.weight for p in decay["params"])
    assert any(p is model.embed.weight for p in no_decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"] if p is not model.embed.weight)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_training_lowers_the_loss_and_writes_outputs(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 30, eval_every=10)
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    summary = train(spec, shards, paths, progress=False)
    assert summary["status"] == "ok" and summary["steps"] == 30
    records = [json.loads(line) for line in paths.curves.read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.3
    assert summary["final_val_loss"] == vals[-1]
    weights = load_file(paths.weights)
    assert set(weights) == set(build_model(spec.model).state_dict())
    assert json.loads(paths.summary.read_text())["run_id"] == spec.run_id


def _weights(path) -> dict[str, torch.Tensor]:
    return load_file(path)


def test_interrupted_run_resumes_to_identical_weights(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 12, checkpoint_every=100)
    full = RunPaths(tmp_path / "full", tmp_path / "full_work")
    train(spec, shards, full, progress=False)
    part = RunPaths(tmp_path / "part", tmp_path / "part_work")
    out = train(spec, shards, part, progress=False, stop_after=5)
    assert out["status"] == "interrupted" and list_checkpoints(part.checkpoints)[-1][0] == 5
    train(spec, shards, part, progress=False)
    a, b = _weights(full.weights), _weights(part.weights)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert full.curves.read_text().count("val_loss") == part.curves.read_text().count("val_loss")


# One resume case per registered architecture (fp32, the plain loss), and pre_ln with each setting
# that changes what a step computes or records: an MoE FFN (router, balance loss), bf16 autocast
# on the CPU, the loss in chunks (48 of the micro-batch's 128 tokens: two full chunks and a
# remainder) and the dynamics measured every 2 steps; bf16 also for hc and mhc, whose streams
# and mixing run with autocast paused.
RESUME_VARIANTS = {
    "moe": {"model": {"moe": {"n_experts": 4, "top_k": 2}}},
    "bf16": {"train": {"dtype": "bfloat16"}},
    "chunked_loss": {"train": {"loss_chunk_tokens": 48}},
    "dynamics": {"train": {"dynamics_every": 2}},
}
RESUME_CASES = [pytest.param(arch, None, id=arch) for arch in registered_architectures()] + [
    pytest.param(arch, variant, id=f"{arch}-{variant}")
    for arch, variant in [
        *(("pre_ln", v) for v in RESUME_VARIANTS),
        ("hc", "bf16"),
        ("mhc", "bf16"),
    ]
]


def _timeless(curve: str) -> list[dict]:
    """metrics.jsonl records without the throughput entries (wall-clock measurements)."""
    return [
        {
            k: v
            for k, v in json.loads(line).items()
            if k not in ("tokens_per_s", "mfu", "mfu_measured")
        }
        for line in curve.splitlines()
    ]


@pytest.mark.parametrize("arch, variant", RESUME_CASES)
def test_resumed_run_is_bit_identical_for_every_architecture_and_setting(
    tiny_data, tmp_path, monkeypatch, arch, variant
):
    """7 steps in one process against 4 steps, a stop, and a fresh train() call that restores the
    step-4 checkpoint into a new model and Trainer and runs steps 5-7 (the resume path of a
    requeued job): bitwise the same parameters and AdamW state (moments and step counts) after
    step 7, the same weights file and the same metrics.jsonl (train and validation losses,
    gradient norms, learning rates, dynamics). Catches any state a step depends on that the
    checkpoint does not carry or restore exactly (an architecture's buffers or parameters
    outside the state dict, optimizer moments, the RNG, the data position, the schedule)."""
    config, _, shards = tiny_data
    config = {**config, "architectures": [arch]}
    for section, values in RESUME_VARIANTS.get(variant, {}).items():
        config[section] = {**config[section], **values}
    spec = with_steps(
        only_run(expand_grid(load_config(config))), 7, checkpoint_every=3, eval_every=3, log_every=1
    )
    # per train() call: the trainer's step it started at, its model and optimizer state after fit
    ends = []
    fit = Trainer.fit

    def recording_fit(self, stop_after=None):
        fit(self, stop_after)
        ends.append(
            (
                self.start_step,
                self,
                copy.deepcopy(self.model.state_dict()),
                copy.deepcopy(self.optimizer.state_dict()),
            )
        )

    monkeypatch.setattr(Trainer, "fit", recording_fit)
    full = RunPaths(tmp_path / "full", tmp_path / "full_work")
    assert train(spec, shards, full, progress=False)["status"] == "ok"
    part = RunPaths(tmp_path / "part", tmp_path / "part_work")
    assert train(spec, shards, part, progress=False, stop_after=4)["status"] == "interrupted"
    assert train(spec, shards, part, progress=False)["status"] == "ok"
    (
        (start_full, trainer, model_full, optim_full),
        _,
        (start_resumed, resumed, model_resumed, optim_resumed),
    ) = ends
    assert (start_full, start_resumed) == (0, 4) and resumed is not trainer
    # the setting is in force where the step runs
    if variant == "bf16":
        assert (
            isinstance(resumed.autocast, torch.autocast)
            and resumed.autocast.fast_dtype == torch.bfloat16
        )
    if variant == "chunked_loss":
        assert (
            0 < resumed.model.loss_chunk_tokens < spec.train.micro_batch_size * spec.train.seq_len
        )
    if variant == "moe":
        assert any(isinstance(b.ffn, MoESwiGLU) for b in resumed.model.blocks)
    assert model_full.keys() == model_resumed.keys()
    for name in model_full:
        assert torch.equal(model_full[name], model_resumed[name]), name
    assert optim_full["param_groups"] == optim_resumed["param_groups"]
    assert optim_full["state"].keys() == optim_resumed["state"].keys() and optim_full["state"]
    for index, state in optim_full["state"].items():
        assert state.keys() == optim_resumed["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(value, optim_resumed["state"][index][key]), (index, key)
    a, b = _weights(full.weights), _weights(part.weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and so are the published files, byte for byte, and the digests their summaries record
    assert full.weights.read_bytes() == part.weights.read_bytes()
    assert weights_digest(full) == weights_digest(part)
    curve_full, curve_resumed = (
        _timeless(full.curves.read_text()),
        _timeless(part.curves.read_text()),
    )
    assert [r["step"] for r in curve_full] == list(range(1, 8))
    assert [r["step"] for r in curve_full if "val_loss" in r] == [3, 6, 7]
    if variant == "dynamics":  # measured before updates 0, 2, 4 (the resumed process's first) and 6
        assert [r["step"] for r in curve_full if "dynamics" in r] == [1, 3, 5, 7]
    assert curve_full == curve_resumed


def test_absurd_learning_rate_is_recorded_as_diverged(tiny_data, tmp_path):
    config, _, shards = tiny_data
    exp = expand_grid(load_config({**config, "learning_rates": [50.0]}))
    spec = with_steps(only_run(exp), 30)
    summary = train(spec, shards, RunPaths(tmp_path / "run", tmp_path / "work"), progress=False)
    assert summary["status"] == "diverged"
    assert summary["steps"] < 30
    assert summary["final_val_loss"] != summary["final_val_loss"]  # NaN
    assert (tmp_path / "run" / "model.safetensors").exists()


def test_checkpoint_of_another_run_is_refused(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 6, checkpoint_every=2)
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    train(spec, shards, paths, progress=False, stop_after=3)
    other = copy.deepcopy(spec)
    other.run_id = "someone_else"
    with pytest.raises(CheckpointError, match="belongs to run"):
        train(other, shards, paths, progress=False)


ALL_ARCHS = list(PACKAGE_ARCHITECTURES)  # every architecture of the package


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_every_architecture_trains_in_the_workflow_machinery(tiny_data, tmp_path, arch):
    config, _, shards = tiny_data
    exp = expand_grid(load_config({**config, "architectures": [arch]}))
    spec = with_steps(only_run(exp), 16, eval_every=8, warmup_fraction=0.0)
    summary = train(spec, shards, RunPaths(tmp_path / "run", tmp_path / "work"), progress=False)
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert summary["status"] == "ok" and vals[-1] < vals[0]


def test_moe_knob_trains_with_its_balance_loss(tiny_data, tmp_path):
    config, _, shards = tiny_data
    exp = expand_grid(
        load_config({**config, "model": {**config["model"], "moe": {"n_experts": 4, "top_k": 2}}})
    )
    spec = with_steps(only_run(exp), 8)
    # the budget fixes total parameters: with 4 experts the solver picks a narrower model
    dense = only_run(expand_grid(load_config(config)))
    assert spec.shape.d_model < dense.shape.d_model
    summary = train(spec, shards, RunPaths(tmp_path / "run", tmp_path / "work"), progress=False)
    assert summary["status"] == "ok"


def test_hc_static_weights_and_pseudo_queries_are_not_decayed(tiny_data):
    from depthbench.models.config import ModelConfig

    for arch, names in (
        ("hc", ("static_mix", "static_read", "static_write")),
        ("attnres_full", ("query",)),
        ("mhc", ("b_res", "gains")),
    ):
        model = build_model(
            ModelConfig(arch=arch, vocab_size=50, d_model=32, n_layer=2, n_head=4, max_seq_len=8)
        )
        decay, no_decay = param_groups(model, 0.1)
        no_decay_ids = {id(p) for p in no_decay["params"]}
        for name, p in model.named_parameters():
            if name.split(".")[-1] in names:
                assert id(p) in no_decay_ids, name


def test_dynamics_logging_leaves_training_unchanged_and_matches_backward(tiny_data, tmp_path):
    from depthbench.data.loader import TokenWindows, TrainBatches
    from depthbench.data.shards import read_meta
    from depthbench.analysis.tables import dynamics_rows

    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 8)
    on = with_steps(spec, 8, dynamics_every=2)
    a = RunPaths(tmp_path / "off", tmp_path / "off_work")
    b = RunPaths(tmp_path / "on", tmp_path / "on_work")
    train(spec, shards, a, progress=False)
    train(on, shards, b, progress=False)
    wa, wb = load_file(a.weights), load_file(b.weights)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    dyn = dynamics_rows([on.run_id], [b.curves])
    assert sorted(dyn.step.unique()) == [0, 2, 4, 6]
    L = on.model.n_layer
    first = dyn[dyn.step == 0]
    assert len(first[first.quantity == "residual_rms"]) == L + 1
    assert len(first[first.quantity == "param_grad_norm"]) == L
    assert (first[first.quantity == "grad_norm_h"].value > 0).all()
    assert set(first[first.quantity == "norm_factor"].name) >= {"blocks.0.attn_norm", "final_norm"}
    # the per-layer parameter gradient norm at step 0 is that of a plain backward at init
    torch.manual_seed(on.train.seed)
    model = build_model(on.model)
    meta = read_meta(shards)
    windows = TokenWindows([str(shards / "train.bin")], meta["dtype"], on.train.seq_len)
    x, y = TrainBatches(
        windows, on.train.seed, on.train.global_batch_size, on.train.micro_batch_size
    ).get(0, 0)
    model(x, y).loss.backward()
    for l, block in enumerate(model.blocks, start=1):
        expected = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in block.parameters()])
        )
        got = first[(first.quantity == "param_grad_norm") & (first["index"] == l)].value.item()
        assert got == pytest.approx(expected.item(), rel=1e-5)
