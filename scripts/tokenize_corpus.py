"""Snakemake entry: tokenize the corpus into train/val token shards."""

import json
import sys

from depthbench.data.prepare import build_shards

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
meta = build_shards(
    snakemake.params.config,  # noqa: F821
    snakemake.input.tokenizer,  # noqa: F821
    snakemake.params.out_dir,  # noqa: F821
    snakemake.params.data_id,  # noqa: F821
    snakemake.params.tokenizer_id,  # noqa: F821
)
print(json.dumps({k: meta[k] for k in ("train", "val", "unigram_val_loss", "seconds")}, indent=2), file=sys.stderr)
