"""One trainer per run, and a trainer that stops once nobody waits for it.

The lock: `<work_dir>/train.lock`, an exclusive `flock` taken by rank 0 of a training job before
anything else is done and held until training returns. The kernel releases it whenever the
process ends, SIGKILL included, so a killed run resumes as before. The file holds the holder's
pid, host and start time. A second trainer of the same run (a restarted Snakemake whose earlier
job is still training, after `--unlock`) refuses at once with `RunLockedError`, naming the holder
and the lock file. Every rank of a job refuses: the ranks agree on rank 0's outcome. On a file
system without `flock` a warning says so and the run goes on unlocked.

The owner: the process that waits for the run's result, on the machine the trainer runs on (the
Snakemake process that started the dispatching job, depthbench.launch.local). SIGKILL of Snakemake
leaves its jobs running with nobody waiting for them. `OwnerHook` checks after every periodic
checkpoint whether the owner still exists, and when it does not, the trainer stops there. That
checkpoint is complete, so a rerun of Snakemake resumes from it. SLURM jobs have no owner: a
restarted Snakemake re-attaches to a job that is still running (depthbench.launch.local).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

from depthbench.util.errors import DepthBenchError
from depthbench.train.hook_base import Hook

LOCK_NAME = "train.lock"


class RunLockedError(DepthBenchError):
    """Another process holds the run's lock: it is training the same run into the same folder."""


def process_identity(pid: int) -> str:
    """'<pid>:<start time>': a process's pid with its start time (from /proc, in clock ticks since
    boot) so that a later process given the same pid is not mistaken for it; '<pid>:' without
    /proc."""
    return f"{pid}:{_start_time(pid) or ''}"


def process_exists(identity: str) -> bool:
    """Whether the process `process_identity` described is still running (not a later one with
    its pid)."""
    pid_text, _, started = identity.partition(":")
    pid = int(pid_text)
    now = _start_time(pid)
    if now is not None:
        return not started or now == started
    if Path("/proc/self/stat").exists():  # /proc is there and has no such process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    if fields[0] == "Z":  # a zombie has ended; only its exit status is left for its parent
        return None
    return fields[19]  # field 22 of proc(5): starttime


class RunLock:
    """The held lock of one run (see the module docstring); `release` is idempotent."""

    def __init__(self, path: Path, file=None):
        self.path, self.file = path, file

    @classmethod
    def acquire(cls, work_dir: str | os.PathLike, run_id: str) -> "RunLock":
        """Take the lock of the run whose work folder is `work_dir`, or raise RunLockedError."""
        import fcntl

        path = Path(work_dir) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        # never truncated before the lock is held: the holder's record stays readable
        file = open(path, "a+")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                file.seek(0)
                holder = _describe(file.read())
                file.close()
                raise RunLockedError(
                    f"run {run_id} is already being trained by {holder}, "
                    f"which holds the lock {path}; "
                    "a second trainer would write into the same checkpoints. "
                    "Wait for it to end, or stop that process, then run again "
                    "(it resumes from the last checkpoint)"
                ) from None
            file.close()
            print(
                f"[{run_id}] warning: {path}: the file system does not support flock "
                f"({exc.strerror}); "
                "training without the one-trainer-per-run lock",
                file=sys.stderr,
            )
            return cls(path)
        file.seek(0)
        file.truncate()
        json.dump(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "run_id": run_id,
                "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            },
            file,
        )
        file.write("\n")
        file.flush()
        return cls(path, file)

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the last descriptor releases the flock
            self.file = None


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"process {holder['pid']} on host {holder['host']} (since {holder['since']})"
    except (ValueError, KeyError, TypeError):
        return "another process (its record in the lock file is not readable yet)"


def acquire_for_job(work_dir: str | os.PathLike, run_id: str, ctx, device_name: str) -> RunLock:
    """`RunLock.acquire` on rank 0 of the job described by `ctx` (a DistContext), the outcome
    the same on every rank: a job whose rank 0 is refused is refused on every rank, so that no
    rank waits for the others in a collective."""
    lock, error = RunLock(Path(work_dir) / LOCK_NAME), None
    if ctx.is_main:
        try:
            lock = RunLock.acquire(work_dir, run_id)
        except RunLockedError as exc:
            error = exc
    if ctx.enabled:
        import torch

        from depthbench.train import distributed

        device = (
            torch.device(device_name) if device_name.startswith("cuda") else torch.device("cpu")
        )
        if distributed.all_reduce_mean(float(error is not None), ctx, device) > 0 and error is None:
            lock.release()
            error = RunLockedError(
                f"run {run_id}: rank 0 of this job found the lock {Path(work_dir) / LOCK_NAME} "
                "held by another trainer (its log names it)"
            )
    if error is not None:
        raise error
    return lock


class OwnerHook(Hook):
    """After each periodic checkpoint (`every` steps, not at the last step), stop the run if the
    process `owner` (a `process_identity`) has ended: the checkpoint is waited for, and the process
    exits with status 1. The ranks agree (the largest verdict over a CPU group) and stop
    together."""

    def __init__(self, owner: str, every: int, total: int):
        self.owner, self.every, self.total = owner, every, total
        self.group = None

    def on_fit_start(self, trainer):
        import torch.distributed as dist

        if trainer.ctx.enabled:
            self.group = (
                dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            )

    def _gone(self) -> bool:
        gone = not process_exists(self.owner)
        if self.group is None:
            return gone
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(gone)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def on_step_logged(self, trainer, step):
        if step % self.every or step >= self.total or not self._gone():
            return
        trainer.snapshot(blocking=True)  # the periodic save of this step, complete before the exit
        if trainer.ctx.is_main:
            print(
                f"[{trainer.spec.run_id}] the process {self.owner.split(':')[0]} "
                "that started this training (Snakemake) has ended: "
                f"stopped at the checkpoint of step {step}; "
                "run Snakemake again to resume from it",
                file=sys.stderr,
            )
        raise SystemExit(1)
