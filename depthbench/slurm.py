"""What DepthBench asks of SLURM itself, outside submitit: checking the `launcher.slurm` settings
before any work starts, and the live state of a job (from `squeue`, which needs no accounting
database, unlike submitit's `sacct`)."""

from __future__ import annotations

import re
import shutil
import subprocess

from depthbench.errors import ConfigError

# Job states in which a submitted job may still produce its result (squeue's long names).
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "PREEMPTED", "REQUEUE_FED", "REQUEUE_HOLD",
               "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT")
# An sbatch long option name: submitit writes each `extra` entry as `#SBATCH --<key>=<value>`.
_OPTION = re.compile(r"^[a-z][a-z0-9_-]*$")


def check_launcher(launcher: dict) -> None:
    """Refuse `launcher.slurm` settings that would break or subvert the batch script, naming the
    field: submitit writes each as one `#SBATCH` line, so a newline would end the option and
    start a shell command. An unknown partition is refused when SLURM is reachable from here
    (`sinfo`), so that a typo fails before the tokenizer and shards are built, not at sbatch."""
    s = launcher.get("slurm") or {}
    for field in ("partition", "account"):
        value = s.get(field)
        if value is not None and (not isinstance(value, str) or _has_control(value) or not value.strip()):
            raise ConfigError(f"launcher.slurm.{field}", f"{value!r} must be a single-line, non-empty name")
    for key, value in (s.get("extra") or {}).items():
        if not isinstance(key, str) or not _OPTION.match(key):
            raise ConfigError("launcher.slurm.extra", f"option name {key!r} must be an sbatch long option such as "
                                                      "'qos' or 'constraint' (lower-case letters, digits, '-', '_')")
        if isinstance(value, (dict, list)) or _has_control(str(value)):
            raise ConfigError(f"launcher.slurm.extra.{key}", f"{value!r} must be a single-line value (no newline)")
    partition = s.get("partition")
    known = partitions()
    if partition and known is not None and partition not in known:
        raise ConfigError("launcher.slurm.partition", f"unknown partition {partition!r}; this cluster has {sorted(known)}")


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or c == "\x7f" for c in text)


def partitions() -> set[str] | None:
    """The cluster's partition names, or None when SLURM cannot be asked from this machine (no
    `sinfo`, or no controller answering): planning a SLURM run elsewhere stays possible."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def queue_state(job_id: str) -> str | None:
    """The job's state as the controller has it now (`squeue`, ended jobs included while it keeps
    them, MinJobAge): `GONE` once it has forgotten the job, None when SLURM cannot be asked."""
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return "GONE" if "Invalid job id" in out.stderr else None
    states = out.stdout.split()
    return states[0] if states else "GONE"
