"""The training step loop: no host reads on steps that log nothing, bit-identical results to a
loop that reads the loss every micro-batch, the divergence check deferred to the next check step,
batches copied from pinned memory without blocking, and `device_id` in `init_process_group`."""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from depthbench.train import distributed, hooks
from depthbench.train.trainer import STATUS_DIVERGED, STATUS_OK, StepStats, Trainer


TIMING = ("tokens_per_s", "mfu", "mfu_measured")


def _spec(tiny_data, steps, **train_kw):
    _, exp, _ = tiny_data
    spec = copy.deepcopy(next(iter(exp.runs.values())))
    spec.train.total_steps = steps
    for k, v in train_kw.items():
        setattr(spec.train, k, v)
    return spec


def _train(spec, data_dir, root):
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    summary = train(spec, data_dir, RunPaths(root / "run", root / "work"), progress=False)
    lines = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return (
        summary,
        [{k: v for k, v in r.items() if k not in TIMING} for r in lines],
        load_file(root / "run" / "model.safetensors"),
    )


class ReadCounter:
    """Counts host reads of tensor values (`.item`, `.tolist`, `float()`/`int()`/`bool()`,
    `.nonzero`) by the step they happen in. The optimizer's own reads are left out: torch keeps
    AdamW's step counters on the host (non-capturable), so reading them is no device sync."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "nonzero")

    def __init__(self, monkeypatch):
        self.step, self.reads = None, {}
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        original = Trainer._one_step

        def one_step(trainer):
            self.step = trainer.step + 1  # the step number after this update, as in the logs
            try:
                return original(trainer)
            finally:
                self.step = None

        monkeypatch.setattr(Trainer, "_one_step", one_step)

    def _wrap(self, fn, name):
        import sys

        def wrapped(t, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.step is not None and f"torch{os.sep}optim" not in caller:
                self.reads.setdefault(self.step, []).append(name)
            return fn(t, *args, **kwargs)

        return wrapped


@pytest.mark.parametrize("moe", [False, True])
def test_steps_that_log_nothing_read_no_tensor_on_the_host(tiny_data, tmp_path, monkeypatch, moe):
    spec = _spec(tiny_data, 8, log_every=4, eval_every=8, checkpoint_every=100)
    if moe:
        spec.model.moe = {"n_experts": 4, "top_k": 2}
    counter = ReadCounter(monkeypatch)
    summary, _, _ = _train(spec, tiny_data[2], tmp_path)
    assert summary["status"] == "ok"
    # step 4 logs (and checks divergence), step 8 logs and evaluates; nothing else reads
    assert set(counter.reads) == {4, 8}, counter.reads
    assert counter.reads[4].count("tolist") == 2  # train metrics once, divergence flag once


def _reading_forward_backward(self):
    """A forward/backward that reads the loss on the host, as the reference: `.item()` per
    micro-batch and host floats."""
    batches, tc = self.batches, self.tc
    loss_sum = 0.0
    for micro in range(batches.accum_steps):
        x, y = batches.get(self.step, micro)
        with distributed.gradient_sync(self.net, self.ctx, micro == batches.accum_steps - 1):
            with self.autocast:
                out = self.step_fn(x.to(self.device), y.to(self.device))
            objective = out.loss if out.aux_loss is None else out.loss + out.aux_loss
            (objective / batches.accum_steps).backward()
        loss_sum += out.loss.item()
    train_loss = distributed.all_reduce_mean(loss_sum / batches.accum_steps, self.ctx, self.device)
    max_norm = tc.grad_clip if tc.grad_clip is not None else float("inf")
    return train_loss, distributed.scalar(
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
    )


def test_device_side_losses_give_bit_identical_metrics_and_weights(
    tiny_data, tmp_path, monkeypatch
):
    spec = _spec(tiny_data, 6, log_every=1)
    got = _train(spec, tiny_data[2], tmp_path / "new")
    monkeypatch.setattr(Trainer, "forward_backward", _reading_forward_backward)
    ref = _train(spec, tiny_data[2], tmp_path / "ref")
    assert got[1] == ref[1] and len(got[1]) == 6
    assert got[2].keys() == ref[2].keys() and all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])


class FakeTrainer:
    def __init__(self):
        self.status, self.logged = STATUS_OK, []

    def log(self, record):
        self.logged.append(record)


def test_divergence_is_found_at_the_next_check_step_and_names_the_first_bad_step():
    hook = hooks.DivergenceHook(limit=10.0, every=(3,), total=9)
    t = FakeTrainer()
    stats = [
        StepStats(torch.tensor(2.0), torch.tensor(1.0), 0.1),
        StepStats(torch.tensor(11.0), torch.tensor(1.0), 0.2),
        StepStats(torch.tensor(float("nan")), torch.tensor(float("nan")), 0.3),
    ]
    hook.on_gradients(t, 0, stats[0])
    hook.on_gradients(t, 1, stats[1])  # bad (loss above the limit), but step 2 is no check step
    assert t.status == STATUS_OK and not t.logged
    hook.on_gradients(t, 2, stats[2])  # step 3: checked, the first bad step reported
    assert t.status == STATUS_DIVERGED
    assert t.logged == [
        {"step": 2, "train_loss": 11.0, "grad_norm": 1.0, "lr": 0.2, "event": "diverged"}
    ]
    clean = hooks.DivergenceHook(limit=10.0, every=(3,), total=9)
    t = FakeTrainer()
    for s in range(6):
        clean.on_gradients(t, s, stats[0])
    assert t.status == STATUS_OK and not t.logged
    late = hooks.DivergenceHook(limit=10.0, every=(3,), total=9)
    late.on_gradients(t, 3, stats[2])  # a process stopped on purpose before its check step
    late.on_fit_end(t)
    assert t.status == STATUS_DIVERGED and t.logged[0]["step"] == 4


def test_a_diverged_run_stops_at_its_check_step(tiny_data, tmp_path):
    from depthbench.grid.config import expand_grid
    from depthbench.spec.schema import load_config

    config, _, shards = tiny_data
    exp = expand_grid(load_config({**config, "learning_rates": [50.0]}))
    spec = copy.deepcopy(next(iter(exp.runs.values())))
    spec.train.total_steps, spec.train.log_every = 12, 3
    summary, lines, _ = _train(spec, shards, tmp_path)
    (event,) = [r for r in lines if r.get("event") == "diverged"]
    tc = spec.train
    checks = hooks.DivergenceHook(
        0.0, (tc.log_every, tc.eval_every, tc.checkpoint_every), tc.total_steps
    )
    # stopped before the update of a check step, at or after the first bad step
    assert summary["status"] == "diverged" and checks.check_due(summary["steps"] + 1)
    assert event["step"] <= summary["steps"] + 1 and summary["steps"] < 12


def test_init_process_group_binds_the_rank_gpu(monkeypatch):
    calls = {}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("set_device", i))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed.dist, "init_process_group", lambda *a, **k: calls.setdefault("init", (a, k))
    )
    ctx, name = distributed.setup("ddp", "auto")
    assert name == "cuda:1" and calls["set_device"] == 1 and (ctx.rank, ctx.world_size) == (1, 2)
    assert calls["init"] == ((), {"backend": "nccl", "device_id": torch.device("cuda:1")})
    calls.clear()
    ctx, name = distributed.setup("ddp", "cpu")  # gloo on CPU: no device to bind
    assert name == "cpu" and calls["init"] == ((), {"backend": "gloo"})


def test_batches_go_to_a_gpu_from_pinned_memory_without_blocking(monkeypatch):
    """A copy from pageable memory would make the host wait for the queued backward."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: calls.append((a, k)) or t)
    trainer_module = __import__("depthbench.train.trainer", fromlist=["to_device"])
    trainer_module.to_device(torch.zeros(2, 3, dtype=torch.long), torch.device("cuda", 0))
    assert calls == ["pin", ((torch.device("cuda", 0),), {"non_blocking": True})]
    calls.clear()
    trainer_module.to_device(torch.zeros(2), torch.device("cpu"))
    assert calls == [((torch.device("cpu"),), {})]
