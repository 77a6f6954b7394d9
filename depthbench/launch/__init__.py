"""Dispatch: running a job in-process, locally or on SLURM through submitit."""
