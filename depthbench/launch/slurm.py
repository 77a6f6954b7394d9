"""What DepthBench asks of SLURM itself, outside submitit: checking the `launcher.slurm` settings
before any work starts, and the live state of a job (from `squeue`, which needs no accounting
database, unlike submitit's `sacct`)."""

from __future__ import annotations

import re
import shutil
import subprocess

from depthbench.util.errors import ConfigError

# Job states in which a submitted job may still produce its result (squeue's long names).
LIVE_STATES = (
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "PREEMPTED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "SIGNALING",
    "STAGE_OUT",
)
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
        if value is not None and (
            not isinstance(value, str) or _has_control(value) or not value.strip()
        ):
            raise ConfigError(
                f"launcher.slurm.{field}", f"{value!r} must be a single-line, non-empty name"
            )
    for key, value in (s.get("extra") or {}).items():
        if not isinstance(key, str) or not _OPTION.match(key):
            raise ConfigError(
                "launcher.slurm.extra",
                f"option name {key!r} must be an sbatch long option such as "
                "'qos' or 'constraint' (lower-case letters, digits, '-', '_')",
            )
        if isinstance(value, (dict, list)) or _has_control(str(value)):
            raise ConfigError(
                f"launcher.slurm.extra.{key}", f"{value!r} must be a single-line value (no newline)"
            )
    partition = s.get("partition")
    known = partitions()
    if partition and known is not None and partition not in known:
        raise ConfigError(
            "launcher.slurm.partition",
            f"unknown partition {partition!r}; this cluster has {sorted(known)}",
        )


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or c == "\x7f" for c in text)


def partitions() -> set[str] | None:
    """The cluster's partition names, or None when SLURM cannot be asked from this machine (no
    `sinfo`, or no controller answering): planning a SLURM run elsewhere stays possible."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def gpu_gres(partition: str | None = None) -> list[str] | None:
    """The generic resources (`sinfo %G`) of the cluster's nodes, of `partition` when given; None
    when SLURM cannot be asked from this machine."""
    if shutil.which("sinfo") is None:
        return None
    command = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


def check_gpus(launcher: dict) -> None:
    """Refuse, before sbatch is called, a request for GPUs (`launcher.slurm.gpus_per_node` > 0)
    on a cluster (or partition) whose nodes have no GPU gres, which sbatch would reject as an
    invalid generic resource. Run by the dispatcher, not at validation, so that a GPU grid can
    still be planned (`snakemake -n`) from a machine whose SLURM has no GPUs."""
    s = launcher.get("slurm") or {}
    gpus = s.get("gpus_per_node") or 0
    if not gpus:
        return
    gres = gpu_gres(s.get("partition"))
    if gres is None:
        return
    if not any(entry.split(":", 1)[0] == "gpu" for line in gres for entry in line.split(",")):
        where = f"partition {s['partition']!r}" if s.get("partition") else "this cluster"
        raise ConfigError(
            "launcher.slurm.gpus_per_node",
            f"{gpus} GPUs per node requested, but the nodes of {where} have no GPU gres (sinfo: "
            f"{', '.join(gres) or 'none'}); for CPU runs set gpus_per_node: 0, e.g. "
            "--config 'launcher={backend: slurm, slurm: {gpus_per_node: 0}}'",
        )


def queue_state(job_id: str) -> str | None:
    """The job's state as the controller has it now (`squeue`, ended jobs included while it keeps
    them, MinJobAge): `GONE` once it has forgotten the job, None when SLURM cannot be asked."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return "GONE" if "Invalid job id" in out.stderr else None
    states = out.stdout.split()
    return states[0] if states else "GONE"
