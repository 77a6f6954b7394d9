"""Dispatch through submitit: the local backend trains in a child process; interrupting the
dispatcher cancels the job it submitted."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError
from depthbench.launch.executors import make_executor, slurm_parameters
from depthbench.launch.local import dispatch
from tests.conftest import REPO, tiny_config, wait_until_gone

pytestmark = pytest.mark.slow


def spec_with_steps(exp, steps):
    (spec,) = exp.runs.values()
    spec = copy.deepcopy(spec)
    spec.train.total_steps = steps
    return spec


def test_inline_and_local_backends_give_the_same_run(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = spec_with_steps(exp, 6)
    summaries = {}
    for backend in ("inline", "local"):
        summaries[backend] = dispatch(
            spec,
            str(shards),
            str(tmp_path / backend / "run"),
            str(tmp_path / backend / "work"),
            {"backend": backend},
        )
        assert (tmp_path / backend / "work" / "job.json").exists()
    assert summaries["inline"]["status"] == summaries["local"]["status"] == "ok"
    assert summaries["inline"]["final_val_loss"] == summaries["local"]["final_val_loss"]
    local_logs = list((tmp_path / "local" / "work" / "submitit").glob("*_log.err"))
    assert local_logs, "submitit keeps per-run logs in the run's work folder"


def test_slurm_jobs_ask_for_the_configured_allocation(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    launcher = {
        "backend": "slurm",
        "slurm": {
            "partition": "gpu",
            "account": "proj",
            "nodes": 2,
            "gpus_per_node": 4,
            "cpus_per_task": 6,
            "mem_gb": 100,
            "time_min": 90,
            "extra": {"qos": "high"},
        },
    }
    sbatch = _make_sbatch_string(
        command="python -m x", folder=tmp_path, **slurm_parameters(launcher)
    )
    for line in (
        "--partition=gpu",
        "--account=proj",
        "--nodes=2",
        "--gpus-per-node=4",
        "--cpus-per-task=6",
        "--mem=100GB",
        "--time=90",
        "--qos=high",
        "--signal=USR2@120",
    ):
        assert f"#SBATCH {line}" in sbatch, line
    # without SLURM on this machine the executor refuses clearly instead of pretending (with
    # SLURM, tests/integration/test_slurm.py submits for real)
    if shutil.which("srun") is None:
        with pytest.raises(RuntimeError, match="srun"):
            make_executor(launcher, tmp_path, threads=1)


def test_interrupting_the_dispatcher_cancels_the_submitted_job(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = spec_with_steps(exp, 100000)  # would run for a long time
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    work = tmp_path / "work"
    script = (
        "import json, sys\n"
        "from depthbench.spec.run import RunSpec\n"
        "from depthbench.launch.local import dispatch\n"
        "spec = RunSpec.from_dict(json.load(open(sys.argv[1])))\n"
        "dispatch(spec, sys.argv[2], sys.argv[3], sys.argv[4], {'backend': 'local'})\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            script,
            str(spec_file),
            str(shards),
            str(tmp_path / "run"),
            str(work),
        ],
        cwd=REPO,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (work / "checkpoints").exists():
        time.sleep(0.2)
    job_pid = int(json.loads((work / "job.json").read_text())["job_id"])  # local jobs are processes
    os.kill(job_pid, 0)  # running
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert wait_until_gone(job_pid), (
        f"submitted job {job_pid} still running after the dispatcher was interrupted"
    )


@pytest.mark.parametrize(
    "slurm, field",
    [
        ({"partition": "debug\n#SBATCH --exclusive"}, "launcher.slurm.partition"),
        ({"account": "me\nrm -rf /"}, "launcher.slurm.account"),
        ({"extra": {"qos": "high\n#SBATCH --exclusive"}}, "launcher.slurm.extra.qos"),
        ({"extra": {"qos high": "x"}}, "launcher.slurm.extra"),
    ],
)
def test_launcher_slurm_fields_with_newlines_are_refused(wiki_jsonl, slurm, field):
    """Each field becomes an #SBATCH line: a newline would start a shell command. Refused
    before any work, whether or not SLURM is installed here."""
    config = tiny_config(wiki_jsonl, launcher={"backend": "slurm", "slurm": slurm})
    with pytest.raises(ConfigError) as err:
        expand_grid(load_config(config))
    assert err.value.field == field


def test_a_failing_inline_job_run_from_a_terminal_ends_with_its_error_and_no_debugger_prompt(
    tmp_path,
):
    import pty

    script = (
        "import sys\n"
        "from depthbench.launch.local import submit_and_wait\n"
        "def fails():\n"
        "    raise ValueError('the job failed on purpose')\n"
        "submit_and_wait(fails, (), 'failing', sys.argv[1], {'backend': 'inline'})\n"
    )
    leader, follower = pty.openpty()  # a terminal on stdin: what a prompt would wait on
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "work")],
            cwd=REPO,
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert os.isatty(follower)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the failing job did not end (waiting for input?): {out[-500:]}")
    finally:
        os.close(follower)
        os.close(leader)
    assert proc.returncode != 0
    assert "(Pdb)" not in out + err
    assert "ValueError: the job failed on purpose" in err
    assert "inline job" in err and "failed" in err  # the dispatcher's own report of it


def test_a_seq_len_longer_than_a_split_is_refused_before_anything_is_submitted(tiny_data, tmp_path):
    from depthbench.data.shards import read_meta

    _, exp, shards = tiny_data
    spec = spec_with_steps(exp, 10)
    spec.train.seq_len = read_meta(shards)["train"]["n_tokens"]
    with pytest.raises(ConfigError, match="train.seq_len") as exc:
        dispatch(
            spec, str(shards), str(tmp_path / "run"), str(tmp_path / "work"), {"backend": "local"}
        )
    assert exc.value.field == "train.seq_len" and "training split" in str(exc.value)
    assert not (tmp_path / "work").exists() and not (tmp_path / "run").exists()  # no job, no folder


def test_the_workflow_tokenizes_then_refuses_a_seq_len_the_split_cannot_fill_before_training(
    wiki_jsonl, tmp_path
):
    import yaml

    config = tiny_config(wiki_jsonl)
    config["train"]["seq_len"] = 100000  # longer than the tiny corpus's training split
    config["probes"], config["nll"] = {"enabled": False}, {**config["nll"], "enabled": False}
    (run_id,) = expand_grid(load_config(copy.deepcopy(config))).runs
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "config").symlink_to(REPO / "config")  # the claims file
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            f"results/runs/{run_id}/summary.json",
            "--cores",
            "1",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(tmp_path),
            "--configfile",
            str(tmp_path / "c.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0
    assert list((tmp_path / "results" / "data").glob("*/meta.json"))  # the token counts are known
    log = (tmp_path / "results" / "logs" / "train" / f"{run_id}.log").read_text()
    assert (
        "config field 'train.seq_len': 100000 needs windows of seq_len + 1 = 100001 tokens" in log
    )
    assert "training split" in log and "valid: at most" in log
    assert not (
        tmp_path / "results" / "work" / run_id / "submitit"
    ).exists()  # nothing was submitted
