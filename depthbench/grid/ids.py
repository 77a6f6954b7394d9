"""The identities the grid hashes into names: the tokenizer id, the data id and each run's id
`{arch}_L{n_layer}-d{d_model}_lr{lr}_s{seed}_{hash}`, where the hash covers everything else that
changes training (model config, recipe, data), so that editing the grid adds runs instead of
silently reusing old ones."""

from __future__ import annotations

from typing import Any

from depthbench.spec.run import RunSpec, short_hash


def tokenizer_id(config: dict) -> str:
    tok = config["tokenizer"]
    ident: dict[str, Any] = {"tokenizer": tok}
    if tok["kind"] == "bpe":  # trained on the corpus, so the corpus is part of its identity
        # pieces do not change its text
        ident["corpus"] = {
            k: v for k, v in config["corpus"].items() if k not in ("pieces", "piece_by")
        }
    if tok["kind"] in ("file", "olmo_eval"):
        from depthbench.data.tokenizer import resolve_tokenizer_file

        from depthbench.data.tokenizer import tokenizer_sha256

        ident["sha"] = tokenizer_sha256(resolve_tokenizer_file(tok))
    size = tok.get("vocab_size", "")
    return f"{tok['kind']}{size}-{short_hash(ident)}"


def data_id(config: dict) -> str:
    # corpus.pieces: 1 (the default) is left out, so data ids from before pieces existed stay;
    # more pieces change the training windows (none crosses a piece file), hence the data id.
    one = config["corpus"].get("pieces", 1) == 1  # piece_by means nothing with one piece
    corpus = {
        k: v for k, v in config["corpus"].items() if not (k in ("pieces", "piece_by") and one)
    }
    return (
        f"{config['corpus']['name']}-{short_hash({'corpus': corpus, 'tok': tokenizer_id(config)})}"
    )


def run_id_of(spec: RunSpec) -> str:
    """`{arch}_L{n_layer}-d{d_model}_lr{lr}_s{seed}_{hash}`, the hash over the spec's model
    config, recipe and data id (RunSpec.identity_dict, without the run id itself)."""
    ident = spec.identity_dict()
    ident = {"model": ident["model"], "train": ident["train"], "data": spec.data_id}
    return f"{spec.arch}_{spec.shape.tag}_lr{spec.lr:g}_s{spec.seed}_{short_hash(ident)}"
