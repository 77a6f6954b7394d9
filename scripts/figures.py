"""Snakemake entry of every figure rule: draw the rule's registered figures from its tables."""

import sys

from depthbench.analysis import registry
from depthbench.analysis.readers import read_tables

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
out = snakemake.output  # noqa: F821
tables = read_tables({k: v for k, v in snakemake.input.items()})  # noqa: F821
ctx = registry.context(snakemake.params.settings)  # noqa: F821
for name in snakemake.params.names:  # noqa: F821
    registry.render(name, tables, ctx, out[f"{name}_png"], out[f"{name}_pdf"])
