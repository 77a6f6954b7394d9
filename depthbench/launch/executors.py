"""The submitit executor of each launcher backend: `inline` (the job runs in this process when
its result is asked for), `local` (subprocesses, `launcher.local_ranks` of them per run) and
`slurm` (sbatch settings from `launcher.slurm`), and how many ranks a run gets from each."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import submitit
import submitit.local.debug

from depthbench.spec.schema import with_defaults

BACKENDS = ("inline", "local", "slurm")


class InlineJob(submitit.local.debug.DebugJob):
    """submitit's debug job (the function runs in this process when its result is asked for),
    except that a failure is raised as it is: the debug job opens a pdb post-mortem prompt, which
    in a workflow job run from a terminal waits for input forever."""

    def results(self):
        self._check_not_cancelled()
        if self._submission.done():
            return [self._submission._result]
        environ = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.environ)  # the environment of submission time, as submitit's job
        try:
            return [self._submission.result()]
        finally:
            os.environ.clear()
            os.environ.update(environ)


class InlineExecutor(submitit.local.debug.DebugExecutor):
    job_class = InlineJob

    def _internal_process_submissions(self, delayed_submissions):
        return [InlineJob(self.folder, ds) for ds in delayed_submissions]


def ranks_per_run(launcher: dict) -> int:
    """How many training processes one run gets from the launcher settings."""
    launcher = with_defaults("launcher", launcher)
    backend = launcher["backend"]
    if backend == "local":
        return int(launcher["local_ranks"])
    if backend == "slurm":
        return int(launcher["slurm"]["nodes"]) * tasks_per_node(launcher["slurm"])
    return 1


def tasks_per_node(slurm: dict) -> int:
    """SLURM tasks (torch.distributed ranks) per node: launcher.slurm.tasks_per_node, or one
    per GPU, or one on a node without GPUs."""
    if slurm["tasks_per_node"] is not None:
        return int(slurm["tasks_per_node"])
    return max(1, int(slurm["gpus_per_node"]))


def make_executor(launcher: dict, folder: Path, threads: int):
    launcher = with_defaults("launcher", launcher)
    backend = launcher["backend"]
    if backend == "inline":
        return InlineExecutor(folder=folder)
    if backend == "local":
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(
            timeout_min=int(launcher["slurm"]["time_min"]),
            tasks_per_node=int(launcher["local_ranks"]),
        )
        return executor
    if backend == "slurm":
        executor = submitit.SlurmExecutor(
            folder=folder, max_num_timeout=launcher["slurm"]["max_num_timeout"]
        )
        executor.update_parameters(**slurm_parameters(launcher))
        return executor
    raise ValueError(f"launcher.backend {backend!r}; valid: {BACKENDS}")


def slurm_parameters(launcher: dict) -> dict[str, Any]:
    """sbatch settings (submitit SlurmExecutor names) from config['launcher']['slurm']."""
    s = with_defaults("launcher", launcher)["slurm"]
    params: dict[str, Any] = {
        "job_name": "depthbench",
        "time": int(s["time_min"]),
        "nodes": int(s["nodes"]),
        "gpus_per_node": int(s["gpus_per_node"]),
        # one task per GPU by default, each a torch.distributed rank (depthbench.train.distributed)
        "ntasks_per_node": tasks_per_node(s),
        "cpus_per_task": int(s["cpus_per_task"]),
        "mem": f"{int(s['mem_gb'])}GB",
        # SIGUSR2 this long before the time limit: submitit then calls checkpoint() and requeues.
        "signal_delay_s": 120,
    }
    if s["partition"]:
        params["partition"] = s["partition"]
    if s["account"]:
        params["account"] = s["account"]
    if s["extra"]:
        params["additional_parameters"] = dict(s["extra"])
    return params
