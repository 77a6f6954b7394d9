"""kill -9 of a process in the middle of a checkpoint write: the previous checkpoint stays and is
the one loaded, and the next save clears what the killed write left; and a training process
killed with SIGKILL and started again ends with the weights, weights digest and metrics of a run
that was never killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from depthbench.train.checkpoint_folder import checksum_path, list_checkpoints
from depthbench.train.recipe import RunPaths
from tests.conftest import REPO
from tests.run_outputs import load_newest, only_run, save_step, weights_digest, with_steps


_KILL_SCRIPT = """
import os, sys, time, torch
from depthbench.train import checkpoint as ck
from depthbench.train import checkpoint_folder
folder, where = sys.argv[1], sys.argv[2]
state = lambda s: {"model": {"w": torch.full((4096,), float(s))}}
ck.save_checkpoint(folder, 1, "r", state(1))
def hang(*args):
    print("in the write", flush=True)
    time.sleep(600)
if where == "data":  # the new checkpoint's files are being written into step_2.tmp/
    os.fsync = hang
else:  # its manifest and checksum are written, the folder not yet renamed
    checkpoint_folder._fsync_dir = hang
ck.save_checkpoint(folder, 2, "r", state(2))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["data", "complete"])
def test_kill_9_during_a_checkpoint_write_keeps_and_uses_the_previous_one(tmp_path, where):
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path), where],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "in the write"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert (tmp_path / "step_00000002.tmp").is_dir()
    if where == "complete":
        assert checksum_path(tmp_path / "step_00000002.tmp").is_file()
    step, w = load_newest(tmp_path, size=4096)
    assert step == 1 and torch.equal(w, torch.full((4096,), 1.0))
    save_step(tmp_path, 2)  # the next save replaces the half-written one
    assert load_newest(tmp_path)[0] == 2
    assert not list(tmp_path.glob("*.tmp")) and not list(
        tmp_path.glob(".*")
    )  # and removes what the killed write left


@pytest.mark.slow
def test_sigkilled_run_resumes_to_identical_weights(tiny_data, tmp_path):
    """A training process killed with SIGKILL and started again ends bit-identical."""
    _, exp, shards = tiny_data
    spec = with_steps(only_run(exp), 40, checkpoint_every=5)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    script = (
        "import json, sys\n"
        "from depthbench.spec.run import RunSpec\n"
        "from depthbench.train.loop import RunPaths, train\n"
        "spec = RunSpec.from_dict(json.load(open(sys.argv[1])))\n"
        "train(spec, sys.argv[2], RunPaths(sys.argv[3], sys.argv[4]), progress=False)\n"
    )

    def run(run_dir, work_dir):
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                script,
                str(spec_file),
                str(shards),
                str(run_dir),
                str(work_dir),
            ],
            cwd=REPO,
        )

    ref = run(tmp_path / "ref", tmp_path / "ref_work")
    assert ref.wait(timeout=300) == 0
    victim = run(tmp_path / "killed", tmp_path / "killed_work")
    checkpoints = tmp_path / "killed_work" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not any(
        step >= 10 for step, _ in list_checkpoints(checkpoints)
    ):
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "summary.json").exists()
    resumed_from = list_checkpoints(checkpoints)[-1][0]
    assert 10 <= resumed_from < 40
    again = run(tmp_path / "killed", tmp_path / "killed_work")
    assert again.wait(timeout=300) == 0
    a, b = (
        load_file(tmp_path / "ref" / "model.safetensors"),
        load_file(tmp_path / "killed" / "model.safetensors"),
    )
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # two processes publish the same bytes: the digest compares runs across processes
    ref_paths = RunPaths(tmp_path / "ref", tmp_path / "ref_work")
    killed_paths = RunPaths(tmp_path / "killed", tmp_path / "killed_work")
    assert weights_digest(ref_paths) == weights_digest(killed_paths)
    ref_curve = (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
    got_curve = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()

    def strip(lines):
        return [
            {
                k: v
                for k, v in json.loads(l).items()
                if k not in ("tokens_per_s", "mfu", "mfu_measured")
            }
            for l in lines
        ]

    assert strip(ref_curve) == strip(got_curve)
