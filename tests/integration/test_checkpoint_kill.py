"""kill -9 of a process in the middle of a checkpoint write: the previous checkpoint stays and is
the one loaded, and the next save clears what the killed write left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from depthbench.train.checkpoint_folder import checksum_path, list_checkpoints
from tests.conftest import REPO
from tests.run_outputs import load_newest, save_step


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
