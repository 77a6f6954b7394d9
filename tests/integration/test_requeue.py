"""The requeue signal: SIGUSR2 (SLURM's --signal before the time limit) or
SIGTERM (preemption) makes the training finish its step, checkpoint it and exit the way the
launcher expects; the resumed run ends with the uninterrupted run's weights, bit for bit."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from depthbench.train.checkpoint_folder import list_checkpoints
from depthbench.train.recipe import RunPaths
from depthbench.train.loop import train
from tests.conftest import REPO
from tests.run_outputs import only_run, with_steps

STEPS = 40
TIMING = ("tokens_per_s", "mfu", "mfu_measured")


def _spec(tiny_data):
    # no periodic checkpoint: the only one is the signal's
    return with_steps(only_run(tiny_data[1]), STEPS, checkpoint_every=1000, log_every=1)


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    paths = RunPaths(root / "run", root / "work")
    assert train(_spec(tiny_data), tiny_data[2], paths, progress=False)["status"] == "ok"
    return paths


def _logged_steps(metrics) -> list[int]:
    try:
        return [
            json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()
        ]
    except (OSError, ValueError):  # not written yet, or a line half-written
        return []


def _curve(paths) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING}
        for line in paths.metrics.read_text().splitlines()
    ]


def _same_weights(a, b) -> bool:
    wa, wb = load_file(a.weights), load_file(b.weights)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


SCRIPT = (
    "import json, sys\n"
    "from depthbench.spec.run import RunSpec\n"
    "from depthbench.train.loop import RunPaths, train\n"
    "spec = RunSpec.from_dict(json.load(open(sys.argv[1])))\n"
    "train(spec, sys.argv[2], RunPaths(sys.argv[3], sys.argv[4]), progress=False)\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_signal_checkpoints_the_current_step_and_the_resumed_run_is_bit_identical(
    tiny_data, uninterrupted, tmp_path, sig
):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(_spec(tiny_data).to_dict()))
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    victim = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(spec_file),
            str(tiny_data[2]),
            str(paths.run_dir),
            str(paths.work_dir),
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline and len(_logged_steps(paths.metrics)) < 3:
        time.sleep(0.02)
    # held while the signal is sent, so that the run cannot reach its end first on a fast machine
    victim.send_signal(signal.SIGSTOP)
    seen = _logged_steps(paths.metrics)[-1]
    victim.send_signal(sig)
    victim.send_signal(signal.SIGCONT)
    _, err = victim.communicate(timeout=120)
    assert victim.returncode == 128 + sig, err[
        -3000:
    ]  # no Python handler before: the shell's "ended by sig"
    assert not paths.summary.exists()
    ((step, path),) = list_checkpoints(paths.checkpoints)
    # the step in progress when the signal came was finished, logged and checkpointed; no other
    assert step in (seen, seen + 1) and _logged_steps(paths.metrics)[-1] == step < STEPS
    assert f"{sig.name}: checkpointed step {step}" in err
    assert train(_spec(tiny_data), tiny_data[2], paths, progress=False)["status"] == "ok"
    assert _same_weights(paths, uninterrupted)
    assert _curve(paths) == _curve(uninterrupted)


def test_the_previous_handler_gets_the_signal_after_the_checkpoint(tiny_data, tmp_path):
    """What submitit's handler is for the training: called once the checkpoint is complete (on
    SLURM it then requeues and exits); the run exits even when the handler returns."""
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    calls = []

    def submitit_like(signum, frame):
        calls.append(
            (
                signum,
                [s for s, _ in list_checkpoints(paths.checkpoints)],
                _logged_steps(paths.metrics)[-1],
            )
        )

    def send_when_running():
        deadline = time.time() + 240
        while time.time() < deadline and len(_logged_steps(paths.metrics)) < 2:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        sender = threading.Thread(target=send_when_running)
        sender.start()
        with pytest.raises(SystemExit) as exited:
            train(_spec(tiny_data), tiny_data[2], paths, progress=False)
        sender.join()
        assert signal.getsignal(signal.SIGUSR2) is submitit_like  # the loop's own handler is gone
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert exited.value.code == 128 + signal.SIGUSR2
    ((signum, checkpoints, last_logged),) = calls
    assert signum == signal.SIGUSR2 and checkpoints == [last_logged] and 2 <= last_logged < STEPS


def test_a_signal_at_the_last_step_lets_the_run_finish_and_an_ignored_signal_stays_ignored():
    from types import SimpleNamespace

    from depthbench.train.distributed import DistContext
    from depthbench.train.requeue import RequeueHook

    hook = RequeueHook(total=5)
    trainer = SimpleNamespace(ctx=DistContext(), snapshots=[])
    trainer.snapshot = lambda blocking=False: trainer.snapshots.append(blocking)
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # e.g. started under nohup
    try:
        hook.on_fit_start(trainer)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.time() + 10
        while (
            not hook.received and time.time() < deadline
        ):  # Python runs the handler between bytecodes
            time.sleep(0.01)
        assert hook.received == signal.SIGUSR2
        hook.on_step_logged(trainer, 5)  # the last step: the run writes its outputs instead
        assert trainer.snapshots == []
        hook.close(trainer)
        assert signal.getsignal(signal.SIGUSR2) == before[signal.SIGUSR2]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
