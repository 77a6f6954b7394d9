"""What a submitted job runs: the callables submitit pickles and calls in the job's process.
`TrainingJob` trains one run (checkpointable: on SLURM a preemption or time-out requeues it, and
the requeued job resumes from the run's latest checkpoint, since it always starts by loading
one); `ProbeJob`, `NLLJob` and `RemovalJob` run one run's probe, NLL and removal stage (short,
not checkpointable: they simply run again). `export_distributed_env` turns submitit's job
environment into torch.distributed's env:// variables."""

from __future__ import annotations

import submitit

from depthbench.spec.run import RunSpec


class TrainingJob(submitit.helpers.Checkpointable):
    """The function submitit runs. `checkpoint` (inherited) resubmits it with the same
    arguments; training state is on disk, so the resubmitted job continues the run."""

    def __call__(
        self,
        spec: dict,
        data_dir: str,
        run_dir: str,
        work_dir: str,
        progress: bool = True,
        owner: str | None = None,
    ) -> dict:
        """Train the run, holding its lock (one trainer per run, depthbench.train.owner) from before
        anything is built until training returns; stop at a checkpoint once `owner` has ended."""
        from depthbench.train import distributed
        from depthbench.train.recipe import RunPaths
        from depthbench.train.loop import train
        from depthbench.train.owner import acquire_for_job

        export_distributed_env()
        run = RunSpec.from_dict(spec)
        # train() finds it joined
        ctx, device_name = distributed.setup(run.train.parallel, run.train.device)
        lock = acquire_for_job(work_dir, run.run_id, ctx, device_name)
        try:
            return train(run, data_dir, RunPaths(run_dir, work_dir), progress=progress, owner=owner)
        finally:
            lock.release()


def export_distributed_env() -> int:
    """In a submitit job with several tasks (SLURM tasks, or local processes), set MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK from submitit's job environment, so that
    torch.distributed's env:// initialisation works without torchrun. Returns the world size."""
    try:
        env = submitit.JobEnvironment()
        n_tasks = env.num_tasks
    except Exception:  # not inside a submitit job (inline tests) or a debug job: one rank
        return 1
    if n_tasks > 1:
        # CUDA_VISIBLE_DEVICES is left alone (asking torch about CUDA here could initialise it
        # before the variable takes effect): each rank picks its GPU by LOCAL_RANK in
        # depthbench.train.distributed.setup, whether SLURM shows a task all GPUs or one.
        submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True
        )
    return n_tasks


class ProbeJob:
    """The probe stage of one run, run by submitit like training (not checkpointable: a probe
    job is short and simply runs again)."""

    def __call__(
        self, spec: dict, data_dir: str, run_dir: str, out_path: str, settings: dict
    ) -> dict:
        from depthbench.probes.run import run_probes

        return run_probes(spec, data_dir, run_dir, out_path, settings)


class NLLJob:
    """The NLL stage of one run (short, not checkpointable: it simply runs again)."""

    def __call__(
        self, spec: dict, run_dir: str, sets_path: str, out_path: str, settings: dict
    ) -> dict:
        from depthbench.evals.run import run_nll

        return run_nll(spec, run_dir, sets_path, out_path, settings)


class RemovalJob:
    """The removal stage of one run (short, not checkpointable: it simply runs again)."""

    def __call__(
        self,
        spec: dict,
        data_dir: str,
        run_dir: str,
        probes_path: str,
        sets_path: str,
        out_path: str,
        settings: dict,
        probe_settings: dict,
    ) -> dict:
        from depthbench.probes.removal_run import run_removal

        return run_removal(
            spec, data_dir, run_dir, probes_path, sets_path, out_path, settings, probe_settings
        )
