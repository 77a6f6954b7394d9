"""Snakemake entry: dispatch the probe stage of one run (logic in depthbench.probes.run)."""

import sys

from depthbench.spec.run import RunSpec
from depthbench.launch.local import dispatch_probes
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
# the device (train.device) and threads are operational: from the config, not params
spec = RunSpec.from_dict(snakemake.params.spec).with_operational(snakemake.config["train"])  # noqa: F821
report = dispatch_probes(
    spec,
    data_dir=snakemake.params.data_dir,  # noqa: F821
    run_dir=snakemake.params.run_dir,  # noqa: F821
    work_dir=snakemake.params.work_dir,  # noqa: F821
    out_path=snakemake.output[0],  # noqa: F821
    settings=snakemake.params.settings,  # noqa: F821
    launcher=snakemake.config["launcher"],  # noqa: F821
    threads=snakemake.threads,  # noqa: F821
)
print(report, file=sys.stderr)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
