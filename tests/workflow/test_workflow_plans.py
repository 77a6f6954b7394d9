"""Planning the presets from a clean tree, and Snakemake stopped by Ctrl-C: the end-to-end tests
that need no trained grid."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import wait_until_gone
from tests.workflow_runs import SNAKEMAKE, copy_workflow, grid, job_counts, write_config

pytestmark = pytest.mark.slow


# Snakemake in an interpreter that says at exit whether torch was imported
SNAKEMAKE_SAYING_TORCH = [
    sys.executable,
    "-c",
    "import atexit, sys\n"
    "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr))\n"
    "from snakemake.cli import main\n"
    "sys.argv = ['snakemake', *sys.argv[1:]]\n"
    "main()\n",
]


@pytest.mark.parametrize(
    "preset, trains", [("postnorm_collapse", 2 * 3 * 2), ("cpu_all", 11 * 3 * 2)]
)
def test_presets_plan_and_plan_again_from_the_plan_cache_without_torch(preset, trains, tmp_path):
    """The CPU presets plan in a clean tree (the GPU presets plan through the SLURM profile
    below). Planned again, the grid comes from results/.cache/plans (depthbench.grid.plan_cache):
    the same jobs, and torch, which the schema's registry and the shape solver import, is not
    imported at all."""
    root = copy_workflow(tmp_path)  # a clean tree: nothing computed yet
    outputs = []
    for _ in range(2):
        proc = subprocess.run(
            [
                *SNAKEMAKE_SAYING_TORCH,
                "--cores",
                "2",
                "-n",
                "--configfile",
                f"config/presets/{preset}.yaml",
            ],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(proc.stdout + proc.stderr)
    first, again = outputs
    counts = job_counts(first)
    assert counts["train"] == trains and counts["tokenize"] == 1
    assert job_counts(again) == counts
    assert "torch imported: True" in first and "torch imported: False" in again


@pytest.mark.parametrize(
    "preset, trains, nodes, gpus, pieces", [("400m", 231, 1, 1, 7), ("1p6b", 36, 2, 8, 32)]
)
def test_slurm_profile_plans_from_the_repository_root(
    preset, trains, nodes, gpus, pieces, tmp_path
):
    """`snakemake --profile slurm` resolves ./slurm/ and plans without SLURM installed; the
    corpus is tokenized in the preset's parallel pieces (one index job, the pieces, one merge)."""
    root = copy_workflow(tmp_path)
    proc = subprocess.run(
        [*SNAKEMAKE, "--profile", "slurm", "-n", "--configfile", f"config/presets/{preset}.yaml"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert job_counts(out)["train"] == trains and job_counts(out)["tokenize"] == 1
    assert job_counts(out)["tokenize_index"] == 1 and job_counts(out)["tokenize_piece"] == pieces
    # each training job asks for the configured SLURM allocation
    train_resources = re.findall(r"rule train:.*?resources: ([^\n]*)", out, flags=re.S)
    assert len(train_resources) == trains
    assert all(f"nodes={nodes}" in r and f"gpus_per_node={gpus}" in r for r in train_resources)


def test_ctrl_c_on_snakemake_cancels_the_submitted_training_job(tmp_path, wiki_jsonl):
    """Ctrl-C reaches the whole foreground process group; the dispatcher cancels its job."""
    root = copy_workflow(tmp_path)
    config = grid(
        wiki_jsonl,
        architectures=["pre_ln"],
        shapes=[{"n_layer": 1}],
        learning_rates=[3e-3],
        launcher={"backend": "local"},
    )
    config["train"]["tokens_per_param"] = 1000.0  # far longer than the test waits
    write_config(root, config)
    proc = subprocess.Popen(
        [*SNAKEMAKE, "--cores", "1"],
        cwd=root,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    records = []
    while time.time() < deadline and not records:
        records = list((root / "results" / "work").glob("*/checkpoints"))
        time.sleep(0.5)
    assert records, "training never started"
    job_pid = int(json.loads((records[0].parent / "job.json").read_text())["job_id"])
    os.kill(job_pid, 0)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does in a terminal
    proc.wait(timeout=120)
    assert wait_until_gone(job_pid), f"training job {job_pid} survived Ctrl-C on Snakemake"
    assert not list((root / "results" / "runs").glob("*/summary.json"))
