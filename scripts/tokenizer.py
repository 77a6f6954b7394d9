"""Snakemake entry: train or copy the tokenizer of the experiment."""

import sys

from depthbench.data.prepare import build_tokenizer

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
build_tokenizer(snakemake.params.config, snakemake.output[0])  # noqa: F821
