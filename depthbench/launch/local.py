"""Dispatch of a run's training, probe, NLL and removal jobs through submitit: in-process, local
subprocess, or SLURM (the executors: depthbench.launch.executors; what each job runs:
depthbench.launch.jobs).

The dispatching Snakemake job runs on the submitting host: it submits one submitit job per run,
waits for it, and cancels it if Snakemake is interrupted. The training job is `Checkpointable`:
on SLURM a preemption or time-out requeues it, and the requeued job resumes from the run's
latest checkpoint (the function is idempotent: it always starts by loading one). A SLURM job's
live state comes from `squeue` (depthbench.launch.slurm), so that re-attachment and a job lost
without a result are seen on clusters without an accounting database (`sacct`). A failed job's
stderr tail goes into the dispatcher's log (Snakemake's rule log) and its job record.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import submitit

from depthbench.spec.run import RunSpec
from depthbench.util.io import atomic_write_json
from depthbench.train.runcheck import check_run
from depthbench.spec.schema import with_defaults
from depthbench.launch.executors import make_executor, ranks_per_run
from depthbench.launch.jobs import NLLJob, ProbeJob, RemovalJob, TrainingJob
from depthbench.launch.slurm import LIVE_STATES, check_gpus, queue_state
from depthbench.train.owner import process_identity


def _live_slurm_job(folder: Path, record: Path):
    """A SLURM job submitted by an earlier dispatch of this run that is still queued or running,
    from `squeue` (submitit's state comes from `sacct`, which needs an accounting database). A
    job that has ended is not re-attached: a new one resumes from the run's last checkpoint."""
    if not record.exists():
        return None
    try:
        saved = json.loads(record.read_text())
        job_id = str(saved["job_id"])
    except (OSError, ValueError, KeyError):
        return None
    if saved.get("backend") == "slurm" and queue_state(job_id) in LIVE_STATES:
        return submitit.SlurmJob(folder=folder, job_id=job_id)
    return None


LOST_JOB_GRACE_S = 60.0  # a job in a final state this long without a result file has none


def _wait(job, poll_s: float = 2.0) -> None:
    """Wait until `job` has a result. submitit alone would wait forever for a SLURM job that
    ended without writing one (killed for memory, cancelled, timed out for the last time) when
    the cluster has no accounting: such a job is seen here leaving the live states in `squeue`."""
    ended_at = None
    while not job.done():
        state = queue_state(job.job_id)
        if state is not None and state not in LIVE_STATES:
            ended_at = ended_at or time.time()
            # the result file may lag on a shared file system
            if time.time() - ended_at > LOST_JOB_GRACE_S:
                raise RuntimeError(f"SLURM job {job.job_id} ended {state} without a result")
        time.sleep(poll_s)


def _stderr_tail(job, lines: int = 40) -> str:
    try:
        text = job.stderr() or ""
    except Exception as exc:  # a log that cannot be read must not hide the job's own error
        text = f"(stderr unreadable: {exc})"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def submit_and_wait(
    fn,
    args: tuple,
    label: str,
    work_dir: str,
    launcher: dict,
    record_name: str = "job.json",
    reattach: bool = True,
) -> Any:
    """Submit `fn(*args)` with the configured backend, wait for it and return its result.

    On SLURM, a job recorded by an earlier dispatch that is still queued or running is
    re-attached instead of submitted again. SIGINT/SIGTERM (Ctrl-C on Snakemake) cancel the job.
    """
    work = Path(work_dir)
    folder = work / "submitit"
    folder.mkdir(parents=True, exist_ok=True)
    record = work / record_name
    launcher = with_defaults("launcher", launcher)
    backend = launcher["backend"]
    job = None

    def cancel(signum, frame):  # Snakemake interrupted: do not leave orphaned jobs behind
        try:
            if job is not None:
                print(f"[{label}] signal {signum}: cancelling job {job.job_id}", file=sys.stderr)
                job.cancel(check=False)
        finally:
            raise SystemExit(128 + signum)

    # Installed before submitting: no signal can fall between the submission and the handler,
    # and a local job's controller, started from here, inherits the default SIGINT disposition
    # rather than "ignored" (what a dispatcher started in the background of a non-interactive
    # shell has). submitit cancels a local job with SIGINT, which an ignoring controller would
    # never see, leaving the training running.
    previous = {s: signal.signal(s, cancel) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        job = _live_slurm_job(folder, record) if backend == "slurm" and reattach else None
        if job is None:
            executor = make_executor(launcher, folder, threads=1)
            # Submitting from inside a SLURM allocation would inherit its SLURM_* variables.
            with submitit.helpers.clean_env():
                job = executor.submit(fn, *args)
            atomic_write_json(
                record, {"job_id": str(job.job_id), "backend": backend, "folder": str(folder)}
            )
            print(
                f"[{label}] submitted {backend} job {job.job_id}; logs in {folder}", file=sys.stderr
            )
        else:
            print(f"[{label}] re-attached to running SLURM job {job.job_id}", file=sys.stderr)
        try:
            if backend == "slurm":
                _wait(job)
            return job.results()[0]  # rank 0's result when a job has several tasks
        except Exception as exc:
            # the job's own stderr into this dispatcher's log (Snakemake's rule log): the run
            # failed, which is not a divergence (that ends with a summary, status diverged)
            tail = _stderr_tail(job)
            atomic_write_json(
                record,
                {
                    "job_id": str(job.job_id),
                    "backend": backend,
                    "folder": str(folder),
                    "state": "failed",
                    "error": str(exc)[-4000:],
                },
            )
            print(
                f"[{label}] {backend} job {job.job_id} failed: {type(exc).__name__}\n"
                f"--- end of the job's stderr ---\n{tail}\n---",
                file=sys.stderr,
            )
            raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def dispatch(
    spec: RunSpec, data_dir: str, run_dir: str, work_dir: str, launcher: dict, threads: int = 1
) -> dict:
    """Submit the training of `spec`, wait for it and return its summary. A `train.seq_len` that
    the shards cannot fill is refused here, before anything is submitted."""
    from depthbench.data.shards import check_seq_len

    check_seq_len(data_dir, spec.train.seq_len)
    launcher = with_defaults("launcher", launcher)
    backend = launcher["backend"]
    if backend == "slurm":
        check_gpus(launcher)  # GPUs asked of a cluster without any: named here, not by sbatch
    spec_dict = spec.to_dict()
    # on this machine, share the cores Snakemake gave the job among the ranks
    if backend != "slurm":
        spec_dict["train"]["threads"] = max(1, threads // ranks_per_run(launcher))
    # On this machine the trainer watches the Snakemake process that runs this dispatcher (its
    # parent) and stops at a checkpoint if it ends; a SLURM job is re-attached to instead.
    owner = None if backend == "slurm" else process_identity(os.getppid())
    args = (spec_dict, str(data_dir), str(run_dir), str(work_dir), backend != "slurm", owner)
    summary = submit_and_wait(TrainingJob(), args, spec.run_id, work_dir, launcher)
    if backend == "slurm" and not (Path(run_dir) / "summary.json").exists():
        # A restarted Snakemake removes an incomplete job's outputs before its dispatcher
        # re-attaches: a job that wrote them in between lost them. Train again (from the last
        # checkpoint, to the same weights) to write them.
        print(
            f"[{spec.run_id}] the job's outputs were removed after it wrote them; training again",
            file=sys.stderr,
        )
        summary = submit_and_wait(
            TrainingJob(), args, spec.run_id, work_dir, launcher, reattach=False
        )
    return summary


def dispatch_probes(
    spec: RunSpec,
    data_dir: str,
    run_dir: str,
    work_dir: str,
    out_path: str,
    settings: dict,
    launcher: dict,
    threads: int = 1,
) -> dict:
    """Submit the probe stage of `spec` like its training, wait, and return its report; the run's
    identity and final weights are checked first (depthbench.train.runcheck), before any
    submission."""
    check_run(run_dir, spec)
    settings = _local_threads(settings, launcher, threads)
    args = (spec.to_dict(), str(data_dir), str(run_dir), str(out_path), settings)
    report = submit_and_wait(
        ProbeJob(), args, f"probe {spec.run_id}", work_dir, launcher, record_name="probe_job.json"
    )
    return _record_result(work_dir, "probe_job.json", report)


def dispatch_nll(
    spec: RunSpec,
    run_dir: str,
    work_dir: str,
    sets_path: str,
    out_path: str,
    settings: dict,
    launcher: dict,
    threads: int = 1,
) -> dict:
    """Submit the NLL stage of `spec` like its training, wait, and return its report; the run's
    identity and final weights are checked first (depthbench.train.runcheck), before any
    submission."""
    check_run(run_dir, spec)
    settings = _local_threads(settings, launcher, threads)
    args = (spec.to_dict(), str(run_dir), str(sets_path), str(out_path), settings)
    report = submit_and_wait(
        NLLJob(), args, f"nll {spec.run_id}", work_dir, launcher, record_name="nll_job.json"
    )
    return _record_result(work_dir, "nll_job.json", report)


def dispatch_removal(
    spec: RunSpec,
    data_dir: str,
    run_dir: str,
    work_dir: str,
    probes_path: str,
    sets_path: str,
    out_path: str,
    settings: dict,
    probe_settings: dict,
    launcher: dict,
    threads: int = 1,
) -> dict:
    """Submit the removal stage of `spec` like its training, wait, and return its report; the
    run's identity and final weights are checked first (depthbench.train.runcheck)."""
    check_run(run_dir, spec)
    settings = _local_threads(settings, launcher, threads)
    args = (
        spec.to_dict(),
        str(data_dir),
        str(run_dir),
        str(probes_path),
        str(sets_path),
        str(out_path),
        settings,
        probe_settings,
    )
    report = submit_and_wait(
        RemovalJob(), args, f"removal {spec.run_id}", work_dir, launcher, "removal_job.json"
    )
    return _record_result(work_dir, "removal_job.json", report)


def _record_result(work_dir: str, record_name: str, report: dict) -> dict:
    """The finished job's report (rows, seconds, the device it ran on) added to its record in
    the run's work dir, where depthbench.commands.workflow_record reads what ran where."""
    path = Path(work_dir) / record_name
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    atomic_write_json(path, {**saved, "state": "done", "result": report})
    return report


def _local_threads(settings: dict, launcher: dict, threads: int) -> dict:
    settings = dict(settings)
    # on this machine: the cores Snakemake gave
    if with_defaults("launcher", launcher)["backend"] != "slurm":
        settings["threads"] = threads
    return settings
