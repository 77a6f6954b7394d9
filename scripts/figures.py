"""Snakemake entry of every figure rule: draw the rule's registered figures from its tables."""

import sys

from depthbench.analysis import registry
from depthbench.analysis.readers import read_tables
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
out = snakemake.output  # noqa: F821
tables = read_tables({k: v for k, v in snakemake.input.items()})  # noqa: F821
ctx = registry.context(snakemake.params.settings)  # noqa: F821
for name in snakemake.params.names:  # noqa: F821
    registry.render(name, tables, ctx, out[f"{name}_png"], out[f"{name}_pdf"])

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
