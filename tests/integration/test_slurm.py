"""The SLURM path against a real one-node SLURM cluster (scripts/slurm_cluster.sh start): jobs go
through sbatch, are signalled at their time limit and requeued, preempted (`scontrol requeue`),
re-attached after Snakemake was killed, run 2 gloo tasks, fail with their stderr in the
Snakemake log, and get the sbatch options the config asks for.

Skipped where SLURM is not installed, except under CI=true, where a missing SLURM is an error
(.ci/run starts the cluster). Each job asks for 1 CPU (the 2-task run for 2): the node has 2.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.launch.local import dispatch, submit_and_wait
from depthbench.train.recipe import RunPaths
from depthbench.train.loop import train
from tests.conftest import REPO, tiny_config
from tests.run_outputs import WEIGHT_TOLERANCE, max_weight_diff

pytestmark = pytest.mark.slow
# 1 CPU and 1 GB a job (the processes are not limited: memory is only counted by the scheduler)
SLURM = {"partition": "debug", "gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 1, "time_min": 10}
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    """The one-node DepthBench cluster must be up; its partitions are `debug` and `long`."""
    if shutil.which("sbatch") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(
                "CI: sbatch not found; .ci/run starts SLURM with `scripts/slurm_cluster.sh start`"
            )
        pytest.skip("no SLURM here; `sudo scripts/slurm_cluster.sh start` runs a one-node cluster")
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True)
    if not re.search(r"^ClusterName\s*=\s*depthbench$", out.stdout, flags=re.M):
        if os.environ.get("CI") or out.returncode != 0:
            pytest.fail(
                "the DepthBench SLURM cluster is not up (`scripts/slurm_cluster.sh start`): "
                f"{out.stderr.strip()}"
            )
        pytest.skip(
            "this SLURM is not the one-node DepthBench cluster; "
            "these tests submit to its partitions"
        )


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (the job is known to slurmctld for MinJobAge after it ends)."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True, check=True
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(predicate, timeout: float, what: str, poll: float = 0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def checkpoint_steps(work: Path) -> list[int]:
    from depthbench.train.checkpoint_folder import list_checkpoints

    return [step for step, _ in list_checkpoints(work / "checkpoints")]


def weights_equal(a: Path, b: Path) -> bool:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def long_spec(tiny_data, steps: int):
    (spec,) = tiny_data[1].runs.values()
    spec = copy.deepcopy(spec)
    spec.train.total_steps = steps
    return spec


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    """The reference of the requeue tests: the same run trained in one go, in this process."""
    root = tmp_path_factory.mktemp("uninterrupted")
    spec = long_spec(tiny_data, REQUEUE_STEPS)
    summary = train(spec, tiny_data[2], RunPaths(root / "run", root / "work"), progress=False)
    assert summary["status"] == "ok"
    return root / "run"


REQUEUE_STEPS = 200  # the requeued attempt outlasts KillWait (5 s) after a preemption
SIGUSR2_BIT = 1 << (signal.SIGUSR2 - 1)  # in /proc/<pid>/status signal masks


def start_dispatch(spec, shards: Path, tmp: Path, launcher: dict) -> subprocess.Popen:
    """The dispatcher of one run (what a Snakemake train job runs) as its own process."""
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    script = (
        "import json, sys\n"
        "from depthbench.spec.run import RunSpec\n"
        "from depthbench.launch.local import dispatch\n"
        "spec = RunSpec.from_dict(json.load(open(sys.argv[1])))\n"
        "print(json.dumps(dispatch(spec, sys.argv[2], sys.argv[3], sys.argv[4], "
        "json.loads(sys.argv[5]))['status']))\n"
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            script,
            str(spec_file),
            str(shards),
            str(tmp / "run"),
            str(tmp / "work"),
            json.dumps(launcher),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def running_with_checkpoint(work: Path) -> str:
    """The run's job id once it runs and has written a checkpoint to resume from."""

    def ready():
        record = work / "job.json"
        if not record.exists() or not checkpoint_steps(work):
            return None
        job_id = json.loads(record.read_text())["job_id"]
        return job_id if job_info(job_id).get("JobState") == "RUNNING" else None

    return wait_for(ready, 120, "the job to run and write a checkpoint")


def finish_dispatch(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return err


def job_log(work: Path, job_id: str) -> str:
    return (work / "submitit" / f"{job_id}_0_log.err").read_text()


def resumed_step(log: str) -> int:
    steps = [int(s) for s in re.findall(r"resumed from step (\d+)", log)]
    assert steps, "the requeued job did not resume from a checkpoint"
    return steps[-1]


def task_pid(work: Path) -> int:
    """The pid of the job's training task (submitit's runner, started by srun on this node)."""
    folder = str(work / "submitit")
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # the Python task, not the srun of the batch script, whose arguments are the same
        if (
            b"submitit.core._submit" in argv
            and folder.encode() in argv
            and b"srun" not in Path(argv[0].decode()).name.encode()
        ):
            return int(entry.name)
    raise AssertionError(f"no training task of {folder} running")


def signal_pending(pid: int, bit: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    masks = re.findall(r"^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)$", status, flags=re.M)
    return any(int(m, 16) & bit for m in masks)


def requeued_after_signal(job_id: str, pid: int) -> bool:
    if job_info(job_id).get("Restarts", "0") != "0":
        return True
    try:  # SLURM sends SIGCONT with the signal; should the task still be held, continue it
        if signal_pending(pid, SIGUSR2_BIT):
            os.kill(pid, signal.SIGCONT)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return False


def test_time_limit_signals_requeues_and_resumes_to_the_same_weights(
    tiny_data, uninterrupted, tmp_path
):
    spec = long_spec(tiny_data, REQUEUE_STEPS)
    work = tmp_path / "work"
    proc = start_dispatch(spec, tiny_data[2], tmp_path, {"backend": "slurm", "slurm": SLURM})
    try:
        job_id = running_with_checkpoint(work)
        # Hold the training (SIGSTOP) so that it cannot finish before the signal, then bring the
        # time limit close: once fewer than 120 s are left (--signal=USR2@120), SLURM's next
        # time-limit check (every 30 s) sends SIGCONT and SIGUSR2, and submitit requeues the job.
        pid = task_pid(work)
        os.kill(pid, signal.SIGSTOP)
        minutes = max(1, (_run_seconds(job_info(job_id)["RunTime"]) + 150) // 60)
        subprocess.run(
            ["scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}"], check=True
        )
        wait_for(
            lambda: requeued_after_signal(job_id, pid),
            120,
            "SIGUSR2 before the time limit and the requeue",
        )
        # pending for cred_expire (5 s) before it may start: give it back its 10 minutes
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], check=True)
        finish_dispatch(proc)
    finally:
        proc.kill()
        subprocess.run(
            ["scancel", json.loads((work / "job.json").read_text())["job_id"]], check=False
        )
    log = job_log(work, job_id)
    assert (
        "Caught signal SIGUSR2" in log
        and "this job is timed-out" in log
        and "DUE TO JOB REQUEUE" in log
    ), log[-3000:]
    assert 0 < resumed_step(log) < REQUEUE_STEPS
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "ok"
    assert weights_equal(tmp_path / "run", uninterrupted)


def hold_until_gone(pid: int, seconds: float) -> None:
    """Stop `pid` again and again (every 20 ms) until it has exited or `seconds` have passed."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            os.kill(pid, signal.SIGSTOP)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (ProcessLookupError, FileNotFoundError):
            return
        time.sleep(0.02)


def test_preemption_requeues_and_resumes_to_the_same_weights(tiny_data, uninterrupted, tmp_path):
    spec = long_spec(tiny_data, REQUEUE_STEPS)
    work = tmp_path / "work"
    proc = start_dispatch(spec, tiny_data[2], tmp_path, {"backend": "slurm", "slurm": SLURM})
    try:
        job_id = running_with_checkpoint(work)
        # Hold the training so that it cannot finish before the preemption ends it, however fast
        # the machine: SLURM continues the task (SIGCONT) before its SIGTERM, so it is stopped
        # again until KillWait's SIGKILL takes it.
        pid = task_pid(work)
        os.kill(pid, signal.SIGSTOP)
        # what a preempting scheduler does: SIGTERM, SIGKILL after KillWait, back to the queue
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        hold_until_gone(pid, 60)
        finish_dispatch(proc)
    finally:
        proc.kill()
        subprocess.run(
            ["scancel", json.loads((work / "job.json").read_text())["job_id"]], check=False
        )
    assert job_info(job_id)["Restarts"] == "1"
    log = job_log(work, job_id)
    assert "DUE TO JOB REQUEUE" in log and "SIGUSR2" not in log, log[-3000:]
    assert 0 < resumed_step(log) < REQUEUE_STEPS
    assert weights_equal(tmp_path / "run", uninterrupted)


def test_preemption_signal_checkpoints_the_step_in_progress_and_the_job_resumes_there(
    tiny_data, uninterrupted, tmp_path
):
    """Not held this time: the preemption's SIGTERM reaches the training, which finishes its step,
    checkpoints it and exits within KillWait; the requeued job resumes from that step."""
    spec = long_spec(tiny_data, REQUEUE_STEPS)
    work = tmp_path / "work"
    proc = start_dispatch(spec, tiny_data[2], tmp_path, {"backend": "slurm", "slurm": SLURM})
    try:
        job_id = running_with_checkpoint(work)
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        finish_dispatch(proc)
    finally:
        proc.kill()
        subprocess.run(
            ["scancel", json.loads((work / "job.json").read_text())["job_id"]], check=False
        )
    log = job_log(work, job_id)
    (step,) = {int(s) for s in re.findall(r"SIGTERM: checkpointed step (\d+)", log)}
    assert "DUE TO JOB REQUEUE" in log and resumed_step(log) == step < REQUEUE_STEPS, log[-3000:]
    assert weights_equal(tmp_path / "run", uninterrupted)


def _run_seconds(text: str) -> int:
    """SLURM's [D-]HH:MM:SS as seconds."""
    days, _, hms = text.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


# --- through Snakemake, as users run it: `snakemake --profile slurm` in a copy of the repository


@pytest.fixture(scope="module")
def tokenized(wiki_jsonl, tmp_path_factory) -> Path:
    """The tokenizer and shards of the tests' grids (they share corpus and tokenizer), built
    once."""
    from tests.workflow_runs import copy_workflow, write_config

    root = copy_workflow(tmp_path_factory.mktemp("tokenized"))
    config = slurm_grid(wiki_jsonl)
    write_config(root, config)
    snakemake(
        root, "--cores", "2", f"results/data/{expand_grid(load_config(config)).data_id}/meta.json"
    )
    return root / "results"


def workflow_root(tmp: Path, config: dict, tokenized: Path | None = None) -> Path:
    """A copy of the workflow with `config`, and the tokenized corpus (copied with its times:
    Snakemake sees it up to date) when given."""
    from tests.workflow_runs import copy_workflow, write_config

    tmp.mkdir(parents=True, exist_ok=True)
    root = copy_workflow(tmp)
    write_config(root, config)
    if tokenized is not None:
        for name in ("tokenizers", "data"):
            shutil.copytree(tokenized / name, root / "results" / name)
    return root


def slurm_grid(wiki_jsonl, architectures=("pre_ln", "post_ln"), **slurm) -> dict:
    """A grid of tiny runs, training only; `launcher.slurm` as the tests' jobs need it (the
    profile sets launcher.backend: slurm)."""
    config = tiny_config(wiki_jsonl, architectures=list(architectures))
    config["probes"] = {"enabled": False}
    config["nll"] = {**config.get("nll", {}), "enabled": False}
    config["launcher"] = {"backend": "inline", "slurm": {**SLURM, **slurm}}
    return config


def snakemake(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*SNAKEMAKE, *args], cwd=root, capture_output=True, text=True, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def train_records(run_dir: Path) -> list[dict]:
    """The loss curve without the timing fields (tokens/s, MFU), which differ between runs."""
    keep = ("step", "tokens", "train_loss", "val_loss", "lr", "grad_norm")
    return [
        {k: r[k] for k in keep if k in r}
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]


def test_profile_slurm_trains_through_sbatch_bit_for_bit_like_inline(
    wiki_jsonl, tokenized, tmp_path
):
    config = slurm_grid(wiki_jsonl)
    on_slurm = workflow_root(tmp_path / "slurm", config, tokenized)
    inline = workflow_root(tmp_path / "inline", config, tokenized)
    proc = snakemake(on_slurm, "--profile", "slurm", "tables")
    assert "rule tokenize:" not in proc.stdout + proc.stderr  # the copied shards are up to date
    snakemake(inline, "--cores", "2", "tables")
    run_ids = sorted(p.name for p in (on_slurm / "results" / "runs").iterdir())
    assert len(run_ids) == 2 and run_ids == sorted(
        p.name for p in (inline / "results" / "runs").iterdir()
    )
    for run_id in run_ids:
        record = json.loads((on_slurm / "results" / "work" / run_id / "job.json").read_text())
        info = job_info(record["job_id"])  # a real batch job, as configured
        assert (
            record["backend"] == "slurm"
            and info["JobName"] == "depthbench"
            and info["JobState"] == "COMPLETED"
        )
        assert info["Partition"] == "debug" and info["NumCPUs"] == "1" and info["BatchFlag"] == "1"
        slurm_run, inline_run = (
            on_slurm / "results" / "runs" / run_id,
            inline / "results" / "runs" / run_id,
        )
        assert weights_equal(slurm_run, inline_run), run_id
        assert train_records(slurm_run) == train_records(inline_run)
        summaries = [json.loads((d / "summary.json").read_text()) for d in (slurm_run, inline_run)]
        assert (
            summaries[0]["status"] == "ok"
            and summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]
        )


def snakemake_in_background(root: Path, log: Path) -> subprocess.Popen:
    with open(log, "a") as out:  # its own session: killed as a whole, like a lost login shell
        return subprocess.Popen(
            [*SNAKEMAKE, "--profile", "slurm", "tables"],
            cwd=root,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def kill_snakemake(proc: subprocess.Popen) -> None:
    """SIGKILL Snakemake and its jobs (the dispatcher too: nothing gets to cancel the SLURM job)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    def gone():
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, 30, "Snakemake's processes to exit")


def restart_snakemake(root: Path, out: Path, log: Path, job_id: str) -> subprocess.Popen:
    """Remove the lock the killed Snakemake left (as a user would), start it again and wait
    until its dispatcher has re-attached to `job_id`."""
    snakemake(root, "--unlock")
    log.unlink()  # the killed dispatcher's (Snakemake would truncate it for the new one)
    proc = snakemake_in_background(root, out)
    wait_for(
        lambda: log.exists() and f"re-attached to running SLURM job {job_id}" in log.read_text(),
        180,
        f"the restarted dispatcher to re-attach to job {job_id}",
    )
    return proc


def test_snakemake_killed_and_restarted_reattaches_to_the_queued_then_running_job(
    wiki_jsonl, tokenized, tmp_path
):
    config = slurm_grid(wiki_jsonl, architectures=["pre_ln"])
    config["train"].update(tokens_per_param=50.0, max_steps=300)  # still training when it is held
    root = workflow_root(tmp_path / "wf", config, tokenized)
    (run_id,) = list(expand_grid(load_config(config)).runs)
    work, log = (
        root / "results" / "work" / run_id,
        root / "results" / "logs" / "train" / f"{run_id}.log",
    )
    out = tmp_path / "snakemake.out"
    # both CPUs taken: the run's job stays queued until this one is cancelled
    blocker = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-J",
            "blocker",
            "-c",
            "2",
            "--mem=100M",
            "-o",
            "/dev/null",
            "--wrap",
            "sleep 600",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    proc = None
    try:
        wait_for(lambda: job_info(blocker)["JobState"] == "RUNNING", 60, "the blocking job to run")
        proc = snakemake_in_background(root, out)
        wait_for(lambda: (work / "job.json").exists(), 180, "the run's job to be submitted")
        job_id = json.loads((work / "job.json").read_text())["job_id"]
        assert f"submitted slurm job {job_id}" in log.read_text()
        assert job_info(job_id)["JobState"] == "PENDING"
        kill_snakemake(proc)
        assert job_info(job_id)["JobState"] == "PENDING"  # killing Snakemake left the job queued
        proc = restart_snakemake(root, out, log, job_id)

        subprocess.run(["scancel", blocker], check=True)
        wait_for(
            lambda: job_info(job_id)["JobState"] == "RUNNING" and checkpoint_steps(work),
            120,
            "the job to run",
        )
        kill_snakemake(proc)
        pid = task_pid(work)
        os.kill(
            pid, signal.SIGSTOP
        )  # held while Snakemake is down: it cannot end before the restart
        assert job_info(job_id)["JobState"] == "RUNNING"
        proc = restart_snakemake(root, out, log, job_id)
        os.kill(pid, signal.SIGCONT)
        assert proc.wait(timeout=300) == 0, out.read_text()[-3000:]
        proc = None
    finally:
        if proc is not None:
            kill_snakemake(proc)
        subprocess.run(["scancel", blocker], check=False)
    assert "submitted slurm job" not in log.read_text()  # the last dispatcher only re-attached
    assert {p.name.split("_")[0] for p in (work / "submitit").iterdir() if p.name[0].isdigit()} == {
        job_id
    }
    assert json.loads((work / "job.json").read_text())["job_id"] == job_id
    # one job ran the whole training, once: it never restarted
    info = job_info(job_id)
    assert info["JobState"] in ("COMPLETED", "COMPLETING") and info["Restarts"] == "0"
    assert "resumed" not in job_log(work, job_id)
    assert (
        json.loads((root / "results" / "runs" / run_id / "summary.json").read_text())["status"]
        == "ok"
    )


def test_two_gloo_tasks_on_the_node_equal_one_rank(tiny_data, tmp_path):
    (spec,) = tiny_data[1].runs.values()
    spec = dataclasses.replace(
        spec, train=dataclasses.replace(spec.train, parallel="ddp", log_every=1)
    )
    one = train(
        spec,
        tiny_data[2],
        RunPaths(tmp_path / "one" / "run", tmp_path / "one" / "work"),
        progress=False,
    )
    launcher = {"backend": "slurm", "slurm": {**SLURM, "tasks_per_node": 2}}
    two = dispatch(
        spec, tiny_data[2], str(tmp_path / "two" / "run"), str(tmp_path / "two" / "work"), launcher
    )
    assert one["world_size"] == 1 and two["world_size"] == 2 and two["status"] == "ok"
    job_id = json.loads((tmp_path / "two" / "work" / "job.json").read_text())["job_id"]
    assert job_info(job_id)["NumTasks"] == "2"
    ref, got = train_records(tmp_path / "one" / "run"), train_records(tmp_path / "two" / "run")
    assert [r["step"] for r in ref] == [r["step"] for r in got] and len(
        ref
    ) == spec.train.total_steps
    for a, b in zip(ref, got):  # the same update as one rank: gradients summed in another order
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5), a["step"]
    assert max_weight_diff(tmp_path / "one" / "run", tmp_path / "two" / "run") < WEIGHT_TOLERANCE


def test_a_failed_job_reaches_the_snakemake_log_and_the_run_is_failed_not_diverged(
    wiki_jsonl, tokenized, tmp_path
):
    if torch.cuda.is_available():
        pytest.skip("the failure used here is asking for CUDA on a machine without it")
    config = slurm_grid(wiki_jsonl, architectures=["pre_ln"])
    config["train"]["device"] = "cuda"  # valid config; the CPU node's job raises
    root = workflow_root(tmp_path / "wf", config, tokenized)
    proc = snakemake(root, "--profile", "slurm", "tables", check=False)
    assert proc.returncode != 0
    (run_id,) = list(expand_grid(load_config(config)).runs)
    error = "train.device is 'cuda' but no CUDA device is available"
    (snakemake_log,) = (root / ".snakemake" / "log").glob("*.snakemake.log")
    text = snakemake_log.read_text()
    assert "Error in rule train" in text and "--- end of the job's stderr ---" in text, text[-4000:]
    tail = text.split("--- end of the job's stderr ---", 1)[1]
    assert error in tail and "Traceback" in tail  # from the job's own stderr
    record = json.loads((root / "results" / "work" / run_id / "job.json").read_text())
    assert record["state"] == "failed" and error in record["error"]
    assert job_info(record["job_id"])["JobState"] in ("COMPLETED", "FAILED")
    assert not (
        root / "results" / "runs" / run_id / "summary.json"
    ).exists()  # no summary: not a diverged run
    assert not (root / "results" / "tables").exists()


def test_launcher_slurm_fields_reach_sbatch(tmp_path):
    def environment() -> dict:  # runs in the job (pickled by value)
        import os

        return {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}

    launcher = {
        "backend": "slurm",
        "slurm": {
            "partition": "long",
            "gpus_per_node": 0,
            "cpus_per_task": 1,
            "mem_gb": 2,
            "time_min": 7,
            "extra": {"comment": "depthbench-fields", "nice": 7},
        },
    }
    env = submit_and_wait(environment, (), "fields", str(tmp_path), launcher)
    assert env["SLURM_JOB_PARTITION"] == "long" and env["SLURM_CPUS_PER_TASK"] == "1"
    assert env["SLURM_MEM_PER_NODE"] == "2048" and env["SLURM_JOB_NAME"] == "depthbench"
    info = job_info(env["SLURM_JOB_ID"])
    assert (
        info["TimeLimit"] == "00:07:00"
        and info["Comment"] == "depthbench-fields"
        and info["Nice"] == "7"
    )
    assert info["MinMemoryNode"] == "2G" and info["NumCPUs"] == "1"


def test_a_job_killed_without_a_result_is_reported_not_waited_for(tmp_path, monkeypatch):
    """Without accounting submitit sees no job state and would wait forever; squeue shows it."""
    import depthbench.launch.local as launch

    def killed():  # what the kernel's OOM killer does to a job
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(launch, "LOST_JOB_GRACE_S", 1.0)
    with pytest.raises(RuntimeError, match=r"ended (FAILED|COMPLETED) without a result"):
        submit_and_wait(killed, (), "killed", str(tmp_path), {"backend": "slurm", "slurm": SLURM})
    assert json.loads((tmp_path / "job.json").read_text())["state"] == "failed"


def test_an_unknown_partition_is_refused_before_any_work(wiki_jsonl, tmp_path):
    root = workflow_root(
        tmp_path / "wf", slurm_grid(wiki_jsonl, architectures=["pre_ln"], partition="gpu-nope")
    )
    proc = snakemake(root, "--profile", "slurm", "tables", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert (
        "config field 'launcher.slurm.partition'" in out and "unknown partition 'gpu-nope'" in out
    ), out[-3000:]
    assert "['debug', 'long']" in out
    assert not (root / "results").exists()  # nothing tokenized, nothing submitted
