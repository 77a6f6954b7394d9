"""Snakemake entry: draw the probe figures from results/tables/probes.parquet."""

import sys

import pandas as pd

from depthbench import probe_figures

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
probes = pd.read_parquet(snakemake.input.probes)  # noqa: F821
fig_cfg = snakemake.params.figures  # noqa: F821
for name in snakemake.params.names:  # noqa: F821
    draw = getattr(probe_figures, name)
    draw(probes, snakemake.output[f"{name}_png"], snakemake.output[f"{name}_pdf"],  # noqa: F821
         title=f"{snakemake.params.experiment}: {name.replace('_', ' ')}",  # noqa: F821
         thresholds=snakemake.params.thresholds, width=fig_cfg["width_in"], height=fig_cfg["height_in"], dpi=fig_cfg["dpi"])  # noqa: F821
