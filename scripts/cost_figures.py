"""Snakemake entry: NLL and cost figures from their tables."""

import sys

import pandas as pd

from depthbench import cost_figures

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
out, fig_cfg, name = snakemake.output, snakemake.params.figures, snakemake.params.experiment  # noqa: F821
size = dict(width=fig_cfg["width_in"], height=fig_cfg["height_in"], dpi=fig_cfg["dpi"])
cost = pd.read_parquet(snakemake.input.cost)  # noqa: F821
cost_figures.cost_vs_ratio(cost, out.cost_vs_ratio_png, out.cost_vs_ratio_pdf, title=f"{name}: inference and memory cost vs shape", **size)
cost_figures.loss_vs_cost(cost, out.loss_vs_cost_png, out.loss_vs_cost_pdf, title=f"{name}: loss against cost", **size)
if "nll_vs_ratio_png" in out.keys():
    nll = pd.read_parquet(snakemake.input.nll)  # noqa: F821
    cost_figures.nll_vs_ratio(nll, out.nll_vs_ratio_png, out.nll_vs_ratio_pdf, title=f"{name}: teacher-forced NLL by domain", **size)
