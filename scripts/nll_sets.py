"""Snakemake entry: tokenize the evaluation sets once for the experiment's tokenizer."""

import sys

from depthbench.evals.run import build_sets
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
table = build_sets(
    snakemake.params.settings,
    snakemake.input.tokenizer,
    snakemake.params.eos_token,
    snakemake.output[0],
)  # noqa: F821
print(
    table.groupby(["domain", "set"])
    .agg(docs=("doc_id", "size"), source=("n_docs_source", "first"), tokens=("n_tokens", "sum"))
    .to_string(),
    file=sys.stderr,
)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
