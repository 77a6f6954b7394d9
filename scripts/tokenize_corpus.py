"""Snakemake entry: tokenize the corpus into train/val token shards (one job), or, with
corpus.pieces > 1, count documents (tokenize_index), tokenize one piece (tokenize_piece) or merge
the pieces into meta.json (tokenize)."""

import json
import os
import sys

from depthbench.data.prepare import build_index, build_piece, build_shards, merge_shards
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
rule, params = snakemake.rule, snakemake.params  # noqa: F821
if rule == "tokenize_index":
    index = build_index(params.config, snakemake.output[0])  # noqa: F821
    print(
        json.dumps({k: v for k, v in index.items() if k != "units"}), file=sys.stderr
    )  # units: maybe thousands of files
elif rule == "tokenize_piece":
    out = os.path.dirname(snakemake.output[0])  # noqa: F821
    info = build_piece(
        params.config,
        snakemake.input.tokenizer,
        snakemake.input.index,
        int(snakemake.wildcards.piece),
        out,
    )  # noqa: F821
    print(json.dumps({k: info[k] for k in ("train", "val", "seconds")}, indent=2), file=sys.stderr)
elif "pieces" in snakemake.input.keys():  # noqa: F821
    dirs = [os.path.dirname(p) for p in snakemake.input.pieces]  # noqa: F821
    meta = merge_shards(
        params.config,
        snakemake.input.tokenizer,
        dirs,
        params.out_dir,
        params.data_id,
        params.tokenizer_id,
    )  # noqa: F821
    print(
        json.dumps({k: meta[k] for k in ("train", "val", "unigram_val_loss")}, indent=2),
        file=sys.stderr,
    )
else:
    meta = build_shards(
        params.config,
        snakemake.input.tokenizer,
        params.out_dir,
        params.data_id,
        params.tokenizer_id,
    )  # noqa: F821
    print(
        json.dumps({k: meta[k] for k in ("train", "val", "unigram_val_loss", "seconds")}, indent=2),
        file=sys.stderr,
    )

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
