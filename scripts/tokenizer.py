"""Snakemake entry: train or copy the tokenizer of the experiment."""

import sys

from depthbench.data.prepare import build_tokenizer
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
build_tokenizer(snakemake.params.config, snakemake.output[0])  # noqa: F821

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
