"""Snakemake entry: draw the training-dynamics figure from results/tables/dynamics.parquet."""

import sys

import pandas as pd

from depthbench.figures import dynamics

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
cfg = snakemake.params.figures  # noqa: F821
dynamics(
    pd.read_parquet(snakemake.input.dynamics), pd.read_parquet(snakemake.input.runs), pd.read_parquet(snakemake.input.best_lr),  # noqa: F821
    snakemake.output.dynamics_png, snakemake.output.dynamics_pdf, width=cfg["width_in"], height=cfg["height_in"], dpi=cfg["dpi"],  # noqa: F821
    title=f"{snakemake.params.experiment}: training dynamics",  # noqa: F821
)
