"""Snakemake entry: dispatch the training of one run (logic in depthbench.launch.local)."""

import sys

from depthbench.spec.run import RunSpec
from depthbench.launch.local import dispatch
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821 (injected by Snakemake)
# threads, checkpoint/log intervals, device, compile, loggers: from the config, not params (no
# retraining); the experiment name groups the run in the trackers
operational = {**snakemake.config["train"], "experiment": snakemake.config["name"]}  # noqa: F821
# the steps whose weights the run keeps for the probes over training (probes.at_steps), resolved
# for this run's length by the rule; not part of the run's identity
operational["snapshot_steps"] = list(getattr(snakemake.params, "snapshot_steps", []))  # noqa: F821
spec = RunSpec.from_dict(snakemake.params.spec).with_operational(operational)  # noqa: F821
summary = dispatch(
    spec,
    data_dir=snakemake.params.data_dir,  # noqa: F821
    run_dir=snakemake.params.run_dir,  # noqa: F821
    work_dir=snakemake.params.work_dir,  # noqa: F821
    launcher=snakemake.config["launcher"],  # noqa: F821 (not a param: changing it must not retrain)
    threads=snakemake.threads,  # noqa: F821
)
print(
    f"[{spec.run_id}] {summary['status']}: final val loss {summary['final_val_loss']}",
    file=sys.stderr,
)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
