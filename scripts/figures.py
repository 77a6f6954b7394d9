"""Snakemake entry: draw every figure from the tables."""

import sys

import pandas as pd

from depthbench import figures

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
out, fig_cfg = snakemake.output, snakemake.params.figures  # noqa: F821
size = dict(width=fig_cfg["width_in"], height=fig_cfg["height_in"], dpi=fig_cfg["dpi"])
runs = pd.read_parquet(snakemake.input.runs)  # noqa: F821
best = pd.read_parquet(snakemake.input.best_lr)  # noqa: F821
curves = pd.read_parquet(snakemake.input.curves)  # noqa: F821
name = snakemake.params.experiment  # noqa: F821
figures.headline(best, runs, out.headline_png, out.headline_pdf, title=f"{name}: loss vs shape at fixed budget", **size)
figures.loss_vs_lr(runs, out.loss_vs_lr_png, out.loss_vs_lr_pdf, title=f"{name}: loss vs learning rate", **size)
figures.loss_curves(curves, best, runs, out.loss_curves_png, out.loss_curves_pdf, title=f"{name}: validation loss at best LR", **size)
