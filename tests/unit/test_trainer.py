"""The trainer's hooks, each alone on a stand-in trainer, the hook order of a real run, and the
peak table and MFU per rank (mocked device names)."""

import json
import math

import pytest
import torch

from depthbench.train import flops, hooks, tracking
from depthbench.train.hook_base import Hook
from depthbench.train.trainer import STATUS_DIVERGED, STATUS_OK, StepStats


class FakeTrainer:
    """The attributes hooks read, and a record of what they ask the trainer to do."""

    def __init__(self, step=0, start_step=0):
        self.step, self.start_step, self.status, self.last_val = (
            step,
            start_step,
            STATUS_OK,
            float("nan"),
        )
        self.stats = StepStats(train_loss=2.5, grad_norm=0.75, lr=1e-3)
        self.logged, self.snapshots = [], []
        self.model, self.device, self.autocast = None, torch.device("cpu"), None

    def log(self, record):
        self.logged.append(record)

    def snapshot(self, blocking=False):
        self.snapshots.append(self.step)
        self.blocking = blocking


def test_train_metrics_hook_logs_on_schedule_with_throughput_and_mfu_per_rank(monkeypatch):
    clock = iter([100.0, 100.0, 104.0, 104.0, 105.0, 105.0])
    monkeypatch.setattr(hooks.time, "time", lambda: next(clock))
    hook = hooks.TrainMetricsHook(
        log_every=2,
        total=3,
        tokens_per_step=1000,
        flops_per_token=6e6,
        peak=1e12,
        measured_peak=None,
        world_size=4,
    )
    t = FakeTrainer()
    hook.on_fit_start(t)  # clock 100
    records = {}
    for step in (1, 2, 3):
        records[step] = {}
        hook.on_step_end(t, step, records[step])
    assert records[1] == {}
    # step 2: 2000 tokens in 4 s; the last step (3) logs too: 1000 tokens in 1 s
    assert records[2]["tokens_per_s"] == 500.0 and records[3]["tokens_per_s"] == 1000.0
    assert records[2]["mfu"] == pytest.approx(500.0 * 6e6 / (4 * 1e12), rel=1e-12)
    assert math.isnan(records[2]["mfu_measured"])  # no peak: NaN, never a number
    assert (records[2]["train_loss"], records[2]["grad_norm"], records[2]["lr"]) == (
        2.5,
        0.75,
        1e-3,
    )


def test_divergence_hook_stops_on_bad_train_or_validation_loss():
    hook = hooks.DivergenceHook(limit=10.0)
    t = FakeTrainer(step=4)
    hook.on_gradients(t, 4, StepStats(9.0, 1.0, 0.1))
    assert t.status == STATUS_OK and not t.logged
    hook.on_gradients(t, 4, StepStats(9.0, float("inf"), 0.1))
    assert t.status == STATUS_DIVERGED
    assert t.logged == [
        {"step": 5, "train_loss": 9.0, "grad_norm": float("inf"), "lr": 0.1, "event": "diverged"}
    ]
    for record, status in (
        ({"val_loss": 3.0}, STATUS_OK),
        ({}, STATUS_OK),
        ({"val_loss": 11.0}, STATUS_DIVERGED),
        ({"val_loss": float("nan")}, STATUS_DIVERGED),
    ):
        t = FakeTrainer()
        hook.on_step_end(t, 5, record)
        assert t.status == status, record


def test_checkpoint_hook_saves_every_k_steps_but_not_the_last_and_on_early_stop():
    hook = hooks.CheckpointHook(every=3, total=9)
    t = FakeTrainer()
    for step in range(1, 10):
        t.step = step
        hook.on_step_logged(t, step)
    assert t.snapshots == [3, 6]
    t.step = 9
    hook.on_fit_end(t)  # finished: no snapshot (the outputs are the final state)
    t.step = 7
    hook.on_fit_end(t)  # stopped early: one, complete when the process goes on
    assert t.blocking
    t.status, t.step = STATUS_DIVERGED, 8
    hook.on_fit_end(t)  # diverged: none
    assert t.snapshots == [3, 6, 7]


def test_eval_hook_evaluates_every_k_steps_and_at_the_last(monkeypatch):
    calls = []
    monkeypatch.setattr(
        hooks,
        "evaluate",
        lambda model, windows, n, micro, device, autocast: calls.append(n) or 0.5 * len(calls),
    )
    hook = hooks.EvalHook(windows="W", every=4, total=10, n_batches=3, micro_batch=2)
    t = FakeTrainer()
    records = [{} for _ in range(11)]
    for step in range(1, 11):
        hook.on_step_end(t, step, records[step])
    assert [s for s in range(11) if "val_loss" in records[s]] == [4, 8, 10]
    assert records[10]["val_loss"] == 1.5 == t.last_val and calls == [3, 3, 3]


def test_jsonl_logger_starts_fresh_or_drops_the_redone_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (2, 4, 6)))
    resumed = hooks.JsonlLogger(path)
    resumed.on_fit_start(FakeTrainer(step=4, start_step=4))
    resumed.on_log(None, {"step": 5, "x": 50})
    resumed.close(None)
    assert [json.loads(l) for l in path.read_text().splitlines()] == [
        {"step": 2, "x": 2},
        {"step": 4, "x": 4},
        {"step": 5, "x": 50},
    ]
    fresh = hooks.JsonlLogger(path)
    fresh.on_fit_start(FakeTrainer())
    fresh.on_log(None, {"step": 1, "x": 1})
    fresh.close(None)
    assert path.read_text() == '{"step": 1, "x": 1}\n'


def test_a_new_logger_plugs_in_through_the_registry_and_sees_every_record(
    tiny_data, tmp_path, monkeypatch
):
    from tests.unit.test_train import only_run, with_steps
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    class Recorder(Hook):
        def __init__(self, work_dir):
            self.calls, self.records = [], []

        def on_log(self, trainer, record):
            self.records.append(record)

        def __getattribute__(self, name):
            if name.startswith("on_") and name != "on_log":
                object.__getattribute__(self, "calls").append(name)
            return object.__getattribute__(self, name)

    made = []
    kind = tracking.LoggerKind(lambda work_dir: made.append(Recorder(work_dir)) or made[-1])
    monkeypatch.setitem(tracking.LOGGERS, "recorder", kind)
    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 4, log_every=2, eval_every=4)
    spec.train.loggers = ["recorder"]
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    train(spec, shards, paths, progress=False)
    (rec,) = made
    assert rec.records == [json.loads(line) for line in paths.curves.read_text().splitlines()]
    assert [r["step"] for r in rec.records] == [2, 4] and "val_loss" in rec.records[-1]
    per_step = ["on_step_start", "on_gradients", "on_step_end", "on_step_logged"]
    assert rec.calls == ["on_fit_start", *per_step * 4, "on_fit_end"]


@pytest.mark.parametrize(
    "name, label, peak",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12),
        ("NVIDIA H200", "H200", 989e12),
        ("NVIDIA H200 NVL", "H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", "GH200", 989e12),
        ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
        ("NVIDIA A100 80GB PCIe", "A100", 312e12),
        ("NVIDIA B200", "B200", 2250e12),
        ("NVIDIA A10", "A10", 125e12),
    ],
)
def test_peak_table_tells_the_variants_apart(name, label, peak):
    assert flops.gpu_peak(name) == (label, peak)


@pytest.mark.parametrize("name", ["NVIDIA A10G", "Tesla T4", "NVIDIA H20", "AMD Instinct MI300X"])
def test_unknown_gpu_has_no_peak_and_says_so(name, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert flops.gpu_peak(name) is None
    assert flops.device_peak_flops(torch.device("cuda"), torch.bfloat16) is None
    assert "unknown" in capsys.readouterr().err and math.isnan(flops.mfu(1e5, 1e9, None, 1))


def test_spec_peak_by_dtype_from_the_device_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    cuda = torch.device("cuda")
    assert flops.spec_peak_flops(cuda, torch.bfloat16) == 756e12
    assert flops.spec_peak_flops(cuda, torch.float32) == 378e12  # TF32: half the bf16 rate
    assert flops.spec_peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_mfu_is_per_rank():
    one = flops.mfu(8000.0, 1e9, 1e14, 1)
    assert one == pytest.approx(8000.0 * 1e9 / 1e14)
    assert flops.mfu(8000.0, 1e9, 1e14, 16) == pytest.approx(one / 16)


def test_measured_matmul_peak_is_positive_and_leaves_the_rng_alone():
    before = torch.get_rng_state()
    peak = flops.measured_matmul_peak(torch.device("cpu"), torch.float32, size=128, repeats=2)
    assert math.isfinite(peak) and peak > 1e6  # a 2-core CPU does far more than 1 MFLOP/s
    assert torch.equal(before, torch.get_rng_state())


def test_batch_and_fsdp_checks_live_in_the_train_config():
    from depthbench.util.errors import ConfigError
    from depthbench.spec.training import TrainConfig

    TrainConfig(global_batch_size=16, micro_batch_size=4).check(world_size=4)
    with pytest.raises(ConfigError, match="train.micro_batch_size.*x 3 ranks"):
        TrainConfig(global_batch_size=16, micro_batch_size=4).check(world_size=3)
    with pytest.raises(ConfigError, match="train.dynamics_every"):
        TrainConfig(parallel="fsdp", dynamics_every=5).check()
