"""One trainer per run (the run's lock) and a trainer that stops once the Snakemake process that
started it has ended (depthbench.train.owner)."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from depthbench.train.checkpoint_folder import list_checkpoints, verify_checkpoint
from depthbench.train.owner import (
    LOCK_NAME,
    RunLock,
    RunLockedError,
    process_exists,
    process_identity,
)
from tests.conftest import REPO, wait_until_gone

HOLD = (
    "import sys, time\n"
    "from depthbench.train.owner import RunLock\n"
    "lock = RunLock.acquire(sys.argv[1], 'r')\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)


def _spec_file(tiny_data, tmp_path, steps: int) -> Path:
    _, exp, _ = tiny_data
    (spec,) = exp.runs.values()
    spec = copy.deepcopy(spec)
    spec.train.total_steps = steps
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_dict()))
    return path


def _wait_for(condition, seconds: float = 120.0) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_holder_is_refused_at_once_naming_the_first_and_kill_9_releases_the_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.time()
        with pytest.raises(RunLockedError) as exc:
            RunLock.acquire(tmp_path, "r")
        assert time.time() - started < 1.0
        message = str(exc.value)
        assert f"process {holder.pid} on host {socket.gethostname()}" in message
        assert str(tmp_path / LOCK_NAME) in message
        assert (
            json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
        )  # the refusal left the record
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock.acquire(tmp_path, "r")  # the kernel released the killed holder's lock
    try:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    RunLock.acquire(tmp_path, "r").release()  # released: taken again in the same process


@pytest.mark.slow
def test_a_process_identity_tells_a_running_process_from_an_ended_one():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = process_identity(proc.pid)
    assert process_exists(identity) and process_exists(process_identity(os.getpid()))
    proc.kill()
    proc.wait()
    assert not process_exists(identity)
    pid, _, started = identity.partition(":")
    if started:  # a later process with the same pid has another start time
        assert not process_exists(f"{os.getpid()}:{int(started) + 1}")


@pytest.mark.slow
def test_a_second_trainer_of_a_running_run_refuses_at_once_naming_the_first(tiny_data, tmp_path):
    _, _, shards = tiny_data
    spec_file = _spec_file(tiny_data, tmp_path, 100000)  # would run for a long time
    run, work = tmp_path / "run", tmp_path / "work"
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, sys\n"
            "from depthbench.spec.run import RunSpec\n"
            "from depthbench.launch.local import dispatch\n"
            "dispatch(RunSpec.from_dict(json.load(open(sys.argv[1]))), "
            "sys.argv[2], sys.argv[3], sys.argv[4], {'backend': 'local'})\n",
            str(spec_file),
            str(shards),
            str(run),
            str(work),
        ],
        cwd=REPO,
    )
    try:
        _wait_for(lambda: list_checkpoints(work / "checkpoints"))
        controller = int(
            json.loads((work / "job.json").read_text())["job_id"]
        )  # a local job: a process and its task
        trainer_pid = json.loads((work / LOCK_NAME).read_text())["pid"]
        assert Path(f"/proc/{trainer_pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(
            controller
        )
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                "import json, sys\n"
                "from depthbench.launch.jobs import TrainingJob\n"
                "TrainingJob()(json.load(open(sys.argv[1])), "
                "sys.argv[2], sys.argv[3], sys.argv[4])\n",
                str(spec_file),
                str(shards),
                str(run),
                str(work),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0
        assert "RunLockedError" in second.stderr
        assert f"process {trainer_pid} on host {socket.gethostname()}" in second.stderr
        assert str(work / LOCK_NAME) in second.stderr
        os.kill(trainer_pid, 0)  # the first trainer goes on
    finally:
        first.send_signal(signal.SIGTERM)  # cancels its job
        first.wait(timeout=60)


@pytest.mark.slow
def test_a_trainer_whose_snakemake_was_killed_stops_at_its_next_checkpoint_and_a_rerun_resumes(
    tiny_data, tmp_path
):
    """A stand-in for Snakemake starts the dispatcher (inline: the dispatcher trains) and is killed
    with SIGKILL; the trainer stops at its next checkpoint, releasing the run, and a new
    dispatcher resumes from that checkpoint to the end."""
    _, _, shards = tiny_data
    spec_file = _spec_file(tiny_data, tmp_path, 120)
    run, work, log = tmp_path / "run", tmp_path / "work", tmp_path / "dispatcher.log"
    dispatcher = (
        "import json, sys\n"
        "from depthbench.spec.run import RunSpec\n"
        "from depthbench.launch.local import dispatch\n"
        "dispatch(RunSpec.from_dict(json.load(open(sys.argv[1]))), "
        "sys.argv[2], sys.argv[3], sys.argv[4], {'backend': 'inline'})\n"
    )
    snakemake = (  # starts the dispatcher as its child, tells its pid, waits
        "import subprocess, sys, time\n"
        "d = subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:6]], "
        "stderr=open(sys.argv[6], 'w'))\n"
        "print(d.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            snakemake,
            dispatcher,
            str(spec_file),
            str(shards),
            str(run),
            str(work),
            str(log),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    trainer_pid = int(parent.stdout.readline())
    try:
        _wait_for(lambda: list_checkpoints(work / "checkpoints"))
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until_gone(trainer_pid, 60), (
            "the trainer went on after its Snakemake was killed"
        )
    finally:
        if not wait_until_gone(trainer_pid, 0):
            os.kill(trainer_pid, signal.SIGKILL)
    text = log.read_text()
    assert "has ended: stopped at the checkpoint of step" in text, text[-2000:]
    stopped = int(text.split("stopped at the checkpoint of step ")[1].split(";")[0])
    assert 0 < stopped < 120 and not (run / "summary.json").exists()
    step, latest = list_checkpoints(work / "checkpoints")[-1]
    assert step == stopped and verify_checkpoint(latest) is None
    resumed = subprocess.run(
        [sys.executable, "-c", dispatcher, str(spec_file), str(shards), str(run), str(work)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from step {stopped}" in resumed.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 120
